"""What a ``RedisClusterBlockIndex`` keeps per node while publishing: each bucket's batch
numbers, the parts of publish calls a bucket left unanswered (parked, to be sent again in
order), the buckets whose parked parts overflowed (``lost``: the node resyncs once they answer)
and the buckets its registration did not reach (``redis_cluster.py``, module docstring).
Guarded by the index's publish lock; the node's parts are sent by one thread at a time (its
index worker's), which ``RedisClusterBlockIndex._send_parked`` relies on."""

from __future__ import annotations

import itertools
from collections import deque

from .redis_direct import PackedArgs

__all__ = [
    "MAX_PARKED_OPS", "PARKED_CALLS_PER_TURN", "PARKED_OPS_PER_CALL", "NodeSeqs", "ParkedPart",
    "next_call", "packed_call",
]

MAX_PARKED_OPS = 65_536
"""Ops a node may have parked; past it the parked buckets are dropped to ``lost``. As many as
an ``IndexClient`` queues (``max_queued_ops``)."""
PARKED_CALLS_PER_TURN = 16  # a bucket's calls per ``_send_parked`` (the worker's other work waits)
PARKED_OPS_PER_CALL = 4096  # untried parked parts sent together, up to this many ops


class ParkedPart:
    """A bucket's part of a publish, parked until its bucket answers, sent again as it was."""

    __slots__ = ("node_seq", "num_ops", "number", "packed", "resync", "tries")

    def __init__(self, number: int, packed: PackedArgs, num_ops: int, resync: bool,
                 node_seq: int) -> None:
        self.number = number  # the bucket's batch number (0: unnumbered)
        self.packed = packed  # its ops as ``PUBLISH`` arguments (``redis_publish.pack_ops``)
        self.num_ops = num_ops
        self.resync = resync  # the first call of a resync (no gap check)
        self.node_seq = node_seq  # the node's batch number of the call (0: unnumbered)
        self.tries = 0  # calls made with it (a backed-off bucket's turn is not one)


class NodeSeqs:
    """Per node: its incarnation, the next batch number of each bucket, the last batch number
    sent, each down bucket's parked parts, oldest first (``parked``; ``num_parked_ops`` and
    ``num_parked_parts`` in all), the buckets whose parts overflowed (``lost``), and the buckets
    its last registration did not reach (``unregistered``, with the ``ttl_s`` it asked for).
    Numbers are never reset within an incarnation (a bucket that lost its data then sees a gap
    and the node resyncs)."""

    def __init__(self, incarnation: int, num_buckets: int) -> None:
        self.incarnation = incarnation
        self.next = [1] * num_buckets
        self.last_batch = 0
        self.parked: dict[int, deque[ParkedPart]] = {}
        self.num_parked_ops = self.num_parked_parts = 0
        self.lost: set[int] = set()
        self.unregistered: set[int] = set()
        self.ttl_s = 0.0

    def park(self, bucket: int, part: ParkedPart) -> None:
        self.parked.setdefault(bucket, deque()).append(part)
        self.num_parked_ops += part.num_ops
        self.num_parked_parts += 1

    def unpark(self, bucket: int, parts: list[ParkedPart]) -> None:
        """``parts`` (the oldest of ``bucket``'s, in order) have landed."""
        queue = self.parked.get(bucket)
        for part in parts:
            if not queue or queue[0] is not part:
                return  # (dropped meanwhile)
            queue.popleft()
            self.num_parked_ops -= part.num_ops
            self.num_parked_parts -= 1
        if not queue:
            self.parked.pop(bucket, None)

    def drop_parked(self, *, lose: bool = False) -> int:
        """Forget every parked part (with ``lose``: their buckets are ``lost``); returns their
        ops."""
        if lose:
            self.lost.update(bucket for bucket, parts in self.parked.items() if parts)
        num_ops, self.num_parked_ops, self.num_parked_parts = self.num_parked_ops, 0, 0
        self.parked.clear()
        return num_ops


def next_call(parts: deque[ParkedPart] | None) -> list[ParkedPart]:
    """The parts of a bucket's next call: its oldest alone if it was tried (it may have run, and
    "replayed" must answer for it alone), else it and the untried parts behind it (their
    numbers are consecutive), up to ``PARKED_OPS_PER_CALL`` ops, not past a resync's first
    part. Under the publish lock."""
    if not parts:
        return []
    batch, num_ops = [parts[0]], parts[0].num_ops
    if parts[0].tries:
        return batch
    for part in itertools.islice(parts, 1, None):
        if part.resync or num_ops + part.num_ops > PARKED_OPS_PER_CALL:
            break
        batch.append(part)
        num_ops += part.num_ops
    return batch


def packed_call(batch: list[ParkedPart]) -> PackedArgs:
    """``batch``'s ops as one call's arguments, in order."""
    if len(batch) == 1:
        return batch[0].packed
    return PackedArgs(b"".join(part.packed.resp for part in batch),
                      sum(part.packed.count for part in batch))
