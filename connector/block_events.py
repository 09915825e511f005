"""A step's block-pool events as the holder's ``BlockHashDelta`` (scheduler half -> worker half),
and the scheduler half's record of the batches it took (``PoolBatches``).

The worker half cannot read the scheduler half's block pool; it mirrors the prefix-cache identity
of its blocks from these deltas (``holder.HeldBlockHashes``), so a pull found through the block
index is served only while the block still holds the hash the requester expects.

A step's batch is taken inside the step (``build_connector_meta``), where only its delta is
needed; its events are read after the forward (the index's publish) or by ``take_events``. A pool
gives its batch as a list of events (kvbridge's own ``BlockPool``: ``EventBatch``) or as an object
with the same two methods whose events are built when first asked (the vLLM pool follower's
``vllm.pool_changes.StepBatch``), so that work stays out of the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .metadata import BlockHashDelta

__all__ = ["EventBatch", "PoolBatches", "hash_delta_of", "with_removals_of"]


def hash_delta_of(events: Iterable[Any]) -> BlockHashDelta:
    """The prefix-cache identity changes a step's block events describe. Every block that lost
    a hash this step is in ``removed`` (applied before the forward); a block whose last event is
    a store is in ``stored`` with that hash (applied after the forward), its group kept: the
    holder compares ``BlockHashWithGroupId`` values."""
    cleared = False
    removed: list[int] = []
    stored: dict[int, bytes] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            cleared, removed, stored = True, [], {}
        elif isinstance(event, BlockRemoved):
            removed.extend(event.block_ids)
            for block_id in event.block_ids:
                stored.pop(block_id, None)
        elif isinstance(event, BlockStored):
            suffix = make_block_hash_with_group_id(b"", event.group_id)  # once per event
            stored.update(zip(event.block_ids, [h + suffix for h in event.block_hashes],
                              strict=True))
    return BlockHashDelta(
        cleared=cleared,
        removed_block_ids=removed,
        stored_block_ids=list(stored),
        stored_hashes=list(stored.values()),
    )


def with_removals_of(events: list[Any], block_ids: Iterable[int]) -> list[Any]:
    """``events`` followed by a ``BlockRemoved`` per group for each of their stores that names
    one of ``block_ids`` (blocks whose KV a failed load left unwritten: vLLM caches a sync
    load's blocks when it allocates them, before the load). The stores stay: a removal after
    its store leaves the chain's later blocks reachable once the hash is stored again (the
    Redis index keeps a hole), where a store cut out would not. Returns ``events`` itself when
    nothing is removed; never changes it (``take_events`` and the offload planner read it)."""
    drop = set(block_ids)
    if not drop:
        return events
    removed: dict[int, tuple[list[bytes], list[int]]] = {}  # group id -> hashes, block ids
    for event in events:
        if isinstance(event, BlockStored) and not drop.isdisjoint(event.block_ids or ()):
            hashes, ids = removed.setdefault(event.group_id, ([], []))
            for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                if block_id in drop:
                    hashes.append(block_hash)
                    ids.append(block_id)
    if not removed:
        return events
    return [*events, *(BlockRemoved(block_hashes=hashes, medium=None, group_id=group_id,
                                    block_ids=ids) for group_id, (hashes, ids) in removed.items())]


class EventBatch:
    """One step's block events, given as a list: ``hash_delta()`` (``hash_delta_of``) and
    ``events()`` (the list itself)."""

    __slots__ = ("_events",)

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def __bool__(self) -> bool:
        return bool(self._events)

    def hash_delta(self) -> BlockHashDelta:
        return hash_delta_of(self._events)

    def events(self) -> list[Any]:
        return self._events


class PoolBatches:
    """The batches a scheduler half took from its block pool, until published and taken.

    Steps are numbered as they are taken (``num_steps``: the step id of the latest ``take``).
    A step's batch is published once a worker report names that step (or a later one): vLLM's
    async scheduling schedules step N + 1, hashing its new blocks, before step N's output
    comes back, and those blocks hold no KV until N + 1's forward has run. (A resync the index
    asks for meanwhile reads the pool's whole cached set, which may name them a step early;
    the holder's re-check turns a pull of one into a recompute of it.)

    Args:
        take: returns the pool's batch since the last call: a list of events, or an object
            with ``hash_delta()`` and ``events()`` (and a truth value: anything in it).
        settle: called after each step's publish, off the step (the pool's bookkeeping), or None.

    Owner: the engine thread (the scheduler half's); nothing here is shared.
    """

    def __init__(self, take: Callable[[], Any], settle: Callable[[], None] | None = None) -> None:
        self._take = take
        self._settle = settle
        self.num_steps = 0
        self._unpublished: deque[tuple[int, Any]] = deque()  # (step id, batch), in step order
        self._untaken: list[Any] = []

    def take(self, *, publish: bool) -> Any:
        """The step's batch (inside the step: nothing built but what the caller reads), kept
        for ``take_events`` and, with ``publish``, for ``unpublished_events``; None if empty.
        Numbers the step (``num_steps``), empty or not."""
        self.num_steps += 1
        batch = self._take()
        if not hasattr(batch, "hash_delta"):
            batch = EventBatch(list(batch))
        if not batch:
            return None
        self._untaken.append(batch)
        if publish:
            self._unpublished.append((self.num_steps, batch))
        return batch

    def unpublished_events(self, through: int | None = None) -> list[Any]:
        """The events of the batches taken for publishing whose step id is at most
        ``through`` (None: all of them), in step order; then the pool's ``settle``. Call it
        after a step's forward, with the id the step's worker reports name
        (``KVBridgeWorkerMeta.step_id``)."""
        unpublished, batches = self._unpublished, []
        while unpublished and (through is None or unpublished[0][0] <= through):
            batches.append(unpublished.popleft()[1])
        events = batches[0].events() if len(batches) == 1 else \
            [event for batch in batches for event in batch.events()]
        if self._settle is not None:
            self._settle()
        return events

    def take_events(self) -> list[Any]:
        """The events of every batch taken since the last call."""
        batches, self._untaken = self._untaken, []
        return [event for batch in batches for event in batch.events()]
