"""``StoreProfile``: what a store node must share with the engines that write to it: their
``BlockIdentity`` (``kvbridge.transport``), the geometry of their KV blocks and the split of the
KV heads over ranks the index namespace names (``IndexNamespace.kv_heads_layout``).

A store accepts a put only when the writer's ``NodeMetadata.compat_hash`` is its own, serves
pulls only to engines whose handshake matches its metadata (``check_compatible``), and engines
find its blocks only in their own index namespace. A store built from a profile has exactly the
writer's handshake identity and namespace: ``metadata`` gives the store's handshake with the
writer's identity and geometry, ``namespace`` the writer's index namespace.

A writer sends its profile in a hello on each write connection (``wire.encode_hello``); a store
keeps one shelf per profile, opened by the first writer of it (docs/operations.md, "Several
block geometries in one store"). ``kvbridge-store --profile '<json>'`` (``to_json``, the JSON a
writer logs when it binds its KV tensors) fixes the first up front.

Standard library, torch and msgspec; no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
import torch
from kvbridge.transport import BlockIdentity, KVGroupLayout, KVHeads, NodeMetadata
from kvbridge.transport.limits import MAX_GROUPS, BlockShape, DtypeName, NumLayers, ShortText
from msgspec import Meta

from ..index.protocol import IndexNamespace

__all__ = ["GroupGeometry", "StoreProfile"]


@dataclass(frozen=True, kw_only=True)
class GroupGeometry:
    """One KV cache group's blocks: ``num_layers`` tensors (regions) whose block is
    ``block_shape`` of ``dtype`` (a torch dtype name, ``"float32"``); ``block_shape[1]`` is the
    block size."""

    num_layers: NumLayers
    block_shape: BlockShape
    dtype: DtypeName

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer."""
        numel = 1
        for size in self.block_shape:
            numel *= size
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True, kw_only=True)
class StoreProfile:
    """A writer's block identity and KV geometry. See the module docstring.

    Attributes:
        identity: the writer's ``BlockIdentity`` (its handshake's).
        groups: per KV cache group, its geometry (the writer's ``NodeMetadata.groups`` without
            ``num_blocks``).
        kv_heads: the KV heads the writer's blocks hold, as its handshake names them (None:
            all of them, unnamed).
        kv_heads_layout: the writer's ``IndexNamespace.kv_heads_layout`` (``""``: one rank).

    Raises:
        ValueError: a group whose block shape does not have the identity's block size second
            (decoding a profile raises it too, as ``from_json`` / ``from_msgpack`` say).
    """

    identity: BlockIdentity
    groups: Annotated[tuple[GroupGeometry, ...], Meta(min_length=1, max_length=MAX_GROUPS)]
    kv_heads: KVHeads | None = None
    kv_heads_layout: ShortText = ""

    def __post_init__(self) -> None:
        for i, group in enumerate(self.groups):
            if len(group.block_shape) < 2 or group.block_shape[1] != self.identity.block_size:
                raise ValueError(
                    f"groups[{i}].block_shape {list(group.block_shape)} must have the block "
                    f"size {self.identity.block_size} second"
                )

    @classmethod
    def of_metadata(cls, metadata: NodeMetadata, *, kv_heads_layout: str = "") -> StoreProfile:
        """The profile of a writer whose handshake metadata is ``metadata``."""
        return cls(
            identity=metadata.identity,
            groups=tuple(GroupGeometry(num_layers=g.num_layers, block_shape=g.block_shape,
                                       dtype=g.dtype) for g in metadata.groups),
            kv_heads=metadata.kv_heads,
            kv_heads_layout=kv_heads_layout,
        )

    def full_heads(self) -> StoreProfile:
        """The profile of the model's whole blocks: each group's block shape with every KV head
        of the model on axis 2 (``kv_heads.total``), ``kv_heads`` from head 0. A store keeps
        whole blocks; every rank of a tensor-parallel writer has the same full profile and
        writes its own heads of each block (docs/vllm-prefix-reuse.md, "Tensor-parallel
        engines and the store"). A profile of all heads already is returned as it is."""
        heads = self.kv_heads
        if heads is None or (heads.first == 0 and self.groups[0].block_shape[2] == heads.total):
            return self
        groups = tuple(GroupGeometry(num_layers=g.num_layers, dtype=g.dtype,
                                     block_shape=(*g.block_shape[:2], heads.total,
                                                  *g.block_shape[3:]))
                       for g in self.groups)
        return StoreProfile(identity=self.identity, groups=groups,
                            kv_heads=KVHeads(first=0, total=heads.total,
                                             sliceable=heads.sliceable),
                            kv_heads_layout=self.kv_heads_layout)

    # ------------------------------------------------------------------ encodings
    def to_json(self) -> str:
        """One line of JSON (what ``kvbridge-store --profile`` takes)."""
        return msgspec.json.encode(self).decode()

    def to_msgpack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> StoreProfile:
        """Parse ``to_json``'s output, checking every field's type and bounds.

        Raises:
            ValueError: ``"store profile: <problem> - at `$.<field>`"``.
        """
        return _decode(msgspec.json.decode, text)

    @classmethod
    def from_msgpack(cls, raw: bytes) -> StoreProfile:
        """Parse ``to_msgpack``'s output (a writer's hello). Raises ValueError as ``from_json``."""
        return _decode(msgspec.msgpack.decode, raw)

    def first_difference(self, other: StoreProfile) -> str | None:
        """The first field in which ``other`` differs, ``"<field>: local X, remote Y"`` (this
        profile local), identity fields first; None if equal."""
        difference = self.identity.first_difference(other.identity)
        if difference is not None:
            return str(difference)
        for name in ("groups", "kv_heads", "kv_heads_layout"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name}: local {mine!r}, remote {theirs!r}"
        return None

    def refusal(self, writer: StoreProfile, *, max_shelves: int = 1) -> str:
        """Why a store whose first shelf has this profile, full at ``max_shelves`` geometries,
        refuses ``writer``'s: the difference, the rule and its remedies first, then both
        profiles as JSON."""
        return (f"this store keeps blocks of another geometry ({self.first_difference(writer)});"
                f" this kvbridge-store keeps at most {max_shelves} geometr"
                f"{'y' if max_shelves == 1 else 'ies'} (--max-shelves) and has them all: start "
                "another kvbridge-store for it, or raise --max-shelves. "
                f"The store's profile: {self.to_json()}; the writer's: {writer.to_json()}")

    # ------------------------------------------------------------------ the store's side
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every group and layer."""
        return sum(g.num_layers * g.block_nbytes for g in self.groups)

    @property
    def compat_hash(self) -> str:
        """The ``NodeMetadata.compat_hash`` of the writer (and of a store of this profile)."""
        groups = tuple(KVGroupLayout(num_layers=g.num_layers, num_blocks=1,
                                     block_shape=g.block_shape, dtype=g.dtype)
                       for g in self.groups)
        return NodeMetadata(engine_id="profile", identity=self.identity,
                            dtype=self.groups[0].dtype, groups=groups,
                            kv_heads=self.kv_heads).compat_hash

    @property
    def namespace(self) -> IndexNamespace:
        """The writer's index namespace, where its store's blocks are published."""
        return IndexNamespace(identity=self.identity, kv_heads_layout=self.kv_heads_layout)

    def kv_caches(self, capacity_bytes: int) -> tuple[list[list[torch.Tensor]], int]:
        """Host tensors for a store of ``capacity_bytes``: ``[group][layer]`` zeros
        ``[num_store_blocks + 1, *block_shape]`` (row 0 unused), and ``num_store_blocks``.

        Raises:
            ValueError: the capacity holds no block.
        """
        num_store_blocks = capacity_bytes // self.bytes_per_block
        if num_store_blocks < 1:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} holds no block of {self.bytes_per_block} bytes")
        by_group = [
            [torch.zeros((num_store_blocks + 1, *g.block_shape), dtype=getattr(torch, g.dtype))
             for _ in range(g.num_layers)]
            for g in self.groups
        ]
        return by_group, num_store_blocks

    def metadata(self, engine_id: str,
                 kv_caches_by_group: list[list[torch.Tensor]]) -> NodeMetadata:
        """The store's handshake metadata over ``kv_caches``' tensors (``kv_caches``): the
        writer's identity, geometry and heads, so its ``compat_hash`` is the writer's."""
        return NodeMetadata(
            engine_id=engine_id, identity=self.identity, dtype=self.groups[0].dtype,
            groups=tuple(KVGroupLayout.from_kv_caches(c) for c in kv_caches_by_group),
            kv_heads=self.kv_heads,
        )


def _decode(decode: object, raw: str | bytes) -> StoreProfile:
    try:
        return decode(raw, type=StoreProfile)  # type: ignore[operator,no-any-return]
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"store profile: {exc}") from None
