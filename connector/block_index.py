"""Block index: which node holds which block hash, and the longest prefix held anywhere.

DESIGN.md, "Block index". A node publishes its ``BlockPool`` KV events (``BlockStored`` adds,
``BlockRemoved`` removes, ``AllBlocksCleared`` drops the node's entries of that tier); any node asks
``longest_prefix(block_hashes, group_ids)`` for the deepest run of a request's blocks that one
holder can serve whole. Two backends share this contract: :class:`InMemoryBlockIndex` (below, one
process) and ``RedisBlockIndex`` (``redis_block_index.py``, across nodes, one round trip).

Freshness and fencing:

- ``register_node(node_id, incarnation, ttl_s=...)`` starts a node's life. Incarnations grow on
  every restart (:func:`new_incarnation`); registering a newer incarnation drops every entry of the
  older one, and an older incarnation is refused once a newer one registered.
- ``publish`` and ``heartbeat`` from any incarnation other than the node's current one are refused
  (``"fenced"``), so a restarted node's zombie writes are ignored.
- A node that does not heartbeat within ``ttl_s`` expires: lookups ignore it and its entries go.
  Its next ``heartbeat`` or ``publish`` answers ``"fenced"``; it registers again (entries empty).

A hit is advisory (DESIGN.md): the holder re-checks each block's hash when serving it. A stale
entry costs a recompute, never wrong output.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol
from urllib.parse import quote

from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

Tier = Literal["device", "host", "store"]
IndexStatus = Literal["ok", "fenced", "unavailable"]

# One entry value, the same bytes in both backends: block id (uint32 big-endian) + tier code.
ENTRY_STRUCT = struct.Struct(">Ic")
ENTRY_NUM_BYTES = ENTRY_STRUCT.size  # 5
TIER_TO_CODE: dict[str, bytes] = {"device": b"d", "host": b"h", "store": b"s"}
CODE_TO_TIER: dict[bytes, Tier] = {b"d": "device", b"h": "host", b"s": "store"}
# Slowest tier of a run describes the cost of pulling it (device < host < store).
TIER_RANK: dict[str, int] = {"device": 0, "host": 1, "store": 2}
_MEDIUM_TO_TIER: dict[str, Tier] = {
    "gpu": "device", "cuda": "device", "device": "device",
    "cpu": "host", "host": "host",
    "store": "store", "disk": "store", "remote": "store",
}
INCARNATION_DIGITS = 20  # zero-padded decimal so string order equals numeric order (Lua side)


def new_incarnation() -> int:
    """A fresh incarnation for a starting node: wall-clock nanoseconds, larger on every restart."""
    return time.time_ns()


def check_node_id(node_id: str) -> None:
    """Raise ValueError for an id that cannot be a key segment (empty, ``:`` or whitespace)."""
    if not node_id or ":" in node_id or any(c.isspace() for c in node_id):
        raise ValueError(f"node_id must be non-empty without ':' or whitespace, got {node_id!r}")


def check_incarnation(incarnation: int) -> None:
    if not 0 <= incarnation < 10**INCARNATION_DIGITS:
        raise ValueError(f"incarnation must be in [0, 1e{INCARNATION_DIGITS}), got {incarnation}")


def tier_for_medium(medium: str | None, default_tier: Tier) -> Tier:
    """Map a KV event's ``medium`` (vLLM: ``"GPU"``, ``"CPU"``, ...) to a tier; None -> default."""
    if medium is None:
        return default_tier
    tier = _MEDIUM_TO_TIER.get(medium.lower())
    if tier is None:
        raise ValueError(f"unknown KV event medium {medium!r}; known: {sorted(_MEDIUM_TO_TIER)}")
    return tier


@dataclass(frozen=True, kw_only=True)
class IndexNamespace:
    """What makes two caches compatible: keys of different namespaces never match."""

    model_name: str
    block_size: int
    hash_fn_name: str

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.model_name or not self.hash_fn_name:
            raise ValueError("model_name and hash_fn_name must be non-empty")

    @property
    def key_prefix(self) -> str:
        """``kvbridge:bi:<model>:<block_size>:<hash_fn>``, each name %-quoted (no raw ``:``)."""
        model = quote(self.model_name, safe="")
        return f"kvbridge:bi:{model}:{self.block_size}:{quote(self.hash_fn_name, safe='')}"


class IndexOp(NamedTuple):
    """One change to a node's entries. kind: ``"S"`` store, ``"R"`` remove, ``"C"`` clear tier."""

    kind: Literal["S", "R", "C"]
    tier: Tier
    group_id: int = 0
    block_hash: bytes = b""
    block_id: int = 0


