"""The KV tensor layout: the one place that defines it.

Every attention layer (full attention or sliding window) owns ONE KV cache tensor::

    kv_cache.shape == (num_blocks, 2, block_size, num_kv_heads, head_size)
                       ^ axis 0:    ^ axis 1: 0 = K, 1 = V
                         block id

dtype is the model dtype, the tensor is contiguous, and so one block of one layer is one
contiguous run of ``2 * block_size * num_kv_heads * head_size * itemsize`` bytes starting at
byte ``block_id * block_nbytes``. That is what makes a block the unit of transfer: a block of a
layer can be read or written with one memcpy / one RDMA descriptor.

Slot of a token: ``slot = block_id * block_size + offset_in_block`` (vLLM's slot mapping), so
``kv_cache[slot // block_size, 0, slot % block_size]`` is the key of that token, shape
``(num_kv_heads, head_size)``. Block 0 is the null block (vLLM's ``BlockPool`` reserves it); it
is a real row of the tensor that holds nothing meaningful, and block tables pad with it.

All layers of one KV cache group (``KVCacheGroupSpec.layer_names``) have the same shape and dtype
and share block ids: block ``b`` of the group is row ``b`` of every one of the group's tensors.
The layers are keyed by name, ``"model.layers.{i}.self_attn"`` (see ``model.layer_name``).

The staging buffer used by ``gather_blocks`` / ``scatter_blocks`` for ``n`` blocks of ``L`` layers
of one group is one contiguous tensor::

    staging.shape == (L, n, 2, block_size, num_kv_heads, head_size)

so ``staging[l, i]`` is block ``block_ids[i]`` of layer ``l``, and the whole buffer is
``staging_nbytes(kv_caches, n)`` bytes. Source: vLLM v1 ``FlashAttentionBackend.get_kv_cache_shape``
(the same axes, with the block axis first as in its NHD "blocks first" layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

KV_AXIS_BLOCK = 0
"""Axis of a KV cache tensor that indexes blocks."""
KV_AXIS_KV = 1
"""Axis of a KV cache tensor that selects K (index 0) or V (index 1)."""


class KVCacheShape(NamedTuple):
    """The five sizes of one layer's KV cache tensor, in axis order."""

    num_blocks: int
    num_kv: int  # always 2: K and V
    block_size: int
    num_kv_heads: int
    head_size: int


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> KVCacheShape:
    """Shape of one layer's KV cache: ``(num_blocks, 2, block_size, num_kv_heads, head_size)``.

    Raises:
        ValueError: if any size is < 1.
    """
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return KVCacheShape(num_blocks, 2, block_size, num_kv_heads, head_size)


def block_nbytes(block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of one layer: ``2 * block_size * num_kv_heads * head_size * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_size * itemsize


def staging_shape(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> tuple[int, ...]:
    """Shape of the staging buffer for ``num_blocks`` blocks of every layer in ``kv_caches``:
    ``(len(kv_caches), num_blocks, 2, block_size, num_kv_heads, head_size)``.

    Raises:
        ValueError: as ``check_kv_caches``.
    """
    check_kv_caches(kv_caches)
    return (len(kv_caches), num_blocks, *kv_caches[0].shape[1:])


def staging_nbytes(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> int:
    """Bytes of the staging buffer for ``num_blocks`` blocks of every layer in ``kv_caches``
    (``len(kv_caches) * num_blocks * block_nbytes``)."""
    check_kv_caches(kv_caches)
    first = kv_caches[0]
    return len(kv_caches) * num_blocks * first[0].numel() * first.element_size()


def check_kv_caches(kv_caches: Sequence[torch.Tensor]) -> None:
    """Check that ``kv_caches`` is a non-empty list of same-shape, same-dtype, same-device,
    contiguous 5-d tensors with axis 1 of size 2 (one KV cache group, the layout above).

    Raises:
        ValueError: naming the first layer (by position) that breaks the layout.
    """
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: pass the KV cache of at least one layer")
    first = kv_caches[0]
    if first.dim() != 5 or first.shape[KV_AXIS_KV] != 2:
        raise ValueError(
            "a KV cache must have shape (num_blocks, 2, block_size, num_kv_heads, head_size), "
            f"got {tuple(first.shape)}"
        )
    for layer_idx, kv_cache in enumerate(kv_caches):
        if kv_cache.shape != first.shape:
            raise ValueError(
                f"kv_caches[{layer_idx}] has shape {tuple(kv_cache.shape)}, "
                f"kv_caches[0] has {tuple(first.shape)}: one call moves one KV cache group"
            )
        if kv_cache.dtype != first.dtype:
            raise ValueError(
                f"kv_caches[{layer_idx}] has dtype {kv_cache.dtype}, kv_caches[0] has {first.dtype}"
            )
        if kv_cache.device != first.device:
            raise ValueError(
                f"kv_caches[{layer_idx}] is on {kv_cache.device}, kv_caches[0] is on {first.device}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError(f"kv_caches[{layer_idx}] is not contiguous")


def check_block_ids(block_ids: torch.Tensor, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Check a 1-d integer tensor of block ids against ``[0, num_blocks)`` and return it as int64.

    Raises:
        ValueError: if ``block_ids`` is not 1-d integer, is on another device than the caches, or
            holds an id outside ``[0, num_blocks)`` (the message names the first bad id).
    """
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-d, got shape {tuple(block_ids.shape)}")
    if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == (
        torch.bool
    ):
        raise ValueError(f"block_ids must be an integer tensor (int64), got {block_ids.dtype}")
    if block_ids.device != device:
        raise ValueError(f"block_ids is on {block_ids.device}, the KV caches are on {device}")
    position = first_out_of_range(block_ids, 0, num_blocks)
    if position is not None:
        raise ValueError(
            f"block id {int(block_ids[position])} at position {position} is outside "
            f"[0, {num_blocks})"
        )
    return block_ids.to(torch.int64)


def first_out_of_range(index: torch.Tensor, low: int, high: int) -> int | None:
    """Position of the first entry of a 1-d integer tensor outside ``[low, high)``, or None
    (also for an empty tensor). Reads ``index`` only; one device sync when non-empty."""
    if index.numel() == 0:
        return None
    bad = (index < low) | (index >= high)
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0, 0])
