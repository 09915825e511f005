"""A block's identity: everything besides its block hash that decides the bytes a block holds.

Two nodes exchange a block only if they agree on every field of ``BlockIdentity``: the handshake
refuses a peer that differs in one, naming it (``metadata.check_compatible``), and the block
index keys its entries under a namespace derived from all of them
(``kvbridge.connector.index.IndexNamespace``), so a node never even finds another identity's
blocks. Both read the fields from this one class, in its field order: a field added here is in
the handshake's ``compat_hash``, its check and the index namespace at once.

What is not here is the geometry of the KV tensors (layers per group, heads per block, head
size, the tensors' dtype), which the handshake compares too (``NodeMetadata.groups``) and may
map between two nodes (a different tensor-parallel split) instead of refusing. The index adds
the one part of it a published block depends on beyond this class, the split of the KV heads
over ranks (``IndexNamespace.kv_heads_layout``); a vLLM node's ``kv_layout`` already spells a
block's shape with the model's KV heads, its head size and dtype, and a hybrid model's groups.
This class with ``kv_heads_layout`` is the one definition of which engines' blocks are
interchangeable (docs/vllm-prefix-reuse.md, "One hash domain").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import msgpack

from .limits import BlockSize, ShortText, Text

KV_LAYOUT_NAME = "blocks_first:[num_blocks,2,block_size,num_kv_heads,head_size]"
"""Name of the per-layer KV tensor layout (kvbridge.kernels.layout): kvbridge's own engine's."""


class IdentityDifference(NamedTuple):
    """The first field in which two identities differ, with both values."""

    name: str
    local: Any
    remote: Any

    def __str__(self) -> str:
        return f"{self.name}: local {self.local!r}, remote {self.remote!r}"


@dataclass(frozen=True, kw_only=True)
class BlockIdentity:
    """Everything that changes the bytes of the block a block hash names, besides the hash.

    Attributes:
        model_name: the model (weights) that computed the KV, e.g. vLLM's served model name.
        model_revision: the revision of those weights (vLLM: ``model_config.revision``, the
            commit it resolved to on the Hub); ``""``: unknown (two unknowns are equal).
        model_dtype: the dtype the model computes KV in, with its weights' quantization (vLLM:
            ``translate.model_dtype_of``, ``"bfloat16+q:fp8"``): an fp8 cache of a bfloat16
            model and one of a float16 model hold different bytes; ``""``: the same as
            ``kv_cache_dtype`` (kvbridge's engine computes in its cache's dtype).
        kv_cache_dtype: the KV cache's element type as the engine names it, which a tensor's
            dtype does not always tell: vLLM stores ``"fp8_e4m3"`` and ``"fp8_e5m2"`` both in
            ``uint8`` tensors (``"auto"`` is resolved to the model's dtype first).
        block_size: tokens per block.
        hash_fn_name: the block hash function (which token prefix a hash names).
        hash_root: a public name of the root the block hashes chain from (vLLM: the seed of
            ``NONE_HASH``, ``translate.hash_root_id``); ``""``: the hash function's one fixed
            root (kvbridge's engine). Two roots: one token prefix, two unrelated hashes.
        kv_layout: the arrangement of the bytes inside a block (``KV_LAYOUT_NAME`` for
            kvbridge's engine; vLLM's attention backend and axis order: ``vllm.translate``).
            Last, as the least specific: a vLLM layout name spells the block shape too, so a
            peer of another block size is refused naming ``block_size``.

    Raises:
        ValueError: an empty name or a block size below 1 (a peer's identity decoded from
            the wire raises it as a ``WireError``).
    """

    model_name: Text
    model_revision: Text = ""
    model_dtype: ShortText = ""
    kv_cache_dtype: ShortText
    block_size: BlockSize
    hash_fn_name: ShortText
    hash_root: ShortText = ""
    kv_layout: Text = KV_LAYOUT_NAME

    def __post_init__(self) -> None:
        for name in ("model_name", "kv_cache_dtype", "kv_layout", "hash_fn_name"):
            if not getattr(self, name):
                raise ValueError(f"block identity: {name} must be non-empty")
        if self.block_size < 1:
            raise ValueError(f"block identity: block_size must be >= 1, got {self.block_size}")

    def as_items(self) -> list[tuple[str, Any]]:
        """``(field name, value)`` of every field, in field order (what the digests cover)."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    @property
    def digest(self) -> str:
        """sha256 (hex) over every field, names included (a renamed or added field changes it)."""
        return hashlib.sha256(msgpack.packb([list(item) for item in self.as_items()])).hexdigest()

    def first_difference(self, other: BlockIdentity) -> IdentityDifference | None:
        """The first field (in field order) whose values differ, or None if all are equal."""
        for (name, mine), (_, theirs) in zip(self.as_items(), other.as_items(), strict=True):
            if mine != theirs:
                return IdentityDifference(name, mine, theirs)
        return None
