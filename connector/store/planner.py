"""Offload policy, the scheduler half of offload: which cached blocks a node writes to the store
tier this step (DESIGN.md, "One disaggregated request", the store tier paragraph).

A block that is hashed and has ``ref_cnt == 0`` waits in the ``BlockPool`` free queue, still
findable by its hash, until ``get_new_blocks`` pops it and drops the hash (seed 000: the free
queue is the LRU eviction order, its head goes first). ``OffloadPlanner.plan`` runs once per
step after the step's schedule (``build_connector_meta``) and names up to ``blocks_per_step``
such blocks, read through ``BlockPool.iter_cold_cached_blocks`` from the head (at most
``scan_blocks`` queue entries). The worker half snapshots their bytes at the next step's
``start_load_kv``, before its forward (``sender.py``). That step's schedule runs in between and
may pop a planned block for another request, whose pull may land in it before the snapshot, so
``drop_reused`` (called after that schedule, in ``build_connector_meta``) withdraws every item
whose block no longer holds the planned hash; a block that still holds it is never written (a
cached block is never written while it holds its hash).

Policies: ``"evict"`` plans cold blocks only; ``"write_through"`` first plans every block that
became cached (a ``BlockStored`` event), if it still holds that hash, then cold blocks.

Parents. The store publishes a block to the index only once its chain back to the first block
is held (``cache.py``), so each item carries its parent hash, learned from the pool's
``BlockStored`` events (``observe``). Only blocks whose event was observed are planned; events
are observed after the forward that computed their blocks (``update_connector_output``), so a
block hashed by this step's schedule, whose KV is not computed yet, is never planned.

Feedback. A planned item is *in flight* (never planned twice) until the worker reports its
``OffloadOutcome``: held -> remembered as offloaded (never planned again while remembered);
not held (the worker skipped it for back-pressure, the write failed, the store had no room)
-> forgotten, so a later ``plan`` picks it again if it is still cold. The planner does not
know the worker's back-pressure rule; it only needs every submitted item to be reported once.
"""