def events_to_ops(events: Iterable[Any], default_tier: Tier = "device") -> list[IndexOp]:
    """Translate ``BlockPool.take_events()`` output into index ops, in event order.

    Raises ValueError for an event of another type or a BlockStored whose ``block_hashes`` and
    ``block_ids`` differ in length.
    """
    ops: list[IndexOp] = []
    for event in events:
        if isinstance(event, BlockStored):
            if len(event.block_hashes) != len(event.block_ids):
                raise ValueError(
                    f"BlockStored has {len(event.block_hashes)} hashes and "
                    f"{len(event.block_ids)} block ids"
                )
            tier = tier_for_medium(event.medium, default_tier)
            ops.extend(
                IndexOp("S", tier, event.group_id, bytes(h), block_id)
                for h, block_id in zip(event.block_hashes, event.block_ids, strict=True)
            )
        elif isinstance(event, BlockRemoved):
            tier = tier_for_medium(event.medium, default_tier)
            ops.extend(IndexOp("R", tier, event.group_id, bytes(h)) for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            ops.append(IndexOp("C", tier_for_medium(event.medium, default_tier)))
        else:
            raise ValueError(f"not a KV event: {type(event).__name__}")
    return ops


@dataclass(frozen=True, slots=True)
class Holder:
    """One node's contiguous run of a looked-up prefix.

    ``num_blocks``: the run's length from block 0 (every requested group held). ``tier``: the
    slowest tier in the run. ``packed_entries[g]``: ``num_blocks`` or more packed 5-byte entries for
    ``group_ids[g]``; decode with :meth:`block_ids` (kept packed so lookups stay cheap).
    """

    node_id: str
    incarnation: int
    num_blocks: int
    tier: Tier
    packed_entries: tuple[bytes, ...]

    def block_ids(self) -> list[list[int]]:
        """Block ids on the holder: ``[group][block]``, groups in ``group_ids`` order."""
        n = self.num_blocks * ENTRY_NUM_BYTES
        return [[bid for bid, _ in ENTRY_STRUCT.iter_unpack(p[:n])] for p in self.packed_entries]



class PrefixHit(NamedTuple):
    """``num_blocks``: the longest run any one holder has (0: no hit).

    ``holders``: every holder with a run of at least one block, longest first (ties by node id),
    so ``holders[0]`` is the best; a caller may re-rank equal runs by tier or load.
    """

    num_blocks: int
    holders: tuple[Holder, ...]

    @property
    def best_holder(self) -> Holder | None:
        return self.holders[0] if self.holders else None


NO_HIT = PrefixHit(0, ())


class PublishResult(NamedTuple):
    """``status``: ``"ok"`` applied, ``"fenced"`` refused (not the node's current incarnation, or
    expired), ``"unavailable"`` dropped (backend unreachable). ``num_ops``: ops in the batch."""

    status: IndexStatus
    num_ops: int


@dataclass(slots=True)
class IndexStats:
    """Counters, mutated by the index. Redis trouble is counted, never raised."""

    lookups: int = 0
    lookup_hits: int = 0
    lookups_failed: int = 0  # backend unreachable, slow or erroring: answered NO_HIT
    publishes: int = 0
    publish_ops: int = 0
    publishes_fenced: int = 0
    publishes_dropped: int = 0  # backend trouble: the batch is lost
    publish_ops_dropped: int = 0
    heartbeats_failed: int = 0
    garbage_entries: int = 0  # malformed entries/node records skipped by lookups
    reconnects: int = 0
    errors_by_kind: dict[str, int] = field(default_factory=dict)


def check_lookup_args(block_hashes: Sequence[bytes], group_ids: Sequence[int]) -> int:
    """Validate a lookup; return the common hash length in bytes (0 when no hashes)."""
    if not group_ids:
        raise ValueError("group_ids must name at least one KV cache group")
    if not block_hashes:
        return 0
    lengths = set(map(len, block_hashes))
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"block hashes must share one non-zero length, got lengths {lengths}")
    return lengths.pop()


def make_holder(
    node_id: str, incarnation: int, num_blocks: int, packed_entries: Sequence[bytes]
) -> Holder:
    """Build a Holder from packed entries (``num_blocks`` or more per group, 5 bytes each)."""
    end = num_blocks * ENTRY_NUM_BYTES
    # Tier codes sit at byte 4 of each entry; b"d" < b"h" < b"s" matches TIER_RANK order.
    worst_code = max(max(packed[4:end:ENTRY_NUM_BYTES]) for packed in packed_entries)
    tier = CODE_TO_TIER[bytes((worst_code,))]
    return Holder(node_id, incarnation, num_blocks, tier, tuple(packed_entries))


def sort_holders(holders: list[Holder]) -> PrefixHit:
    if not holders:
        return NO_HIT
    holders.sort(key=lambda h: (-h.num_blocks, h.node_id))
    return PrefixHit(holders[0].num_blocks, tuple(holders))


