"""What a node's publishes have told the index, followed by its index worker, so that a resync
needs no call from the engine thread.

A resync (``protocol.py``) publishes a node's whole cached set again, after a gap: Redis down or
restarted empty, a batch lost. The set used to come from the engine thread only
(``IndexClient.publish`` reads the pool at the engine's next step), so an engine that went idle
before Redis came back stayed unlisted until its next request, and other engines recomputed its
prefixes meanwhile. Every batch a node queues passes through its ``IndexWorker`` in order
(``jobs.PublishQueue.take``), so the worker can follow the same events and know, at any moment,
what the index says of the node once every batch taken so far has landed: ``ListedSet``, the
same entries the backend keeps (``in_memory.InMemoryBlockIndex.publish`` applies the ops the
same way; keyed here by the whole hash, there by its first ``key_hash_bytes``, which differ
only for two hashes sharing those bytes). That is the set a resync must send, unless a batch
never reached the worker (a full queue dropped it: the set is then inexact until the engine's
own resync is followed).

Cost: one dict write per stored block and one read (and delete) per removed one, on the worker
thread, off the scheduling step: a quarter of the CPU of the step's publish call itself
(``benchmarks/bench_publish.py``, ``follow_cpu_over_publish``); memory: one entry per block
the node has listed.

Owner: the index worker's thread (``jobs.PublishQueue.follow_taken``, outside the worker's lock:
a step's batch costs about a microsecond per block there, which the engine thread, taking that
lock to queue its next batch, must never wait for).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvbridge.kvmanager import CachedBlock

from .protocol import Tier, iter_event_ops
from .resync import resync_events

__all__ = ["ListedSet"]


class ListedSet:
    """``(group id, block hash) -> (block id, tier, parent hash)``: the node's index entries,
    from its events, read as the backend reads them (``protocol.iter_event_ops``: one
    definition of what an event does; the parent is ``b""`` for block 0 of a request, or
    unknown).

    Args:
        default_tier: the tier of an event without a medium (the node's ``tier``).
        block_size: tokens per block (the resync's ``BlockStored`` events say it).
        base_losses: see the attribute.

    Attributes:
        base_losses: how many batches the node had lost (dropped before they were queued,
            ``PublishQueue.note_lost``) when the last whole set followed was read; the set is
            exact while that is still the count (``exact_at``). -1: no whole set followed,
            and a batch went by unfollowed.
    """

    def __init__(self, default_tier: Tier, block_size: int, *, base_losses: int = 0) -> None:
        self.default_tier: Tier = default_tier
        self.block_size = block_size
        self.base_losses = base_losses
        self._consistent = True  # no event the backend would refuse since that set
        self._entries: dict[tuple[int, bytes], tuple[int, Tier, bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def exact_at(self, num_losses: int) -> bool:
        """Whether the set is what the index would say of the node, ``num_losses`` batches
        having been lost so far."""
        return self._consistent and self.base_losses == num_losses

    def follow(self, events: Iterable[Any], *, whole_set_losses: int | None = None) -> None:
        """Apply one batch's events, in order, as the backend applies their ops. A batch the
        backend would refuse (``protocol.events_to_ops`` raises) leaves the set inexact until
        the next whole set, as that batch is lost. ``whole_set_losses``: the batch starts a
        whole cached set (a resync), read when that many batches had been lost."""
        if whole_set_losses is not None:
            self.base_losses, self._consistent = whole_set_losses, True
        try:
            ops = list(iter_event_ops(events, self.default_tier))  # all or nothing, as there
        except Exception:
            self._consistent = False
            return
        entries = self._entries
        for kind, tier, group_id, block_hash, block_id, parent in ops:
            if kind == "S":
                entries[(group_id, block_hash)] = (block_id, tier, parent)
            elif kind == "R":
                held = entries.get((group_id, block_hash))
                if held is not None and held[1] == tier and block_id in (-1, held[0]):
                    del entries[(group_id, block_hash)]
            else:
                entries.clear()

    def resync_events(self) -> list[Any]:
        """The whole set as a resync batch (``resync.resync_events``: ``AllBlocksCleared``,
        then one ``BlockStored`` per entry, parents before children, each with its tier's name
        as medium, None for ``default_tier``), as the caller's resync would give it."""
        entries = self._entries
        cached = [CachedBlock(block_hash, group_id, entry[0])
                  for (group_id, block_hash), entry in entries.items()]
        parents = {block_hash: entry[2] or None for (_, block_hash), entry in entries.items()}

        def medium_of(block: CachedBlock) -> str | None:
            tier = entries[(block.group_id, block.block_hash)][1]
            return None if tier == self.default_tier else tier

        return resync_events(cached, parents.get, self.block_size, medium_of=medium_of,
                             max_chain=len(parents) + 1)
