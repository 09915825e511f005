"""Block index: which node holds which block hash, and the longest prefix held anywhere.

docs/architecture.md, "The block index". A node publishes its ``BlockPool`` KV events
(``BlockStored`` adds, ``BlockRemoved`` removes, ``AllBlocksCleared`` drops all the node's
entries); any node asks ``longest_prefix(block_hashes, group_ids)`` for the deepest run of a
request's blocks that one holder can serve whole (full-attention semantics: every block from
block 0). Entries are keyed per KV cache group (hash + group id), several holders per hash.
Two backends share this contract: :class:`InMemoryBlockIndex` (below, one process) and
``RedisBlockIndex`` (``redis_index.py``, across nodes, one round trip).

Freshness and fencing:

- ``register_node(node_id, incarnation, ttl_s=...)`` starts a node's life. Incarnations grow on
  every restart (:func:`new_incarnation`); registering a newer incarnation drops every entry of the
  older one, and an older incarnation is refused once a newer one registered.
- ``publish`` and ``heartbeat`` from any incarnation other than the node's current one are refused
  (``"fenced"``), so a restarted node's zombie writes are ignored.
- A node that does not heartbeat within ``ttl_s`` expires: lookups ignore it and its entries go.
  Its next ``heartbeat`` or ``publish`` answers ``"fenced"``; it registers again (entries empty).

Events that never leave the index wrong: a node numbers its publish batches ``1, 2, ...`` per
incarnation (``seq``). The backend applies a batch only if it continues the last one applied;
a batch already applied (a retry of a call that timed out on the client but landed) is ignored
(``"replayed"``), so a late "stored" never resurrects what a later "removed" deleted; a batch
after a gap (a batch dropped, Redis restarted empty) is refused (``"gap"``) and the node
re-publishes its whole cached set (``resync=True``: drop the node's entries, store the set,
continue from that batch's number), after which the index again says exactly what it holds.

A hit is advisory (docs/architecture.md, "Life of an index hit"): the holder re-checks each
block's hash when serving it. A stale entry costs a recompute, never wrong output.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol
from urllib.parse import quote

import numpy as np
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.transport.identity import BlockIdentity

from .index_stats import IndexStats

if TYPE_CHECKING:
    from kvbridge.kvmanager import PrefixHitRule

Tier = Literal["device", "host", "store"]
IndexStatus = Literal["ok", "fenced", "unavailable"]
PublishStatus = Literal["ok", "fenced", "unavailable", "gap", "replayed"]

TIER_TO_CODE: dict[str, bytes] = {"device": b"d", "host": b"h", "store": b"s"}
CODE_TO_TIER: dict[bytes, Tier] = {b"d": "device", b"h": "host", b"s": "store"}
# Slowest tier of a run describes the cost of pulling it (device < host < store).
TIER_RANK: dict[str, int] = {"device": 0, "host": 1, "store": 2}
RANK_TO_TIER: tuple[Tier, ...] = ("device", "host", "store")
_MEDIUM_TO_TIER: dict[str, Tier] = {
    "gpu": "device",
    "cuda": "device",
    "device": "device",
    "cpu": "host",
    "host": "host",
    "store": "store",
    "disk": "store",
    "remote": "store",
}
INCARNATION_DIGITS = 20  # zero-padded decimal so string order equals numeric order (Lua side)


def new_incarnation() -> int:
    """A fresh incarnation for a starting node: wall-clock nanoseconds, larger on every restart."""
    return time.time_ns()


def check_node_id(node_id: str) -> None:
    """Raise ValueError for an id that cannot be a key segment (empty, ``:`` or whitespace)."""
    if not node_id or ":" in node_id or any(c.isspace() for c in node_id):
        raise ValueError(f"node_id must be non-empty without ':' or whitespace, got {node_id!r}")


def check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")


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
    """Where a node's entries live: keys of different namespaces never match.

    Args:
        identity: the nodes' ``BlockIdentity`` (``kvbridge.transport``): every field of it,
            the one description the handshake checks too, is in ``key_prefix``; a node takes
            its own from its worker half's handshake metadata.
        key_hash_bytes: entries are keyed by the first this many bytes of each block hash.
            8 bytes: a false match needs a 64-bit collision at the same position of one node's
            entries (~1e6 / 2**64 per probe) and would cost a recompute (the holder re-checks
            the full hash); a lookup of 625 hashes sends 5 KB instead of 20 KB, which is most
            of its cost.

    Raises:
        ValueError: ``key_hash_bytes`` below 8.
    """

    identity: BlockIdentity
    key_hash_bytes: int = 8
    # The KV heads a block of this domain holds, for engines that shard them (tensor parallel:
    # "tp2h8", 2 ranks of 8 heads): a block published by one rank layout is found only by
    # engines of the same layout. "": every head in one block (the key prefix is unchanged).
    kv_heads_layout: str = ""

    def __post_init__(self) -> None:
        if self.key_hash_bytes < 8:
            raise ValueError(f"key_hash_bytes must be at least 8, got {self.key_hash_bytes}")

    @property
    def model_name(self) -> str:
        return self.identity.model_name

    @property
    def block_size(self) -> int:
        return self.identity.block_size

    @property
    def key_prefix(self) -> str:
        """``kvbridge:bi:<model>:<identity>:k<key_hash_bytes>`` (then ``:<kv_heads_layout>``
        when set): the model name %-quoted (for people reading the keys), ``<identity>`` the
        first 16 hex digits of the identity's ``digest`` (over every field of it, the model
        name included). No ``{``, ``}`` or ``:`` inside a segment (Redis Cluster hash tags
        wrap the prefix: ``redis_cluster``)."""
        model = quote(self.identity.model_name, safe="")
        prefix = f"kvbridge:bi:{model}:{self.identity.digest[:16]}:k{self.key_hash_bytes}"
        if self.kv_heads_layout:
            prefix += ":" + quote(self.kv_heads_layout, safe="")
        return prefix


class IndexOp(NamedTuple):
    """One change to a node's entries: ``"S"`` store, ``"R"`` remove, ``"C"`` clear all.

    ``block_id`` -1: unknown (a remove then matches any block id). ``parent_hash`` b"": block 0.
    """

    kind: Literal["S", "R", "C"]
    tier: Tier
    group_id: int = 0
    block_hash: bytes = b""
    block_id: int = -1
    parent_hash: bytes = b""


def events_to_ops(events: Iterable[Any], default_tier: Tier = "device") -> list[IndexOp]:
    """Translate ``BlockPool.take_events()`` output into index ops, in event order.

    A BlockStored's hashes form one chain: the parent of ``block_hashes[0]`` is
    ``parent_block_hash``, of ``block_hashes[i]`` it is ``block_hashes[i - 1]``. A BlockRemoved
    without one block id per hash removes whatever block holds the hash.

    Raises ValueError for an event of another type or a BlockStored whose ``block_hashes`` and
    ``block_ids`` differ in length.
    """
    return list(map(IndexOp._make, iter_event_ops(events, default_tier)))


OpFields = tuple[str, Tier, int, bytes, int, bytes]
"""An op's fields in ``IndexOp``'s order: ``(kind, tier, group_id, block_hash, block_id,
parent_hash)``; an ``IndexOp`` is one."""


def iter_event_ops(events: Iterable[Any], default_tier: Tier = "device") -> Iterator[OpFields]:
    """``events_to_ops`` as plain tuples, one at a time, for a consumer that packs each op as
    it comes (``redis_publish.pack_ops``: no ``IndexOp`` built). Raises as
    ``events_to_ops`` does, when it reaches the bad event."""
    for event in events:
        if isinstance(event, BlockStored):
            if len(event.block_hashes) != len(event.block_ids):
                raise ValueError(
                    f"BlockStored has {len(event.block_hashes)} hashes and "
                    f"{len(event.block_ids)} block ids"
                )
            tier, group_id = tier_for_medium(event.medium, default_tier), event.group_id
            parent = bytes(event.parent_block_hash or b"")
            for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                block_hash = bytes(block_hash)
                yield "S", tier, group_id, block_hash, block_id, parent
                parent = block_hash  # the event's hashes are one chain, in order
        elif isinstance(event, BlockRemoved):
            tier, group_id = tier_for_medium(event.medium, default_tier), event.group_id
            block_ids = event.block_ids
            if len(block_ids) != len(event.block_hashes):
                block_ids = [-1] * len(event.block_hashes)
            for block_hash, block_id in zip(event.block_hashes, block_ids, strict=True):
                yield "R", tier, group_id, bytes(block_hash), block_id, b""
        elif isinstance(event, AllBlocksCleared):
            yield "C", tier_for_medium(event.medium, default_tier), 0, b"", -1, b""
        else:
            raise ValueError(f"not a KV event: {type(event).__name__}")


@dataclass(frozen=True, slots=True)
class Holder:
    """One node's contiguous run of a looked-up prefix.

    ``num_blocks``: the run's length from block 0 (held in every requested group). ``tier``: the
    slowest tier in the run (device < host < store). The blocks' ids on the holder come from
    ``BlockIndex.get_block_ids`` (a second call, for the chosen holder only), except for a
    lookup with a ``hit_rule``: then ``block_ids[group][i]`` are read with the lookup (0, the
    null block, where the rule needs no block, e.g. outside a sliding window).
    """

    node_id: str
    incarnation: int
    num_blocks: int
    tier: Tier
    block_ids: tuple[tuple[int, ...], ...] | None = None


class PrefixHit(NamedTuple):
    """``num_blocks``: the longest run any one holder has (0: no hit).

    ``holders``: longest run first (ties by node id), so ``holders[0]`` is a best one; by default
    only the holders of the longest run, every holder with a run with ``all_holders=True``.
    """

    num_blocks: int
    holders: tuple[Holder, ...]

    @property
    def best_holder(self) -> Holder | None:
        return self.holders[0] if self.holders else None


NO_HIT = PrefixHit(0, ())


class PublishResult(NamedTuple):
    """``status``: ``"ok"`` applied, ``"fenced"`` refused (not the node's current incarnation, or
    expired), ``"unavailable"`` dropped (backend unreachable; it may still land), ``"gap"``
    refused (``seq`` does not continue the last batch applied: resync), ``"replayed"`` ignored
    (``seq`` applied already). ``num_ops``: ops in the batch."""

    status: PublishStatus
    num_ops: int


class ParkedParts(NamedTuple):
    """What a backend holds of a node's publish calls it could not deliver yet
    (``BlockIndex.parked_parts``): ``parts`` parked, ``unretried`` buckets whose oldest part has
    had fewer than two calls, ``oldest_seq`` the node's batch number of the oldest (0: none)."""

    parts: int = 0
    unretried: int = 0
    oldest_seq: int = 0