class BlockIndex(Protocol):
    """Contract shared by the backends. Node ids: non-empty, no ``:``/whitespace (ValueError).

    - ``register_node``: make ``incarnation`` the node's current one, alive for ``ttl_s``; a newer
      incarnation than the current drops the older one's entries, an equal one keeps them (unless
      expired), an older one is refused (``"fenced"``).
    - ``heartbeat``: extend the node's life by ``ttl_s``; ``"fenced"`` if not current or expired.
    - ``publish``: apply KV events (``events_to_ops``) atomically as one batch, in order.
    - ``longest_prefix``: ``block_hashes[i]`` is block i's hash (one length for all); a holder's run
      is the longest ``k`` such that it holds blocks ``0..k-1`` in every group of ``group_ids``.
      Never raises for backend trouble (answers ``NO_HIT`` and counts it); raises ValueError for
      bad arguments. Does not mutate entries (except dropping expired ones).
    """

    namespace: IndexNamespace
    stats: IndexStats

    def register_node(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus: ...

    def heartbeat(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus: ...

    def publish(
        self,
        node_id: str,
        incarnation: int,
        events: Iterable[Any],
        *,
        default_tier: Tier = "device",
    ) -> PublishResult: ...

    def longest_prefix(
        self,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        *,
        exclude_node_ids: Iterable[str] = (),
    ) -> PrefixHit: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _NodeState:
    incarnation: int
    deadline_s: float
    # group_id -> block_hash -> packed entry (ENTRY_STRUCT)
    group_to_entries: dict[int, dict[bytes, bytes]] = field(default_factory=dict)


class InMemoryBlockIndex:
    """The embedded backend: one process, shared by the nodes living in it. ``clock`` returns
    seconds (monotonic); tests may inject one."""

    def __init__(
        self, namespace: IndexNamespace, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.namespace = namespace
        self.stats = IndexStats()
        self._clock = clock
        self._nodes: dict[str, _NodeState] = {}
        self._node_to_max_incarnation: dict[str, int] = {}

    def _live_node(self, node_id: str) -> _NodeState | None:
        state = self._nodes.get(node_id)
        if state is not None and state.deadline_s <= self._clock():
            del self._nodes[node_id]  # expired: its entries go with it
            return None
        return state

    def register_node(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        check_node_id(node_id)
        check_incarnation(incarnation)
        if incarnation < self._node_to_max_incarnation.get(node_id, -1):
            return "fenced"
        self._node_to_max_incarnation[node_id] = incarnation
        state = self._live_node(node_id)
        deadline_s = self._clock() + ttl_s
        if state is None or state.incarnation != incarnation:
            self._nodes[node_id] = _NodeState(incarnation, deadline_s)
        else:
            state.deadline_s = deadline_s
        return "ok"

    def heartbeat(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        state = self._live_node(node_id)
        if state is None or state.incarnation != incarnation:
            self.stats.heartbeats_failed += 1
            return "fenced"
        state.deadline_s = self._clock() + ttl_s
        return "ok"

    def publish(
        self,
        node_id: str,
        incarnation: int,
        events: Iterable[Any],
        *,
        default_tier: Tier = "device",
    ) -> PublishResult:
        ops = events_to_ops(events, default_tier)
        state = self._live_node(node_id)
        if state is None or state.incarnation != incarnation:
            self.stats.publishes_fenced += 1
            return PublishResult("fenced", len(ops))
        for op in ops:
            code = TIER_TO_CODE[op.tier]
            if op.kind == "S":
                entries = state.group_to_entries.setdefault(op.group_id, {})
                entries[op.block_hash] = ENTRY_STRUCT.pack(op.block_id, code)
            elif op.kind == "R":
                entries = state.group_to_entries.get(op.group_id, {})
                packed = entries.get(op.block_hash)
                if packed is not None and packed[4:5] == code:
                    del entries[op.block_hash]
            else:
                for entries in state.group_to_entries.values():
                    for block_hash in [h for h, p in entries.items() if p[4:5] == code]:
                        del entries[block_hash]
        self.stats.publishes += 1
        self.stats.publish_ops += len(ops)
        return PublishResult("ok", len(ops))

    def longest_prefix(
        self,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        *,
        exclude_node_ids: Iterable[str] = (),
    ) -> PrefixHit:
        check_lookup_args(block_hashes, group_ids)
        self.stats.lookups += 1
        excluded = set(exclude_node_ids)
        holders: list[Holder] = []
        for node_id in sorted(self._nodes):
            state = self._live_node(node_id)
            if state is None or node_id in excluded:
                continue
            depth = len(block_hashes)
            packed_per_group: list[bytes] = []
            for group_id in group_ids:
                entries = state.group_to_entries.get(group_id, {})
                run: list[bytes] = []
                for block_hash in block_hashes[:depth]:
                    packed = entries.get(block_hash)
                    if packed is None:
                        break
                    run.append(packed)
                depth = len(run)
                packed_per_group.append(b"".join(run))
                if depth == 0:
                    break
            if depth > 0:
                holders.append(make_holder(node_id, state.incarnation, depth, packed_per_group))
        hit = sort_holders(holders)
        if hit.num_blocks:
            self.stats.lookup_hits += 1
        return hit

    def close(self) -> None:
        self._nodes.clear()
