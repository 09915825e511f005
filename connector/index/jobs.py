"""The work items an ``IndexClient`` hands its ``IndexWorker``: publish batches and lookups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .lookup import LookupResult

__all__ = ["Batch", "LookupJob", "count_ops", "resync_batches"]


def count_ops(events: list[Any]) -> int:
    """The index ops ``events`` make: one per block hash of a ``BlockStored`` or
    ``BlockRemoved``, one for anything else (``AllBlocksCleared``)."""
    return sum(len(getattr(event, "block_hashes", None) or ()) or 1 for event in events)


class Batch(NamedTuple):
    events: list[Any]
    num_ops: int
    seq: int  # this incarnation's batch number (1, 2, ...)
    resync: bool = False  # the node's whole cached set


def resync_batches(events: list[Any], first_seq: int, max_ops: int) -> list[Batch]:
    """A node's whole cached set (``resync.ParentMirror.resync_events``: the clear first, then
    parents before children) as batches of at most ``max_ops`` ops (an event is never split),
    numbered from ``first_seq``: the first a resync (it clears), the rest deltas that extend
    it. One call for the whole set held the server that long: 16k blocks ran past a 0.25 s
    socket timeout, so the node saw the resync fail and sent it again, forever."""
    batches: list[Batch] = []
    chunk: list[Any] = []
    num_ops = 0
    for event in events:
        event_ops = count_ops([event])
        if chunk and num_ops + event_ops > max_ops:
            batches.append(Batch(chunk, num_ops, first_seq + len(batches), not batches))
            chunk, num_ops = [], 0
        chunk.append(event)
        num_ops += event_ops
    batches.append(Batch(chunk, num_ops, first_seq + len(batches), not batches))
    return batches


@dataclass(slots=True, eq=False)
class LookupJob:
    """One lookup handed to the worker. Every field but ``result`` is fixed at creation;
    ``result`` is written once (by the caller before the job is queued, or by the worker thread
    under the worker's lock) and read by the caller thread (one reference read)."""

    key: str
    block_hashes: tuple[bytes, ...]
    num_local_blocks: int
    min_gain_blocks: int
    deadline_s: float
    result: LookupResult | None = None