def check_seq(seq: tuple[int, int] | None) -> None:
    """Raise ValueError unless ``seq`` is None or ``(first, last)`` with ``1 <= first <= last``."""
    if seq is not None and not (
        len(seq) == 2 and all(isinstance(x, int) for x in seq) and 1 <= seq[0] <= seq[1]
    ):
        raise ValueError(f"seq must be (first, last) with 1 <= first <= last, got {seq!r}")


def seq_verdict(
    last_applied: int, seq: tuple[int, int] | None, resync: bool
) -> Literal["apply", "gap", "replayed"]:
    """Whether a batch numbered ``seq`` applies after batch ``last_applied`` (0: none yet).
    Unnumbered batches always apply; a resync applies after any earlier batch."""
    if seq is None:
        return "apply"
    first, last = seq
    if last <= last_applied:
        return "replayed"
    if resync or first == last_applied + 1:
        return "apply"
    return "gap"


def check_lookup_args(block_hashes: Sequence[bytes], group_ids: Sequence[int]) -> None:
    """Raise ValueError for no group ids or hashes of different (or zero) lengths."""
    if not group_ids:
        raise ValueError("group_ids must name at least one KV cache group")
    if block_hashes:
        lengths = set(map(len, block_hashes))
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError(f"block hashes must share one non-zero length, got {sorted(lengths)}")


