"""Node metadata exchanged at handshake and the compatibility check between two nodes.

docs/architecture.md, "Handshake and compatibility check": the handshake exchanges engine id,
incarnation (new on every restart), a compatibility hash over the block identity
(``identity.BlockIdentity``: model, model revision, model dtype, KV cache dtype, KV layout,
block size, hash function and its root) and the KV region geometry (number of layers, block
shape and dtype per group), and that geometry itself. A peer that differs in any of them is
refused with a message naming the differing field (docs/architecture.md, "Reliability rules").

These types travel in the handshake as they are (``wire.Hello``): their field annotations carry
the bounds a peer's metadata must respect (``limits``), checked when a peer's metadata is decoded.
A field with a default (``incarnation``, ``identity.kv_layout``, ``identity.model_revision``,
``identity.model_dtype``, ``identity.hash_root``, ``kv_heads``) may be left out by a peer,
which is the same as sending that value; ``compat_hash`` travels beside the metadata and covers
every field two nodes must agree on.

Tensor parallelism (``KVHeads``): a node may hold a slice of the model's KV heads (one rank of
a tensor-parallel engine). Two nodes are compatible when their blocks agree per head (the
``global_block_shape``, with the model's head count in place of the node's); which heads a read
moves is the read's business (``heads``).
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
from .limits import (
    MAX_GROUPS,
    BlockShape,
    DtypeName,
    KVHeadIndex,
    NumBlocks,
    NumKVHeads,
    NumLayers,
    Text,
)


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
class KVHeads:
    """Which of the model's KV heads a node's blocks hold (a tensor-parallel rank holds a run of
    them; vLLM's rule in ``kvbridge.connector.tp_layout``).

    The canonical block shape ``(2, block_size, num_kv_heads, head_size)`` counts the heads a
    node holds (axis 2); the node holds heads ``[first, first + num_kv_heads)`` of ``total``.

    Attributes:
        first: the first head held, in ``[0, total)``.
        total: the model's KV heads (the same on every node of one model).
        sliceable: a run of the held heads is one contiguous byte range of every block row of
            every region (a head-major block: the CPU attention backend's, or a K/V-split
            "HND" cache), so a read may move part of a row (``heads``). False: only whole rows
            move, so this node pairs only with nodes holding exactly its heads.
    """

    first: KVHeadIndex
    total: NumKVHeads
    sliceable: bool = False

    def __post_init__(self) -> None:  # msgspec runs it when decoding a peer's too
        if self.first >= self.total:
            raise ValueError(f"kv_heads.first {self.first} not below kv_heads.total {self.total}")


@dataclass(frozen=True, kw_only=True)
class NodeMetadata:
    """What a node tells its peers at handshake.

    Every field of ``identity`` must match (``BlockIdentity``), and so must ``dtype`` (group 0's
    tensors') and everything in ``groups`` but ``num_blocks``, per KV head
    (``global_block_shape``). ``kv_heads``: the heads this node holds (None: every head of the
    model, ``num_kv_heads`` of the block shape; whole rows only).
    """

    engine_id: Text
    identity: BlockIdentity
    dtype: DtypeName
    groups: Annotated[tuple[KVGroupLayout, ...], Meta(min_length=1, max_length=MAX_GROUPS)]
    incarnation: Text = field(default_factory=lambda: uuid.uuid4().hex)
    kv_heads: KVHeads | None = None

    def __post_init__(self) -> None:
        """``kv_heads`` must fit the groups: every group holds the same number of heads (axis 2
        of its block shape) and the run ends within ``total`` (msgspec runs this when decoding
        a peer's metadata too: a misfit is refused as a bad message)."""
        heads = self.kv_heads
        if heads is None:
            return
        held = {g.block_shape[2] if len(g.block_shape) > 2 else -1 for g in self.groups}
        if len(held) != 1 or not 0 < held.pop() <= heads.total - heads.first:
            raise ValueError(
                f"kv_heads {heads} do not fit groups of block shapes "
                f"{[g.block_shape for g in self.groups]} (axis 2: the heads held)"
            )

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
        kv_heads: KVHeads | None = None,
        model_dtype: str = "",
        hash_root: str = "",
    ) -> NodeMetadata:
        """Metadata of a node whose KV tensors are ``kv_caches_by_group[g][layer]``; ``dtype`` and
        the block size are read from group 0 (axis 2 of the tensor is the block size).

        ``kv_cache_dtype`` names the cache's element type when the tensors' dtype does not
        (vLLM's fp8 caches are ``uint8`` tensors); None: the tensors' dtype. ``kv_layout`` names
        the bytes' real arrangement inside a block when the tensors are a blocks-first view of
        another engine's cache. Both, and ``model_revision``, ``model_dtype`` and ``hash_root``, are
        in the ``BlockIdentity`` (its fields' meanings).
        ``kv_heads``: the heads held, when the node holds a slice of the model's.

        Raises:
            ValueError: no group, tensors that disagree, an empty name, or ``kv_heads`` that do
                not fit the groups (``__post_init__``).
        """
        groups = tuple(KVGroupLayout.from_kv_caches(caches) for caches in kv_caches_by_group)
        if not groups:
            raise ValueError("kv_caches_by_group is empty: a node has at least one KV cache group")
        identity = BlockIdentity(
            model_name=model_name,
            model_revision=model_revision,
            model_dtype=model_dtype,
            kv_cache_dtype=kv_cache_dtype or groups[0].dtype,
            kv_layout=kv_layout,
            block_size=groups[0].block_shape[1],
            hash_fn_name=hash_fn_name,
            hash_root=hash_root,
        )
        return cls(engine_id=engine_id, identity=identity, dtype=groups[0].dtype, groups=groups,
                   kv_heads=kv_heads)

    @property
    def held_heads(self) -> tuple[int, int]:
        """``(first, stop)``: the model's KV heads this node's blocks hold."""
        first = 0 if self.kv_heads is None else self.kv_heads.first
        return first, first + self.groups[0].block_shape[2]

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads (``kv_heads.total``; without ``kv_heads``, those held)."""
        return self.groups[0].block_shape[2] if self.kv_heads is None else self.kv_heads.total

    def global_block_shape(self, group_id: int) -> tuple[int, ...]:
        """Group ``group_id``'s block shape with the model's KV heads on axis 2 (what two nodes
        of one model agree on whichever heads each holds)."""
        shape = list(self.groups[group_id].block_shape)
        if self.kv_heads is not None and len(shape) > 2:
            shape[2] = self.kv_heads.total
        return tuple(shape)

    @property
    def compat_hash(self) -> str:
        """sha256 (hex) over everything two nodes must agree on: every field of the identity
        (``BlockIdentity.as_items``), the dtype and each group's geometry (not engine id,
        incarnation, or num_blocks)."""
        payload = msgpack.packb(
            [
                [list(item) for item in self.identity.as_items()],
                self.dtype,
                [
                    [g.num_layers, list(self.global_block_shape(i)), g.dtype]
                    for i, g in enumerate(self.groups)
                ],
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
    if local.total_kv_heads != remote.total_kv_heads:
        raise HandshakeError(
            f"incompatible peer {remote.engine_id!r}: total_kv_heads: local "
            f"{local.total_kv_heads}, remote {remote.total_kv_heads}"
        )
    for group_id, (mine, theirs) in enumerate(zip(local.groups, remote.groups, strict=False)):
        for name in ("num_layers", "block_shape", "dtype"):
            mine_value, theirs_value = getattr(mine, name), getattr(theirs, name)
            if name == "block_shape":  # per head: which heads each node holds may differ
                mine_value = local.global_block_shape(group_id)
                theirs_value = remote.global_block_shape(group_id)
            if mine_value != theirs_value:
                raise HandshakeError(
                    f"incompatible peer {remote.engine_id!r}: groups[{group_id}].{name}: "
                    f"local {mine_value!r}, remote {theirs_value!r}"
                )
    if local.compat_hash != remote.compat_hash:
        raise HandshakeError(
            f"incompatible peer {remote.engine_id!r}: compat_hash: local {local.compat_hash}, "
            f"remote {remote.compat_hash}"
        )
