"""The work items an ``IndexClient`` hands its ``IndexWorker``: publish batches and lookups."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .listed import ListedSet
from .lookup import LookupQuery, LookupResult, resolve_remote_prefixes
from .protocol import BlockIndex, Tier

__all__ = [
    "Batch", "DropLog", "LookupJob", "LookupSlots", "PublishQueue", "answer_lookups",
    "count_ops", "resolve_jobs", "resync_batches", "send_batches",
]

logger = logging.getLogger(__name__)


def count_ops(events: list[Any]) -> int:
    """The index ops ``events`` make: one per block hash of a ``BlockStored`` or
    ``BlockRemoved``, one for anything else (``AllBlocksCleared``)."""
    return sum(len(getattr(event, "block_hashes", None) or ()) or 1 for event in events)


class Batch(NamedTuple):
    events: list[Any]
    num_ops: int
    seq: int  # this incarnation's batch number (1, 2, ...)
    resync: bool = False  # clears the node's entries: the first batch of its whole cached set
    of_whole_set: bool = False  # a batch of that set (the first or one that extends it)


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
            batches.append(Batch(chunk, num_ops, first_seq + len(batches), not batches, True))
            chunk, num_ops = [], 0
        chunk.append(event)
        num_ops += event_ops
    batches.append(Batch(chunk, num_ops, first_seq + len(batches), not batches, True))
    return batches


class PublishQueue:
    """A node's publish batches waiting for its ``IndexWorker``, oldest first, numbered 1, 2,
    ... as queued (``protocol.py``). ``num_delta_ops`` counts the ops of the deltas, which the
    worker bounds; a resync's batches are not counted (what is queued behind them comes after
    the set they carry). ``retry``: the batches of a call that went unanswered, ahead of the
    rest (``put_back``). ``listed``: when set, every batch taken off the queue (sent or
    skipped) is followed there, in order (``listed.ListedSet``, by ``follow_taken``). Not
    thread-safe: the worker holds its lock around every use but ``follow_taken``."""

    def __init__(self) -> None:
        self.batches: deque[Batch] = deque()
        self.retry: list[Batch] = []
        self.held_since_s: float | None = None  # when ``retry``'s first try went unanswered
        self.num_delta_ops = 0
        self.num_whole_set_ops = 0  # of a resync's batches still queued (or in ``retry``)
        self.next_seq = 1
        self.whole_set_last_seq = 0  # the last batch number of the latest whole set queued
        self.listed: ListedSet | None = None
        self._num_losses = self._losses_at_whole_set = 0  # ``note_lost``; at the last set
        self._to_follow: list[tuple[Batch, int | None]] = []  # taken, not followed yet

    def follow(self, default_tier: Tier, block_size: int) -> None:
        """Follow the batches taken from now on in ``listed`` (a ``ListedSet(default_tier,
        block_size)``; nothing new if one is followed already); not exact if a batch was
        queued before."""
        if self.listed is None:
            self.listed = ListedSet(default_tier, block_size,
                                    base_losses=self._num_losses if self.next_seq == 1 else -1)

    def note_lost(self) -> None:
        """A batch was dropped before it was queued (a full queue): ``listed`` is not exact
        until a whole set queued from now on is followed."""
        self._num_losses += 1

    @property
    def listed_exact(self) -> bool:
        """``listed`` is followed, has followed every batch taken, and is exact."""
        return (self.listed is not None and not self._to_follow
                and self.listed.exact_at(self._num_losses))

    def append(self, events: list[Any], num_ops: int) -> None:
        """Queue one delta."""
        self.batches.append(Batch(events, num_ops, self.next_seq))
        self.next_seq += 1
        self.num_delta_ops += num_ops

    def put_back(self, batches: list[Batch], now_s: float, max_hold_s: float) -> bool:
        """Hold one call's ``batches``, which went unanswered, to be taken next as that same
        call: the backend answers ``"replayed"`` if the first try landed after all, where a
        call of other bounds would be a ``"gap"`` (``protocol.seq_verdict``). Returns False
        (nothing held: the batches are lost) ``max_hold_s`` after its first try went unanswered
        (a backend down, not slow; on a cluster one shard down would hold every call)."""
        if self.held_since_s is None:
            self.held_since_s = now_s
        elif now_s - self.held_since_s >= max_hold_s:
            return False
        self.retry = batches
        for batch in batches:
            self._count_out(batch, sign=-1)
        return True

    def replace_with_whole_set(self, events: list[Any], max_ops_per_call: int) -> int:
        """Queue a resync (``resync_batches``) in place of every queued batch (older than the
        set, which covers them); returns how many batches it replaced."""
        num_replaced = len(self.batches) + len(self.retry)
        self._losses_at_whole_set = self._num_losses
        self.retry = []
        self.batches = deque(resync_batches(events, self.next_seq, max_ops_per_call))
        self.next_seq += len(self.batches)
        self.whole_set_last_seq = self.next_seq - 1
        self.num_delta_ops = 0
        self.num_whole_set_ops = sum(batch.num_ops for batch in self.batches)
        return num_replaced

    def take(self, max_ops: int, *, skip_deltas: bool) -> tuple[list[Batch], int]:
        """Pop batches, oldest first, up to ``max_ops`` ops (at least one; a batch of a
        resync's set alone, so that its calls keep the size it was cut to); with
        ``skip_deltas`` the batches before a resync batch are popped and dropped first.
        Returns the batches and how many were dropped. A held ``retry`` goes first, as it is
        (dropped instead with ``skip_deltas`` unless it starts a resync)."""
        retry, self.retry = self.retry, []
        for batch in retry:
            self._count_out(batch)
        if retry and not (skip_deltas and not retry[0].resync):
            return retry, 0
        self.held_since_s = None  # a fresh call from here (a held one went, or is dropped)
        num_dropped = len(retry)
        while skip_deltas and self.batches and not self.batches[0].resync:
            self._count_out(self._pop())
            num_dropped += 1
        taken: list[Batch] = []
        num_ops = 0
        while self.batches and (not taken or (
            num_ops + self.batches[0].num_ops <= max_ops
            and not (taken[0].of_whole_set or self.batches[0].of_whole_set)
        )):
            taken.append(batch := self._pop())
            num_ops += batch.num_ops
            self._count_out(batch)
        return taken, num_dropped

    def _pop(self) -> Batch:
        """The oldest queued batch, to be followed in ``listed`` (``follow_taken``)."""
        batch = self.batches.popleft()
        if self.listed is not None:
            self._to_follow.append((batch, self._losses_at_whole_set if batch.resync else None))
        return batch

    @property
    def mark(self) -> tuple[int, int]:
        """Changes whenever a batch is queued or lost."""
        return self.next_seq, self._num_losses

    def follow_taken(self) -> None:
        """Follow the batches taken since the last call in ``listed``, in order. The worker
        thread alone (the one that takes batches), outside its lock."""
        to_follow, self._to_follow = self._to_follow, []
        for batch, whole_set_losses in to_follow:
            self.listed.follow(batch.events,  # type: ignore[union-attr]
                               whole_set_losses=whole_set_losses)

    def clear(self) -> int:
        """Drop every queued batch; returns their ops."""
        num_ops = self.num_delta_ops + self.num_whole_set_ops
        self.batches.clear()
        self.retry = []
        self.num_delta_ops = self.num_whole_set_ops = 0
        return num_ops

    def _count_out(self, batch: Batch, sign: int = 1) -> None:
        if batch.of_whole_set:
            self.num_whole_set_ops -= sign * batch.num_ops
        else:
            self.num_delta_ops -= sign * batch.num_ops


class DropLog:
    """Counts the publish batches a full queue drops (``IndexStats.publish_*_dropped_full``) and
    says so in two lines per run of drops: when it starts, and when the queue accepts again.
    The caller thread of ``IndexWorker.enqueue_publish`` alone calls ``note``."""

    def __init__(self, node_id: str, max_queued_ops: int) -> None:
        self.node_id = node_id
        self.max_queued_ops = max_queued_ops
        self.num_dropped_in_run = 0

    def note(self, accepted: bool, num_ops: int, stats: Any) -> None:
        """One batch of ``num_ops`` ops was queued (``accepted``) or dropped; ``stats`` is the
        backend's ``IndexStats`` (mutated)."""
        if not accepted:
            stats.publish_batches_dropped_full += 1
            stats.publish_ops_dropped_full += num_ops
            if self.num_dropped_in_run == 0:
                logger.warning("index: publish queue of %s full (%d ops); dropping batches until "
                               "it drains (the index misses them until a resync)",
                               self.node_id, self.max_queued_ops)
            self.num_dropped_in_run += 1
        elif self.num_dropped_in_run:
            logger.warning("index: publish queue of %s accepts again; %d batch(es) were dropped",
                           self.node_id, self.num_dropped_in_run)
            self.num_dropped_in_run = 0


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


_TIMED_OUT = LookupResult("timed_out")
_UNAVAILABLE = LookupResult("unavailable")


class LookupSlots:
    """The lookups handed to an ``IndexWorker``: ``queued`` until its thread takes them, then
    ``running`` until answered; at most ``max_in_flight`` of both together.

    Thread-safety: ``work`` and ``answered`` are conditions on the worker's lock. The caller
    thread's calls (``submit``, ``withdraw``, ``wait_for_answer``, ``num_in_flight``) take
    it; the worker holds it around every other use (``queued``, ``running``, ``start_all``,
    ``fail_queued``, ``closed``)."""

    def __init__(self, max_in_flight: int, work: threading.Condition,
                 answered: threading.Condition) -> None:
        self.max_in_flight = max_in_flight
        self.work, self.answered = work, answered
        self.queued: deque[LookupJob] = deque()
        self.running: list[LookupJob] = []
        self.closed = False  # the worker stops: a new job answers "unavailable" at once

    def __len__(self) -> int:  # in flight (a running job counts even once its caller gave up)
        return len(self.queued) + len(self.running)

    @property
    def num_in_flight(self) -> int:
        """Jobs queued or running."""
        with self.work:
            return len(self)

    def submit(self, job: LookupJob) -> bool:
        """Queue ``job`` and wake the worker; False (nothing queued) when ``max_in_flight``
        are in flight. Once ``closed``, ``job`` answers ``"unavailable"`` (True)."""
        with self.work:
            if self.closed:
                job.result = _UNAVAILABLE
                return True
            if len(self) >= self.max_in_flight:
                return False
            self.queued.append(job)
            self.work.notify()
        return True

    def wait_for_answer(self, jobs: Sequence[LookupJob], timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until one of ``jobs`` has a ``result``; True once one
        has (at once if one already had), False on timeout."""
        with self.answered:
            return self.answered.wait_for(
                lambda: any(job.result is not None for job in jobs), timeout_s)

    def withdraw(self, job: LookupJob) -> None:
        """Drop ``job`` if it is still queued (its slot is free at once); a running job
        finishes and its answer is ignored."""
        with self.work, contextlib.suppress(ValueError):
            self.queued.remove(job)

    def start_all(self) -> list[LookupJob]:
        """Every queued job, running from now until the worker empties ``running``."""
        self.running = list(self.queued)
        self.queued.clear()
        return self.running

    def fail_queued(self) -> None:
        """Answer every queued job ``"unavailable"`` (the worker stops) and drop them."""
        for job in self.queued:
            job.result = _UNAVAILABLE
        self.queued.clear()
        self.answered.notify_all()


def send_batches(
    batches: list[Batch],
    publish: Callable[[list[Batch], bool], bool],
    lose: Callable[[], None],
    node_id: str,
) -> int:
    """Publish ``batches`` as one call (``publish(batches, hold)``, True when the call is held
    to be made again); if one holds a bad event (``ValueError``), one call per batch, without
    holding, so that only it is lost (``lose()``: a resync follows). Returns how many are done
    (0: the call is held). The index worker's thread."""
    try:
        return 0 if publish(batches, True) else len(batches)
    except ValueError as exc:
        if len(batches) == 1:
            logger.error("index: publish batch of %s refused: %s", node_id, exc)
            lose()
            return 1
    except Exception:
        logger.exception("index: publish of %s failed", node_id)
        lose()
        return len(batches)
    for batch in batches:
        try:
            publish([batch], False)
        except Exception as exc:
            logger.error("index: publish batch of %s refused: %s", node_id, exc)
            lose()
    return len(batches)


def answer_lookups(
    jobs: list[LookupJob],
    now_s: float,
    answered: threading.Condition,
    ask: Callable[[list[LookupQuery], Callable[[int, LookupResult], None]], None],
) -> None:
    """Answer ``jobs`` together; the index worker's thread only. A job past its deadline
    answers ``"timed_out"`` unasked (its caller has given up); ``ask(queries, answer)`` makes
    the backend calls for the others (``lookup.resolve_remote_prefixes``) and calls
    ``answer(i, result)`` once per query as soon as it is known. Each ``result`` is written
    once, under ``answered``'s lock, and ``answered`` is notified (``IndexWorker
    .wait_for_answer``). If ``ask`` raises, the jobs it did not answer answer
    ``"unavailable"`` and the exception propagates."""
    live = [job for job in jobs if now_s < job.deadline_s]
    queries = [LookupQuery(job.block_hashes, job.num_local_blocks, job.min_gain_blocks)
               for job in live]

    def answer(i: int, result: LookupResult) -> None:
        with answered:
            live[i].result = result
            answered.notify_all()

    with answered:
        for job in jobs:
            if job.deadline_s <= now_s:
                job.result = _TIMED_OUT
    try:
        ask(queries, answer)
    except Exception:
        with answered:
            for job in live:
                job.result = job.result or _UNAVAILABLE
            answered.notify_all()
        raise


def resolve_jobs(jobs: list[LookupJob], now_s: float, answered: threading.Condition,
                 index: BlockIndex, directory: Any, *, node_id: str, group_ids: Sequence[int],
                 hit_rule: Any) -> None:
    """Answer ``jobs`` together, in one backend call (``answer_lookups``, asking through
    ``lookup.resolve_remote_prefixes``); a failure is logged, never raised. The index
    worker's thread only."""
    def ask(queries: list[LookupQuery], answer: Callable[[int, LookupResult], None]) -> None:
        resolve_remote_prefixes(index, directory, node_id=node_id, group_ids=group_ids,
                                queries=queries, answer=answer, hit_rule=hit_rule)

    try:
        answer_lookups(jobs, now_s, answered, ask)
    except Exception:
        logger.exception("index: %d lookup(s) of %s failed", len(jobs), node_id)