@functools.cache
def _key_dtype(key_hash_bytes: int) -> np.dtype:
    """A record of ``key_hash_bytes`` raw bytes (built once per length, not per lookup)."""
    return np.dtype((np.void, key_hash_bytes))


def join_keys(block_hashes: Sequence[bytes], key_hash_bytes: int) -> tuple[bytes, int]:
    """The lookup keys of ``block_hashes`` concatenated, and the length of one key in bytes.

    Each key is a hash cut to ``key_hash_bytes`` (a hash no longer than that is its own key).
    The hashes must share one non-zero length; on this hot path that is checked by the total
    length of one ``bytes.join`` (a mix whose lengths happen to add up is not caught here; its
    keys are then wrong, which costs a miss, and a hit stays advisory). Raises ValueError.
    Cost: one join and one strided numpy copy, whatever the number of hashes (the join is most
    of it; docs/architecture.md, "Design measurements").
    """
    blob = b"".join(block_hashes)
    num_blocks = len(block_hashes)
    hash_len = len(block_hashes[0])
    if hash_len == 0 or len(blob) != hash_len * num_blocks:
        raise ValueError("block hashes must share one non-zero length")
    if hash_len <= key_hash_bytes:
        return blob, hash_len
    if hash_len % key_hash_bytes == 0:
        # The blob as records of key_hash_bytes; every (hash_len / key_hash_bytes)-th is a key.
        records = np.frombuffer(blob, dtype=_key_dtype(key_hash_bytes))
        return records[:: hash_len // key_hash_bytes].tobytes(), key_hash_bytes
    rows = np.frombuffer(blob, dtype=np.uint8).reshape(num_blocks, hash_len)
    return rows[:, :key_hash_bytes].tobytes(), key_hash_bytes


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
      AllBlocksCleared drops every entry of the node. ``seq=(first, last)``: the batch numbers
      the call carries (see the module docstring; ``seq_verdict`` decides), ``resync=True``:
      the call's events are the node's whole cached set (they start with AllBlocksCleared).
    - ``longest_prefix``: ``block_hashes[i]`` is block i's hash (one length for all); a holder's run
      is the longest ``k`` such that it holds blocks ``0..k-1`` in every group of ``group_ids``.
      Returns the holders of the deepest run (ties: all of them, for the caller to break by
      load; the Redis backends read at most ``redis_scripts.LOOKUP_SAMPLE_HOLDERS`` random
      holders of a block, so a block held by more nodes reports at most that many), or with
      ``all_holders=True`` every holder with its own run. With ``hit_rule`` (a
      ``kvmanager.PrefixHitRule`` for groups ``0..n-1``) a holder's run is what that rule
      restores from the holder's entries (``hit_rule.hit_of_holder``), with its block ids.
      Never raises for backend trouble (answers ``NO_HIT`` and counts it); raises ValueError
      for bad arguments.
      Does not change live entries (stale ones it meets may be deleted).
    - ``longest_prefixes``: ``longest_prefix`` (deepest runs) of each of ``prompts``, in their
      order; the Redis backends ask for them all in one call per server (one round trip).
    - ``node_entries``: ``{(group, key, block id)}`` of the node's live entries (keys cut to
      ``key_hash_bytes``), or None if the node is unknown or the backend unavailable. O(entries):
      for tests and tools.
    - ``get_block_ids``: the holder's block ids ``[group][block]`` for ``block_hashes`` (in
      ``group_ids`` order), or None if any is not held (anymore) or the backend is unavailable.
    - ``available``: False from a call that met backend trouble until a later call succeeds (a
      ``NO_HIT`` or None answer read with it says "unavailable", not "not held").
    - ``interrupt``: make calls in flight on other threads return at once as backend trouble
      (sockets closed); later calls reconnect. Safe from any thread; for prompt shutdown.
    - ``parked_parts`` / ``send_parked``: a backend that holds parts of publish calls it could
      not deliver yet (``RedisClusterBlockIndex``: one bucket's shard down) counts them
      (``ParkedParts``) and sends them again ("ok": none left, "unavailable": some, "fenced":
      one refused); the others hold none (``ParkedParts()``, "ok").

    Thread safety: ``RedisBlockIndex`` may be called from any thread (the Redis client's pool
    gives each call its own connection); ``InMemoryBlockIndex`` is not thread-safe by itself
    (``open_index`` serialises it behind a lock). ``IndexClient`` makes every call from its one
    worker thread, so each counter has one writer.
    """

    namespace: IndexNamespace
    stats: IndexStats

    @property
    def available(self) -> bool: ...

    def interrupt(self) -> None: ...

    def register_node(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus: ...

    def heartbeat(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus: ...

    def publish(
        self,
        node_id: str,
        incarnation: int,
        events: Iterable[Any],
        *,
        default_tier: Tier = "device",
        seq: tuple[int, int] | None = None,
        resync: bool = False,
    ) -> PublishResult: ...

    def longest_prefix(
        self,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        *,
        exclude_node_ids: Iterable[str] = (),
        all_holders: bool = False,
        hit_rule: PrefixHitRule | None = None,
    ) -> PrefixHit: ...

    def longest_prefixes(
        self, prompts: Sequence[Sequence[bytes]], group_ids: Sequence[int] = (0,), *,
        exclude_node_ids: Iterable[str] = (), hit_rule: PrefixHitRule | None = None,
    ) -> list[PrefixHit]: ...

    def node_entries(self, node_id: str) -> set[tuple[int, bytes, int]] | None: ...

    def parked_parts(self, node_id: str) -> ParkedParts: ...

    def send_parked(self, node_id: str, incarnation: int) -> IndexStatus: ...

    def get_block_ids(
        self,
        node_id: str,
        incarnation: int,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
    ) -> list[list[int]] | None: ...

    def close(self) -> None: ...
