"""KV cache specs: what one layer's cache page holds, and how layers group.

A *spec* says how one layer stores KV for ``block_size`` tokens and how large that page is in
bytes. Layers with the same spec form a ``KVCacheGroupSpec``; each group gets its own block table
but every group draws block ids from ONE shared ``BlockPool`` of ``KVCacheConfig.num_blocks`` ids
(block 0 is the null block), as vLLM v1's hybrid allocator does (vllm/v1/kv_cache_interface.py;
seed 000, "为什么要先分组").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "AttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MambaSpec",
    "SlidingWindowSpec",
]


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base spec. ``block_size`` is in tokens; ``page_size_bytes`` is for ONE layer's block."""

    block_size: int

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies (TypeError on the abstract base)."""
        raise TypeError(f"{type(self).__name__} is abstract: use a concrete spec")


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Paged K and V: ``[2, block_size, num_kv_heads, head_size]`` of ``dtype`` per layer block."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("num_kv_heads", self.num_kv_heads)
        _require_positive("head_size", self.head_size)
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def page_size_bytes(self) -> int:
        """``2 * block_size * num_kv_heads * head_size * dtype.itemsize`` (K and V, one layer)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole sequence: every block from position 0 is kept."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens (window includes the current token)."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("sliding_window", self.sliding_window)


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross attention: encoder K/V allocated once, never prefix cached."""


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state: one block holds the state after its last token.

    ``shapes`` are the per-layer state tensor shapes (e.g. conv state and SSM state);
    ``page_size_bytes`` is the sum of their sizes in ``dtype``.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.shapes or any(
            not shape or any(d < 1 for d in shape) for shape in self.shapes
        ):
            raise ValueError(f"shapes must be non-empty positive shapes, got {self.shapes!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def page_size_bytes(self) -> int:
        """``sum(prod(shape)) * dtype.itemsize``: every state tensor of one layer."""
        return sum(math.prod(shape) for shape in self.shapes) * self.dtype.itemsize


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one spec and so one block table (positional or keyword)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise ValueError(f"kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}")


@dataclass(frozen=True, kw_only=True)
class KVCacheTensor:
    """One backing buffer of ``size_bytes`` shared by the named layers (one per group)."""

    size_bytes: int
    shared_by: list[str]


@dataclass(frozen=True)
class KVCacheConfig:
    """``num_blocks`` block ids (0 = null block) shared by every group in ``kv_cache_groups``."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require_positive("num_blocks", self.num_blocks)
        if not self.kv_cache_groups:
            raise ValueError("kv_cache_groups must name at least one group")
