"""Offload policy, the scheduler half of offload: which cached blocks a node writes to the store
tier this step (docs/architecture.md, "Life of a store offload and restore").

A block that is hashed and has ``ref_cnt == 0`` waits in the ``BlockPool`` free queue, still
findable by its hash, until ``get_new_blocks`` pops it and drops the hash (seed 000: the free
queue is the LRU eviction order, its head goes first). ``OffloadPlanner.plan`` runs once per
step after the step's schedule and forward (``update_connector_output``) and names up to
``blocks_per_step`` such blocks, read through ``BlockPool.iter_cold_cached_blocks`` from the
head (at most ``scan_blocks`` queue entries), each after its ancestors ("Ancestors" below).
The worker half snapshots their bytes at the next step's ``start_load_kv``, before its forward
(``sender.py``). That step's schedule runs in between and may pop a planned block for another
request, whose pull may land in it before the snapshot, so ``drop_reused`` (called after that
schedule, in ``build_connector_meta``) withdraws every item whose block no longer holds the
planned hash (every item, after a ``reset_prefix_cache``); a block that still holds it is never
written (a cached block is never written while it holds its hash).

Policies: ``"evict"`` plans cold blocks only; ``"write_through"`` first plans every block that
became cached (a ``BlockStored`` event), if it still holds that hash, then cold blocks.

Parents. The store publishes a block to the index only once its chain back to the first block
is held (``cache.py``), so each item carries its parent hash, learned from the pool's
``BlockStored`` events (``observe``, in ``build_connector_meta``). A block is snapshot only
after the forward that computed it: ``plan`` runs after a step's forward (async scheduling: a
block the next schedule hashed is computed before the step whose orders carry its item).

Ancestors. A chain's head is often hot: a system prompt shared by every request is touched by
each one and never becomes cold, so a planner that wrote cold blocks only would never write it
and the store would never anchor (never publish) any chain below it (found by the Mooncake
conversation trace replay, ``kvbridge-replay``). So before a block, ``plan`` plans its
ancestors that the store is not known to hold (not remembered as offloaded, not in flight) and
that the pool still caches under that hash (``BlockPool.get_cached_block``), root first, hot or
cold. The walk up ``_parent_of`` stops at the first ancestor that is known held, in flight,
planned this step, not cached, or whose parent is unknown (its removal was observed), and looks
at most ``num_gpu_blocks`` ancestors (each is a distinct cached block). Ancestors count against
``blocks_per_step``; what does not fit (the rest of the chain, root first, then the block) is
planned first by the next ``plan`` (``_due``), so each ancestor is walked over about once while
it is remembered and a step's walk is about as long as what it plans. The store anchors the
chain when its root arrives, whatever the order (it already takes children before parents).

An ancestor may be held by running requests (ref_cnt > 0). Its bytes are still safe to
snapshot: a full block's KV is written before it is hashed (a schedule hashes only the blocks
its own forward computes, a sync load lands before that forward, an async load's blocks are
hashed only once it is confirmed), and a block holding its hash is never written again by a
forward or a pull (a recompute after a load error rewrites the blocks past the bad one with the
same KV; the bad ones lose their hash in ``update_from_output`` before this ``plan``: under
``recompute`` vLLM keeps it, and the vLLM adapter's ``update_connector_output`` takes it). A
block in use is not in the free queue, so no schedule can pop it; if its request frees it and
the next schedule pops and reuses it before the snapshot, ``drop_reused`` withdraws it as for a
cold one.

Feedback. A planned item is *in flight* (never planned twice) until the worker reports its
``OffloadOutcome``: held -> remembered as offloaded (never planned again while remembered); not
held (the worker skipped it for back-pressure, the write failed, the store had no room, the
fence withdrew it) -> no longer in flight, and queued to be planned first next time (``_due``)
if the pool still caches it: a block's descendants may be remembered as offloaded already, so
no later walk would reach a hot ancestor again, and the store would never anchor them. The
planner does not know the worker's back-pressure rule; every submitted item is reported once.
What it remembers of its writes is bounded. A block the store was reported to hold is not
planned again while it is among this planner's last ``max_offloaded`` such writes, nor during
the rest of its stay in the pool (from its first cached copy's ``BlockStored`` to its last
copy's ``BlockRemoved``), whatever its age: a block written long ago, which the store may have
dropped since, is written again only once it is cached anew (pulled back, computed again), so a
scan that meets the same cold blocks step after step never writes one twice. (A bound on the
writes alone made a pool with more cold blocks than the bound write its head blocks again
every step and never reach the rest.) Memory: the pool's cached blocks plus ``max_offloaded``.
The store's own evictions come back too: a put's reply names, for the blocks it holds but cannot
publish, the first ancestor it does not hold (``cache.py``), and the worker passes each name on
as an outcome marked ``missing``. Such a block is forgotten as offloaded and planned first by
the next ``plan`` if the pool caches it (otherwise every chain this node writes below it would
stay out of the index); a name for a block in flight is ignored: its write, queued behind the
put that named it, reports it. The store names only the nearest missing ancestor, so a chain
whose d nearest ancestors it dropped is anchored again after d such rounds, one a step.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from kvbridge.kvmanager.block_hash import (
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvbridge.kvmanager.block_pool import BlockPool
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .offload_items import OffloadItem, OffloadOutcome

__all__ = ["OFFLOAD_POLICIES", "OffloadPlanner"]

OFFLOAD_POLICIES = ("evict", "write_through")
_MAX_REMEMBERED = 1 << 20


class OffloadPlanner:
    """Chooses the blocks to offload each step. See the module docstring.

    Owner: the engine thread (the ``BlockPool``'s owner); every method is called there; not
    thread-safe. It holds no pool object between calls and reads the pool only in ``plan``.

    Args:
        policy: ``"evict"`` or ``"write_through"``.
        blocks_per_step: most items one ``plan`` returns (>= 1).
        scan_blocks: most free-queue entries one ``plan`` looks at (>= 1).
        max_remembered: most in-flight, due and write-through keys kept (each set on its own;
            the oldest are forgotten first).
        max_offloaded: most of its writes reported held that it remembers, the oldest
            forgotten first; a block cached anew after its write was forgotten is written
            again (its bytes sent again; the store answers "present" if it still holds it).
            Writes of blocks the pool still caches in the same stay are remembered as well,
            whatever their age (module docstring). Default: ``max_remembered``.
            ``offload_remember_blocks`` (connector/config.py).

    Raises:
        ValueError: an unknown policy or a count below 1.
    """

    def __init__(
        self,
        *,
        policy: str,
        blocks_per_step: int,
        scan_blocks: int,
        max_remembered: int = _MAX_REMEMBERED,
        max_offloaded: int | None = None,
    ) -> None:
        if policy not in OFFLOAD_POLICIES:
            raise ValueError(f"policy must be one of {OFFLOAD_POLICIES}, got {policy!r}")
        max_offloaded = max_remembered if max_offloaded is None else max_offloaded
        for name, value in (("blocks_per_step", blocks_per_step), ("scan_blocks", scan_blocks),
                            ("max_remembered", max_remembered), ("max_offloaded", max_offloaded)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.policy = policy
        self.blocks_per_step = blocks_per_step
        self.scan_blocks = scan_blocks
        self.max_remembered = max_remembered
        self.max_offloaded = max_offloaded
        # pool key -> parent block hash (b"": first block), for every cached block observed
        self._parent_of: dict[BlockHashWithGroupId, bytes] = {}
        # pool key -> how many cached blocks hold it (two requests may compute one block each)
        self._num_copies: dict[BlockHashWithGroupId, int] = {}
        # write_through: (pool key, block id) cached since the last plan, oldest first
        self._write_through: deque[tuple[BlockHashWithGroupId, int]] = deque(
            maxlen=max_remembered
        )
        # pool key -> the parent hash it was planned with (b"": first block), until its outcome
        self._in_flight: OrderedDict[BlockHashWithGroupId, bytes] = OrderedDict()
        # held outcomes of the latest apply_outcomes -> their planned parents
        self._settled_parents: dict[BlockHashWithGroupId, bytes] = {}
        # writes reported held (module docstring): the last max_offloaded, and those of
        # blocks the pool has cached ever since
        self._recent_writes: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._written_this_stay: set[BlockHashWithGroupId] = set()
        self._store_incarnation = 0  # of the store that answered the latest outcomes
        # planned first by the next plan, oldest first: the rest of a chain that did not fit
        # (root first), and blocks reported not held (see the module docstring, "Feedback")
        self._due: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._cleared_since_fence = False  # an AllBlocksCleared observed since drop_reused

    # ------------------------------------------------------------------ inputs
    def observe(self, events: Iterable[Any]) -> None:
        """Learn parents (and write-through candidates) from the pool's KV events, in the order
        the pool recorded them (each step's, after its schedule: ``build_connector_meta``). A
        hash several blocks hold (each computed by its own request) keeps its parent until the
        last of them is removed."""
        for event in events:
            if isinstance(event, BlockStored):
                parent = bytes(event.parent_block_hash or b"")
                for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                    block_hash = bytes(block_hash)
                    key = make_block_hash_with_group_id(block_hash, event.group_id)
                    self._parent_of[key] = parent
                    self._num_copies[key] = self._num_copies.get(key, 0) + 1
                    if self.policy == "write_through":
                        self._write_through.append((key, block_id))
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    key = make_block_hash_with_group_id(bytes(block_hash), event.group_id)
                    num_copies = self._num_copies.pop(key, 0) - 1
                    if num_copies > 0:  # another block still holds it: still plannable
                        self._num_copies[key] = num_copies
                    else:
                        self._parent_of.pop(key, None)
                        self._written_this_stay.discard(key)
            elif isinstance(event, AllBlocksCleared):
                self._cleared_since_fence = True  # drop_reused withdraws every pending item
                self._parent_of.clear()
                self._num_copies.clear()
                self._written_this_stay.clear()
                self._write_through.clear()
                self._due.clear()

    def apply_outcomes(
        self, outcomes: Iterable[OffloadOutcome], store_incarnation: int = 0
    ) -> None:
        """Take the worker's report on submitted items (module docstring, "Feedback"): held
        ones are remembered as offloaded, the others leave the in-flight set and are due unless
        remembered as offloaded; a ``missing`` one is ignored while in flight, else forgotten
        as offloaded and due first. ``store_incarnation``: that of the store that answered the
        latest put (0: unknown); after another one, or after writes answered by a store that
        did not say (it restarted empty), every write remembered is forgotten once ``outcomes``
        are applied, so what the pool still caches is written again ("present" if held)."""
        had_writes = bool(self._recent_writes or self._written_this_stay)
        self._settled_parents = settled = {}
        for outcome in outcomes:
            key = make_block_hash_with_group_id(outcome.block_hash, outcome.group_id)
            if outcome.missing:
                if key not in self._in_flight:  # else its queued write will report it
                    self._forget_write(key)
                    self._queue_due(key, first=True)  # it keeps whole chains unlisted
                continue
            parent = self._in_flight.pop(key, None)
            if outcome.held:
                if parent is not None:
                    settled[key] = parent
                self._due.pop(key, None)
                _remember(self._recent_writes, key, self.max_offloaded)
                if key in self._num_copies:
                    self._written_this_stay.add(key)
            else:
                self._queue_due(key)
        if store_incarnation and store_incarnation != self._store_incarnation:
            # A new store process: a restart, or the first one that says (an older store's
            # replies carry none), unless nothing was remembered before these outcomes.
            if self._store_incarnation or had_writes:
                self._recent_writes.clear()
                self._written_this_stay.clear()
            self._store_incarnation = store_incarnation

    # ------------------------------------------------------------------ the step's plan
    def plan(self, block_pool: BlockPool, num_planned: int = 0) -> list[OffloadItem]:
        """The items to offload this step, at most ``blocks_per_step`` less ``num_planned``
        (planned for the same step before: vLLM's async scheduling may process two outputs
        between two schedules): due blocks first (oldest first), then write-through blocks
        (oldest first), then cold blocks from the free queue's head; each preceded by its
        ancestors the store is not known to hold (root first, see the module docstring); never
        a block in flight, remembered as offloaded, or whose parent is unknown. Marks them in
        flight. Reads ``block_pool`` (``iter_cold_cached_blocks``, ``get_block``,
        ``get_cached_block``), mutates only the planner."""
        picked = _Picked(max(0, self.blocks_per_step - num_planned))
        self._take_due(block_pool, picked)
        while self._write_through and picked.room:
            key, block_id = self._write_through.popleft()
            if block_pool.get_block(block_id).block_hash == key:  # not evicted since
                self._consider(key, block_id, block_pool, picked)
        if picked.room:
            # Once the store holds most of the cold blocks, this scan meets them again every
            # step: they are passed over with three dict reads, not a chain walk each.
            in_flight, written, recent = self._in_flight, self._written_this_stay, \
                self._recent_writes
            for block_id, key in block_pool.iter_cold_cached_blocks(self.scan_blocks):
                if key in written or key in recent or key in in_flight:
                    continue
                self._consider(key, block_id, block_pool, picked)
                if not picked.room:
                    break
        return self._mark_in_flight(picked)

    def plan_due(self, block_pool: BlockPool) -> list[OffloadItem]:
        """What ``plan`` names first, the due blocks (each after its ancestors), with no
        ``blocks_per_step`` limit and nothing else: for a caller that writes evicted blocks
        itself (``plan_evicted``, the trace replay), so that blocks reported not held or
        missing are written again. Marks them in flight. Reads ``block_pool``, mutates only the
        planner."""
        picked = _Picked(sys.maxsize)
        self._take_due(block_pool, picked)
        return self._mark_in_flight(picked)

    def _take_due(self, block_pool: BlockPool, picked: _Picked) -> None:
        while self._due and picked.room:
            key, _ = self._due.popitem(last=False)
            cached = block_pool.get_cached_block(get_block_hash(key), (get_group_id(key),))
            if cached is not None:
                self._consider(key, cached[0].block_id, block_pool, picked)

    def _consider(
        self, key: BlockHashWithGroupId, block_id: int, block_pool: BlockPool, picked: _Picked
    ) -> None:
        """Pick ``key``'s chain (ancestors first) while there is room; the rest is due."""
        chain = self._chain(key, block_id, block_pool, picked.keys)
        room = picked.room
        for chain_key, chain_block_id in chain[:room]:
            picked.keys[chain_key] = None
            picked.items.append(self._item(chain_key, chain_block_id))
        for chain_key, _ in chain[room:]:  # root first: the next plan goes on from here
            self._queue_due(chain_key)

    def _queue_due(self, key: BlockHashWithGroupId, *, first: bool = False) -> None:
        """Queue ``key`` to be planned next, last (or ``first``); a full list (``max_remembered``)
        drops its last entry: a block dropped so is found again by a later walk or scan,
        unless it is a hot ancestor, which only names put first keep in the list."""
        due = self._due
        due[key] = None
        due.move_to_end(key, last=not first)
        if len(due) > self.max_remembered:
            due.popitem(last=True)

    def _offloaded(self, key: BlockHashWithGroupId) -> bool:
        return key in self._written_this_stay or key in self._recent_writes

    def _forget_write(self, key: BlockHashWithGroupId) -> None:
        self._written_this_stay.discard(key)
        self._recent_writes.pop(key, None)

    def _mark_in_flight(self, picked: _Picked) -> list[OffloadItem]:
        for key, item in zip(picked.keys, picked.items, strict=True):
            _remember(self._in_flight, key, self.max_remembered, item.parent_hash)
        return picked.items

    def plan_evicted(
        self, block_pool: BlockPool, block_id: int, group_id: int, block_hash: bytes
    ) -> list[OffloadItem]:
        """The items ``plan`` would name for one block, ``block_hash`` in block ``block_id``,
        with no ``blocks_per_step`` limit: its ancestors the store is not known to hold that
        ``block_pool`` still caches, root first, then the block itself; empty when the block
        is in flight, remembered as offloaded or of unknown parent. The block itself need not
        be cached any more: the trace replay (``connector/serve/replay/store.py``) writes a block at
        its eviction, before observing its ``BlockRemoved``. Marks the items in flight (report
        them with ``apply_outcomes``). Reads ``block_pool``, mutates only the planner."""
        key = make_block_hash_with_group_id(block_hash, group_id)
        items = [self._item(chain_key, chain_block_id)
                 for chain_key, chain_block_id in self._chain(key, block_id, block_pool, {})]
        for item in items:
            chain_key = make_block_hash_with_group_id(item.block_hash, item.group_id)
            self._due.pop(chain_key, None)
            _remember(self._in_flight, chain_key, self.max_remembered, item.parent_hash)
        return items

    def _plannable(
        self, key: BlockHashWithGroupId, picked_keys: dict[BlockHashWithGroupId, None]
    ) -> bool:
        return (
            key in self._parent_of
            and key not in self._in_flight
            and not self._offloaded(key)
            and key not in picked_keys
        )

    def _chain(
        self,
        key: BlockHashWithGroupId,
        block_id: int,
        block_pool: BlockPool,
        picked_keys: dict[BlockHashWithGroupId, None],
    ) -> list[tuple[BlockHashWithGroupId, int]]:
        """``(key, block id)`` of ``key``'s ancestors to plan before it, root first, then
        ``key`` in ``block_id``; empty when ``key`` itself is not plannable. The walk stops
        at the first ancestor that is not plannable or not cached, and after
        ``num_gpu_blocks`` ancestors (each one is a distinct cached block). Pure."""
        if not self._plannable(key, picked_keys):
            return []
        chain = [(key, block_id)]
        group_id = (get_group_id(key),)
        parent = self._parent_of[key]
        for _ in range(block_pool.num_gpu_blocks):
            if not parent:  # the root's parent
                break
            parent_key = make_block_hash_with_group_id(parent, group_id[0])
            if not self._plannable(parent_key, picked_keys):
                break
            cached = block_pool.get_cached_block(parent, group_id)
            if cached is None:
                break
            chain.append((parent_key, cached[0].block_id))
            parent = self._parent_of[parent_key]
        chain.reverse()
        return chain

    def _item(self, key: BlockHashWithGroupId, block_id: int) -> OffloadItem:
        return OffloadItem(block_id, get_group_id(key), get_block_hash(key), self._parent_of[key])

    def drop_reused(
        self, items: list[tuple[int, int, bytes, bytes]], block_pool: BlockPool
    ) -> list[tuple[int, int, bytes, bytes]]:
        """The fence between plan and snapshot (module docstring): keeps the ``OffloadItem``
        records (``(block_id, group_id, block_hash, parent_hash)``) whose block still holds the
        planned hash and reports the others not held (a later ``plan`` may pick the block again
        wherever its hash lives then); none after an ``AllBlocksCleared`` observed since the
        last call (the schedule after ``reset_prefix_cache``, for new weights say, may hash a
        planned block again under the same hash before its forward rewrites the KV). Call it
        after the schedule that follows ``plan`` (``build_connector_meta``). Issue 15, case 5
        (a vLLM report: a store recorded a reused block's new bytes under the old hash). Reads
        ``block_pool``, mutates only the planner."""
        kept: list[tuple[int, int, bytes, bytes]] = []
        cleared, self._cleared_since_fence = self._cleared_since_fence, False
        for item in items:
            block_id, group_id, block_hash = item[0], item[1], item[2]
            key = make_block_hash_with_group_id(block_hash, group_id)
            if not cleared and block_pool.get_block(block_id).block_hash == key:
                kept.append(item)
            else:
                self.apply_outcomes([OffloadOutcome(group_id, block_hash, False)])
        return kept

    # ------------------------------------------------------------------ introspection
    @property
    def num_in_flight(self) -> int:
        """Items planned whose outcome has not been applied yet."""
        return len(self._in_flight)

    @property
    def store_incarnation(self) -> int:
        """The incarnation of the store its memory of writes refers to (0: not known yet)."""
        return self._store_incarnation

    def is_offloaded(self, group_id: int, block_hash: bytes) -> bool:
        """True if the worker reported the store holds this block (and it is still remembered)."""
        return self._offloaded(make_block_hash_with_group_id(block_hash, group_id))

    def parent_of(self, group_id: int, block_hash: bytes) -> bytes | None:
        """The parent hash learned for this cached block (``b""``: a first block), None when
        no ``BlockStored`` named it or its removal was observed."""
        return self._parent_of.get(make_block_hash_with_group_id(block_hash, group_id))

    def written_parent_of(self, group_id: int, block_hash: bytes) -> bytes | None:
        """For a block whose write the latest ``apply_outcomes`` settled held, the parent it
        was planned with (what the store recorded, even if the pool dropped the block since);
        else ``parent_of``."""
        key = make_block_hash_with_group_id(block_hash, group_id)
        parent = self._settled_parents.get(key)
        return self._parent_of.get(key) if parent is None else parent


class _Picked:
    """One plan's picks: items in order, their keys, and how many more fit."""

    __slots__ = ("items", "keys", "limit")

    def __init__(self, limit: int) -> None:
        self.items: list[OffloadItem] = []
        self.keys: dict[BlockHashWithGroupId, None] = {}  # insertion-ordered
        self.limit = limit

    @property
    def room(self) -> int:
        return self.limit - len(self.items)


def _remember(keys: OrderedDict[BlockHashWithGroupId, Any], key: BlockHashWithGroupId,
              max_keys: int, value: Any = None) -> None:
    keys[key] = value
    keys.move_to_end(key)
    while len(keys) > max_keys:
        keys.popitem(last=False)