from __future__ import annotations

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
        max_remembered: most offloaded (and, separately, in-flight) keys kept; the oldest are
            forgotten first (a forgotten offloaded block may be written again: the store
            answers "present").

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
    ) -> None:
        if policy not in OFFLOAD_POLICIES:
            raise ValueError(f"policy must be one of {OFFLOAD_POLICIES}, got {policy!r}")
        for name, value in (
            ("blocks_per_step", blocks_per_step),
            ("scan_blocks", scan_blocks),
            ("max_remembered", max_remembered),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.policy = policy
        self.blocks_per_step = blocks_per_step
        self.scan_blocks = scan_blocks
        self.max_remembered = max_remembered
        # pool key -> parent block hash (b"": first block), for every cached block observed
        self._parent_of: dict[BlockHashWithGroupId, bytes] = {}
        # write_through: (pool key, block id) cached since the last plan, oldest first
        self._write_through: deque[tuple[BlockHashWithGroupId, int]] = deque(
            maxlen=max_remembered
        )
        self._in_flight: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._offloaded: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()

    # ------------------------------------------------------------------ inputs
    def observe(self, events: Iterable[Any]) -> None:
        """Learn parents (and write-through candidates) from the pool's KV events, in the order
        the pool recorded them. Feed it only events of steps whose forward has run."""
        for event in events:
            if isinstance(event, BlockStored):
                parent = bytes(event.parent_block_hash or b"")
                for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                    block_hash = bytes(block_hash)
                    key = make_block_hash_with_group_id(block_hash, event.group_id)
                    self._parent_of[key] = parent
                    if self.policy == "write_through":
                        self._write_through.append((key, block_id))
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    key = make_block_hash_with_group_id(bytes(block_hash), event.group_id)
                    self._parent_of.pop(key, None)
            elif isinstance(event, AllBlocksCleared):
                self._parent_of.clear()
                self._write_through.clear()

    def apply_outcomes(self, outcomes: Iterable[OffloadOutcome]) -> None:
        """Take the worker's report on submitted items: held ones are remembered as offloaded,
        the others may be planned again. An outcome for an unknown key is applied the same way
        (a held block is remembered)."""
        for outcome in outcomes:
            key = make_block_hash_with_group_id(outcome.block_hash, outcome.group_id)
            self._in_flight.pop(key, None)
            if outcome.held:
                _remember(self._offloaded, key, self.max_remembered)

    # ------------------------------------------------------------------ the step's plan
    def plan(self, block_pool: BlockPool) -> list[OffloadItem]:
        """The items to offload this step, at most ``blocks_per_step``: write-through blocks
        first (oldest first), then cold blocks from the free queue's head; never a block in
        flight, remembered as offloaded, or whose parent is unknown. Marks them in flight.
        Reads ``block_pool`` (``iter_cold_cached_blocks``, ``get_block``), mutates only the
        planner."""
        picked: list[OffloadItem] = []
        picked_keys: dict[BlockHashWithGroupId, None] = {}  # insertion-ordered
        limit = self.blocks_per_step
        parent_of, in_flight, offloaded = self._parent_of, self._in_flight, self._offloaded

        def consider(key: BlockHashWithGroupId, block_id: int) -> None:
            parent = parent_of.get(key)
            if parent is None or key in in_flight or key in offloaded or key in picked_keys:
                return
            picked_keys[key] = None
            picked.append(OffloadItem(block_id, get_group_id(key), get_block_hash(key), parent))

        while self._write_through and len(picked) < limit:
            key, block_id = self._write_through.popleft()
            if block_pool.get_block(block_id).block_hash == key:  # not evicted since
                consider(key, block_id)
        if len(picked) < limit:
            for block_id, key in block_pool.iter_cold_cached_blocks(self.scan_blocks):
                consider(key, block_id)
                if len(picked) >= limit:
                    break
        for key in picked_keys:
            _remember(in_flight, key, self.max_remembered)
        return picked

    def drop_reused(
        self, items: list[tuple[int, int, bytes, bytes]], block_pool: BlockPool
    ) -> list[tuple[int, int, bytes, bytes]]:
        """The fence between plan and snapshot. ``plan`` runs at the end of a step, the worker
        snapshots the items at the next step's ``start_load_kv``, and that step's schedule runs
        in between: it may pop a planned block and hand it to another request, whose pull may
        land in it before the snapshot. Call this after that schedule (``build_connector_meta``):
        it keeps the ``OffloadItem`` records (``(block_id, group_id, block_hash,
        parent_hash)``) whose block still holds the planned hash and reports the others not held
        (so a later ``plan`` may pick the block again wherever its hash lives then). Issue 15,
        case 5 (a vLLM report: a store recorded a reused block's new bytes under the old hash).
        Reads ``block_pool``, mutates only the planner."""
        kept: list[tuple[int, int, bytes, bytes]] = []
        for item in items:
            block_id, group_id, block_hash = item[0], item[1], item[2]
            key = make_block_hash_with_group_id(block_hash, group_id)
            if block_pool.get_block(block_id).block_hash == key:
                kept.append(item)
            else:
                self.apply_outcomes([OffloadOutcome(group_id, block_hash, False)])
        return kept

    # ------------------------------------------------------------------ introspection
    @property
    def num_in_flight(self) -> int:
        """Items planned whose outcome has not been applied yet."""
        return len(self._in_flight)

    def is_offloaded(self, group_id: int, block_hash: bytes) -> bool:
        """True if the worker reported the store holds this block (and it is still remembered)."""
        return make_block_hash_with_group_id(block_hash, group_id) in self._offloaded


def _remember(keys: OrderedDict[BlockHashWithGroupId, None], key: BlockHashWithGroupId,
              max_keys: int) -> None:
    keys[key] = None
    keys.move_to_end(key)
    while len(keys) > max_keys:
        keys.popitem(last=False)
