"""The one thread through which an ``IndexClient`` talks to the index backend.

DESIGN.md, "Two halves that share nothing": a scheduling step never waits on the network. The
engine thread hands ``IndexWorker`` work through two bounded queues and never waits on it; the
worker thread makes every backend call after ``start``: heartbeats (and registering again when
fenced), the node's publish batches in the order they were accepted, and remote-prefix lookups
(``lookup.resolve_remote_prefix``). One thread for all three keeps publishes ordered behind the
registration they need and gives each backend counter one writer.

Each loop turn: a heartbeat if one is due, then one lookup (latency first), then every queued
publish batch (up to ``_MAX_OPS_PER_SEND`` ops) in one backend call. Queue sizes count ops (one
per block hash of an event, ``protocol.events_to_ops``), which bound memory and send cost.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .lookup import LookupResult, resolve_remote_prefix
from .node_directory import NodeAddress, NodeDirectory
from .protocol import BlockIndex, Tier

__all__ = ["IndexWorker", "LookupJob", "count_ops"]

logger = logging.getLogger(__name__)

# Queued batches are merged into one publish call up to this many ops (one round trip; the
# backend applies a call's events in order, so a merged call equals the batches one by one).
_MAX_OPS_PER_SEND = 4096
_GRACE_S = 0.25  # close: how long the worker may finish its call before it is interrupted
_TIMED_OUT = LookupResult("timed_out")
_UNAVAILABLE = LookupResult("unavailable")


def count_ops(events: list[Any]) -> int:
    """The index ops ``events`` make: one per block hash of a ``BlockStored`` or
    ``BlockRemoved``, one for anything else (``AllBlocksCleared``)."""
    return sum(len(getattr(event, "block_hashes", None) or ()) or 1 for event in events)


class _Batch(NamedTuple):
    events: list[Any]
    num_ops: int


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


class IndexWorker:
    """Owns a node's backend calls on a daemon thread (``kvbridge-index-<node_id>``).

    Thread model (each piece of mutable state and its owner):

    - under ``_lock`` (held only for queue operations, never across a backend call): the lookup
      queue ``_lookups``, the running job ``_running``, the publish queue ``_batches`` and its
      op count, the accepted/done batch counts, ``_stopping`` and ``_abandoned``;
    - the worker thread alone: ``_next_heartbeat_s``, ``num_reregistrations`` (others read it),
      and every call to ``index`` and ``directory`` once ``start`` has started the thread
      (``start`` itself registers on the caller's thread, before the worker exists);
    - the caller thread (the engine thread, or whichever one thread drives the client): the
      queue-full drop counters in ``index.stats`` and ``_num_dropped_in_run``.

    ``interrupt`` of the backends is called from ``stop`` on the caller's thread; it only
    closes sockets.
    """

    def __init__(
        self,
        index: BlockIndex,
        directory: NodeDirectory,
        *,
        node_id: str,
        incarnation: int,
        group_ids: Sequence[int],
        ttl_s: float,
        tier: Tier,
        max_lookups_in_flight: int,
        max_queued_ops: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_lookups_in_flight < 1 or max_queued_ops < 1:
            raise ValueError(
                f"max_lookups_in_flight ({max_lookups_in_flight}) and max_queued_ops "
                f"({max_queued_ops}) must be at least 1"
            )
        self.index = index
        self.directory = directory
        self.node_id = node_id
        self.incarnation = incarnation
        self.group_ids = tuple(group_ids)
        self.ttl_s = ttl_s
        self.tier: Tier = tier
        self.max_lookups_in_flight = max_lookups_in_flight
        self.max_queued_ops = max_queued_ops
        self._clock = clock
        self._heartbeat_interval_s = ttl_s / 3
        self._address: NodeAddress | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the worker waits for work on it
        self._done = threading.Condition(self._lock)  # flush waits for sent batches on it
        self._lookups: deque[LookupJob] = deque()
        self._running: LookupJob | None = None
        self._batches: deque[_Batch] = deque()
        self._num_queued_ops = 0
        self._num_batches_accepted = 0
        self._num_batches_done = 0  # sent, fenced, dropped by the backend, or refused as bad
        self._stopping = False
        self._abandoned = False  # stop gave up waiting: make no further backend call
        self._thread: threading.Thread | None = None
        self._next_heartbeat_s = 0.0
        self._num_dropped_in_run = 0
        self.num_reregistrations = 0

    # ------------------------------------------------------------------ life (caller thread)
    def start(self, address: NodeAddress) -> None:
        """Register and announce ``address`` (blocking, bounded by the backend's timeouts),
        then start the thread. Work queued before this waits for it."""
        if self._thread is not None:
            raise ValueError(f"index worker of {self.node_id} started twice")
        self._address = address
        self._register()
        self._next_heartbeat_s = self._clock() + self._heartbeat_interval_s
        self._thread = threading.Thread(
            target=self._run, name=f"kvbridge-index-{self.node_id}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread: it finishes its current call (``_GRACE_S`` at most, then the
        backends are interrupted), withdraws the address, and exits. Queued work is dropped
        (lookups answer "unavailable"). Returns whether the thread ended within ``timeout_s``."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            self._done.notify_all()
        thread = self._thread
        if thread is None:
            return True
        deadline_s = self._clock() + timeout_s
        thread.join(min(_GRACE_S, timeout_s))
        while thread.is_alive() and self._clock() < deadline_s:
            with self._lock:
                self._abandoned = True
            self.index.interrupt()
            self.directory.interrupt()
            thread.join(0.05)
        if thread.is_alive():
            logger.warning("index: worker of %s still in a backend call; left behind", self.node_id)
            return False
        return True

    # ------------------------------------------------------------------ work (caller thread)
    @property
    def num_lookups_in_flight(self) -> int:
        """Lookups queued or running (a running one counts even once its caller gave up)."""
        with self._lock:
            return len(self._lookups) + (self._running is not None)

    def submit_lookup(self, job: LookupJob) -> bool:
        """Queue ``job``; False (nothing queued) when ``max_lookups_in_flight`` are in flight."""
        with self._lock:
            if self._stopping:
                job.result = _UNAVAILABLE
                return True
            if len(self._lookups) + (self._running is not None) >= self.max_lookups_in_flight:
                return False
            self._lookups.append(job)
            self._work.notify()
        return True

    def withdraw_lookup(self, job: LookupJob) -> None:
        """Forget ``job``: out of the queue if it has not started (its slot is free at once);
        a running job finishes and its answer is ignored."""
        with self._lock, contextlib.suppress(ValueError):  # ValueError: running, or answered
            self._lookups.remove(job)

    def enqueue_publish(self, events: list[Any]) -> bool:
        """Queue one batch; False (batch dropped, counted, logged) when the queue holds
        ``max_queued_ops`` ops already, or (not counted) once ``stop`` was called."""
        batch = _Batch(events, count_ops(events))
        with self._lock:
            if self._stopping:
                return False
            accepted = self._num_queued_ops < self.max_queued_ops
            if accepted:
                self._batches.append(batch)
                self._num_queued_ops += batch.num_ops
                self._num_batches_accepted += 1
                self._work.notify()
        stats = self.index.stats
        if not accepted:
            stats.publish_batches_dropped_full += 1
            stats.publish_ops_dropped_full += batch.num_ops
            if self._num_dropped_in_run == 0:
                logger.warning(
                    "index: publish queue of %s full (%d ops); dropping batches until it "
                    "drains (the index misses them until a resync)",
                    self.node_id,
                    self.max_queued_ops,
                )
            self._num_dropped_in_run += 1
        elif self._num_dropped_in_run:
            logger.warning(
                "index: publish queue of %s accepts again; %d batch(es) were dropped",
                self.node_id,
                self._num_dropped_in_run,
            )
            self._num_dropped_in_run = 0
        return accepted

    def flush(self, timeout_s: float) -> bool:
        """Wait until every batch accepted before this call has been handed to the backend
        (blocking: for tests and shutdown paths, never for a scheduling step). Returns False
        on timeout or when the worker stopped first."""
        with self._lock:
            target = self._num_batches_accepted
            return self._done.wait_for(
                lambda: self._num_batches_done >= target or self._stopping, timeout_s
            ) and self._num_batches_done >= target

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._lookups or self._batches):
                    wait_s = self._next_heartbeat_s - self._clock()
                    if wait_s <= 0:
                        break
                    self._work.wait(wait_s)
                if self._stopping:
                    break
                job = self._running = self._lookups.popleft() if self._lookups else None
                batches = self._take_batches()
            try:
                if self._clock() >= self._next_heartbeat_s:
                    self._heartbeat()
            except Exception:
                logger.exception("index: heartbeat of %s failed", self.node_id)
            if job is not None:
                result = self._resolve(job)
                with self._lock:
                    job.result = result
                    self._running = None
            if batches:
                self._send(batches)
                with self._lock:
                    self._num_batches_done += len(batches)
                    self._done.notify_all()
        self._shut_down()

    def _take_batches(self) -> list[list[Any]]:
        """Pop queued batches, oldest first, up to ``_MAX_OPS_PER_SEND`` ops (at least one
        batch). Called under ``_lock``."""
        batches: list[list[Any]] = []
        num_ops = 0
        while self._batches and (
            not batches or num_ops + self._batches[0].num_ops <= _MAX_OPS_PER_SEND
        ):
            batch = self._batches.popleft()
            batches.append(batch.events)
            num_ops += batch.num_ops
        self._num_queued_ops -= num_ops
        return batches

    def _resolve(self, job: LookupJob) -> LookupResult:
        if self._clock() >= job.deadline_s:
            return _TIMED_OUT  # its caller has given up (or will at its next poll)
        try:
            return resolve_remote_prefix(
                self.index,
                self.directory,
                node_id=self.node_id,
                group_ids=self.group_ids,
                block_hashes=job.block_hashes,
                num_local_blocks=job.num_local_blocks,
                min_gain_blocks=job.min_gain_blocks,
            )
        except Exception:
            logger.exception("index: lookup %r of %s failed", job.key, self.node_id)
            return _UNAVAILABLE

    def _send(self, batches: list[list[Any]]) -> None:
        """Publish the batches as one call; if one holds a bad event, one call per batch so
        that only the bad batch is lost."""
        try:
            self._publish([event for batch in batches for event in batch])
            return
        except ValueError as exc:
            if len(batches) == 1:
                logger.error("index: publish batch of %s refused: %s", self.node_id, exc)
                return
        except Exception:
            logger.exception("index: publish of %s failed", self.node_id)
            return
        for batch in batches:
            try:
                self._publish(batch)
            except Exception as exc:
                logger.error("index: publish batch of %s refused: %s", self.node_id, exc)

    def _publish(self, events: list[Any]) -> None:
        result = self.index.publish(self.node_id, self.incarnation, events, default_tier=self.tier)
        if result.status == "fenced":
            # Our registration lapsed (a long pause, or Redis lost its data): register again
            # and apply the batch once more; blocks stored before the lapse stay unlisted.
            logger.warning("index: publish of %s fenced; registering again", self.node_id)
            self.num_reregistrations += 1
            self._register()
            self.index.publish(self.node_id, self.incarnation, events, default_tier=self.tier)

    def _heartbeat(self) -> None:
        self._next_heartbeat_s = self._clock() + self._heartbeat_interval_s
        status = self.index.heartbeat(self.node_id, self.incarnation, ttl_s=self.ttl_s)
        if status == "fenced":
            # Expired (a long pause, or Redis restarted): register again, entries empty.
            self.num_reregistrations += 1
            self._register()
        elif status == "ok" and self._address is not None:
            self.directory.announce(self.node_id, self._address, ttl_s=self.ttl_s)

    def _register(self) -> None:
        status = self.index.register_node(self.node_id, self.incarnation, ttl_s=self.ttl_s)
        if status != "ok":
            logger.warning("index: register of %s answered %s", self.node_id, status)
        if self._address is not None:
            self.directory.announce(self.node_id, self._address, ttl_s=self.ttl_s)

    def _shut_down(self) -> None:
        with self._lock:
            num_ops = self._num_queued_ops
            self._batches.clear()
            self._num_queued_ops = 0
            for job in self._lookups:
                job.result = _UNAVAILABLE
            self._lookups.clear()
            abandoned = self._abandoned
        if num_ops:
            logger.info("index: %s closed with %d unpublished ops", self.node_id, num_ops)
        if not abandoned and self._address is not None:
            self.directory.withdraw(self.node_id)  # entries expire with the TTL
