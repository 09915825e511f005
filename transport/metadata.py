"""Node metadata exchanged at handshake and the compatibility check between two nodes.

docs/architecture.md, "Handshake and compatibility check": the handshake exchanges engine id,
incarnation (new on every restart), a compatibility hash over the block identity
(``identity.BlockIdentity``: model, model revision, KV cache dtype, KV layout, block size, hash
function) and the KV region geometry (number of layers, block shape and dtype per group), and
that geometry itself. A peer that differs in any of them is refused with a message naming the
differing field (docs/architecture.md, "Reliability rules").

These types travel in the handshake as they are (``wire.Hello``): their field annotations carry
the bounds a peer's metadata must respect (``limits``), checked when a peer's metadata is decoded.
A field with a default (``incarnation``, ``identity.kv_layout``, ``identity.model_revision``) may
be left out by a peer, which is the same as sending that value; ``compat_hash`` travels beside
the metadata and covers every field two nodes must agree on.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgpack
import torch
from msgspec import Meta

from .errors import HandshakeError
from .identity import KV_LAYOUT_NAME, BlockIdentity
from .limits import MAX_GROUPS, BlockShape, DtypeName, NumBlocks, NumLayers, Text


@dataclass(frozen=True, kw_only=True)
class KVGroupLayout:
    """The KV region of one KV cache group on one node.

    Attributes:
        num_layers: layers in the group (one KV tensor each).
        num_blocks: rows of each tensor; block ids are ``[0, num_blocks)``, 0 is the null block.
        block_shape: shape of one block of one layer, ``(2, block_size, num_kv_heads, head_size)``.
        dtype: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
    """

    num_layers: NumLayers
    num_blocks: NumBlocks
    block_shape: BlockShape
    dtype: DtypeName

    @classmethod
    def from_kv_caches(cls, kv_caches: Sequence[torch.Tensor]) -> KVGroupLayout:
        """Layout of one group's layer tensors (each ``[num_blocks, *block_shape]``).

        Raises:
            ValueError: if the list is empty or the tensors disagree in shape or dtype.
        """
        if len(kv_caches) == 0:
            raise ValueError("a KV cache group needs at least one layer tensor")
        first = kv_caches[0]
        for layer_idx, kv_cache in enumerate(kv_caches):
            if kv_cache.shape != first.shape or kv_cache.dtype != first.dtype:
                raise ValueError(
                    f"layer {layer_idx}: shape {tuple(kv_cache.shape)} {kv_cache.dtype}, "
                    f"layer 0: {tuple(first.shape)} {first.dtype}"
                )
        return cls(
            num_layers=len(kv_caches),
            num_blocks=int(first.shape[0]),
            block_shape=tuple(int(s) for s in first.shape[1:]),
            dtype=str(first.dtype).removeprefix("torch."),
        )

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer."""
        numel = 1
        for size in self.block_shape:
            numel *= size
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True, kw_only=True)
class NodeMetadata:
    """What a node tells its peers at handshake.

    Every field of ``identity`` must match (``BlockIdentity``), and so must ``dtype`` (group 0's
    tensors') and everything in ``groups`` but ``num_blocks``.
    """

    engine_id: Text
    identity: BlockIdentity
    dtype: DtypeName
    groups: Annotated[tuple[KVGroupLayout, ...], Meta(min_length=1, max_length=MAX_GROUPS)]
    incarnation: Text = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def from_kv_caches(
        cls,
        *,
        engine_id: str,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        model_name: str,
        hash_fn_name: str,
        model_revision: str = "",
        kv_cache_dtype: str | None = None,
        kv_layout: str = KV_LAYOUT_NAME,
    ) -> NodeMetadata:
        """Metadata of a node whose KV tensors are ``kv_caches_by_group[g][layer]``; ``dtype`` and
        the block size are read from group 0 (axis 2 of the tensor is the block size).

        ``kv_cache_dtype`` names the cache's element type when the tensors' dtype does not
        (vLLM's fp8 caches are ``uint8`` tensors); None: the tensors' dtype. ``kv_layout`` names
        the bytes' real arrangement inside a block when the tensors are a blocks-first view of
        another engine's cache. Both, and ``model_revision``, are in the ``BlockIdentity``.

        Raises:
            ValueError: no group, tensors that disagree, or an empty name.
        """
        groups = tuple(KVGroupLayout.from_kv_caches(caches) for caches in kv_caches_by_group)
        if not groups:
            raise ValueError("kv_caches_by_group is empty: a node has at least one KV cache group")
        identity = BlockIdentity(
            model_name=model_name,
            model_revision=model_revision,
            kv_cache_dtype=kv_cache_dtype or groups[0].dtype,
            kv_layout=kv_layout,
            block_size=groups[0].block_shape[1],
            hash_fn_name=hash_fn_name,
        )
        return cls(engine_id=engine_id, identity=identity, dtype=groups[0].dtype, groups=groups)

    @property
    def compat_hash(self) -> str:
        """sha256 (hex) over everything two nodes must agree on: every field of the identity
        (``BlockIdentity.as_items``), the dtype and each group's geometry (not engine id,
        incarnation, or num_blocks)."""
        payload = msgpack.packb(
            [
                [list(item) for item in self.identity.as_items()],
                self.dtype,
                [[g.num_layers, list(g.block_shape), g.dtype] for g in self.groups],
            ]
        )
        return hashlib.sha256(payload).hexdigest()


def check_compatible(local: NodeMetadata, remote: NodeMetadata) -> None:
    """Refuse a peer whose blocks are not ours: another block identity or KV geometry.

    Raises:
        HandshakeError: naming the first differing field, identity fields first (in
            ``BlockIdentity``'s order), e.g. ``"model_revision: local 'a1', remote 'b2'"``,
            ``"block_size: local 16, remote 32"`` or ``"groups[1].num_layers: local 4, remote 2"``.
    """
    difference = local.identity.first_difference(remote.identity)
    if difference is not None:
        raise HandshakeError(f"incompatible peer {remote.engine_id!r}: {difference}")
    if local.dtype != remote.dtype:
        raise HandshakeError(
            f"incompatible peer {remote.engine_id!r}: dtype: local {local.dtype!r}, "
            f"remote {remote.dtype!r}"
        )
    if len(local.groups) != len(remote.groups):
        raise HandshakeError(
            f"incompatible peer {remote.engine_id!r}: num_groups: local {len(local.groups)}, "
            f"remote {len(remote.groups)}"
        )
    for group_id, (mine, theirs) in enumerate(zip(local.groups, remote.groups, strict=False)):
        for name in ("num_layers", "block_shape", "dtype"):
            if getattr(mine, name) != getattr(theirs, name):
                raise HandshakeError(
                    f"incompatible peer {remote.engine_id!r}: groups[{group_id}].{name}: "
                    f"local {getattr(mine, name)!r}, remote {getattr(theirs, name)!r}"
                )
    if local.compat_hash != remote.compat_hash:
        raise HandshakeError(
            f"incompatible peer {remote.engine_id!r}: compat_hash: local {local.compat_hash}, "
            f"remote {remote.compat_hash}"
        )
