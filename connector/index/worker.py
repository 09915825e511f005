"""The one thread through which an ``IndexClient`` talks to the index backend.

docs/architecture.md, "The two connector halves": a scheduling step never waits on the network. The
engine thread hands ``IndexWorker`` work through two bounded queues and never waits on it; the
worker thread makes every backend call after ``start``: heartbeats (and registering again when
fenced), the node's publish batches in the order they were accepted, and remote-prefix lookups.
One thread for all three keeps publishes ordered behind the registration they need and gives
each backend counter one writer.

Each loop turn: a heartbeat if one is due, then every queued lookup (latency first) in one
index call (``lookup.resolve_remote_prefixes``: the lookups an engine step started cost one round
trip), then every queued publish batch (up to ``_MAX_OPS_PER_SEND`` ops) in one backend call.
Queue sizes count ops (one per block hash of an event, ``protocol.events_to_ops``), which bound
memory and send cost.

How batches stay true (docs/architecture.md, "Keeping the index true"): they are numbered
(``protocol.py``); an unanswered call is held and made again, the same call, for up to
``_MAX_HOLD_S``; a batch that may be lost starts resync mode, which ends once the node's whole
cached set has landed. That set is the caller's (``resync_wanted``, ``enqueue_resync``: read
at the engine's next step) or, when the caller has not given it ``_IDLE_RESYNC_S`` after it
was asked (an idle engine), the worker's own, from the batches it took
(``listed.ListedSet``), unless a full queue dropped one. Parts a backend parked (a cluster
bucket down) go again every ``_RESYNC_PROBE_S``. No recovery needs an engine step."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .jobs import Batch, DropLog, LookupSlots, PublishQueue, count_ops, resolve_jobs, send_batches
from .node_directory import NodeAddress, NodeDirectory
from .protocol import BlockIndex, Tier

if TYPE_CHECKING:
    from kvbridge.kvmanager import PrefixHitRule

__all__ = ["IndexWorker"]

logger = logging.getLogger(__name__)

_MAX_OPS_PER_SEND = 4096  # queued batches merged into one call (applied in order: one by one)
# A resync's calls: a quarter of a full call, far below a socket timeout (a whole set in one
# call ran past it and was sent again forever: docs/architecture.md, "Design measurements").
_MAX_OPS_PER_RESYNC_CALL = 1024
_GRACE_S = 0.25  # close: how long the worker may finish its call before it is interrupted
_RESYNC_PROBE_S = 0.05  # resync mode, a held call: how often the backend is probed till it answers
_REGISTER_RETRY_S = 0.25  # an unanswered registration: how often it is tried again
_MAX_HOLD_S = 3.0  # an unanswered call: made again until its first try is this old, then lost
_IDLE_RESYNC_S = 1.0  # a resync the caller has not queued this long after it was asked


class IndexWorker:
    """Owns a node's backend calls on a daemon thread (``kvbridge-index-<node_id>``).

    Thread model (each piece of mutable state and its owner):

    - under ``_lock`` (held only for queue operations, never across a backend call): the
      lookups ``lookups`` (queued and running; the caller's calls lock themselves,
      ``jobs.LookupSlots``), the publish queue ``_queue`` (its listed set: the worker thread's
      alone, ``follow_taken``), the accepted/done batch counts, ``_needs_resync``, the loss
      counts, ``_resync_wanted`` and ``_resync_wanted_at_s``,
      ``_registered`` (the worker writes it), ``_stopping`` and ``_abandoned``;
    - the worker thread alone: ``_next_heartbeat_s``, ``_probe_ok``, ``num_reregistrations``,
      and every call to ``index`` and ``directory`` once ``start`` has started the thread
      (``start`` itself registers on the caller's thread, before the worker exists);
    - the caller thread (the engine thread, or whichever one thread drives the client): the
      queue-full drop counters in ``index.stats`` and ``_drops``.

    ``stop`` calls the backends' ``interrupt`` (which only closes sockets) on the caller's thread.
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
        hit_rule: PrefixHitRule | None = None,
    ) -> None:
        if max_lookups_in_flight < 1 or max_queued_ops < 1:
            raise ValueError(f"max_lookups_in_flight ({max_lookups_in_flight}) and "
                             f"max_queued_ops ({max_queued_ops}) must be at least 1")
        self.index = index
        self.directory = directory
        self.node_id = node_id
        self.incarnation = incarnation
        self.group_ids = tuple(group_ids)
        self.ttl_s = ttl_s
        self.tier: Tier = tier
        self.max_queued_ops = max_queued_ops
        self._clock = clock
        self._heartbeat_interval_s = ttl_s / 3
        self._address: NodeAddress | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the worker waits for work on it
        self._done = threading.Condition(self._lock)  # flush waits for sent batches on it
        self.lookups = LookupSlots(max_lookups_in_flight, self._work,  # (the caller's calls)
                                   threading.Condition(self._lock))
        self._queue = PublishQueue()
        self._whole_set_in_call = False  # the worker is sending a batch of a resync's set
        self._num_batches_accepted = 0
        self._num_batches_done = 0  # sent, fenced, dropped by the backend, or refused as bad
        self._stopping = self._abandoned = False  # abandoned: stop gave up waiting: no more calls
        self._thread: threading.Thread | None = None
        self._next_heartbeat_s = self._last_probe_s = self._next_announce_s = 0.0
        self._last_parked_try_s = 0.0  # ``_send_parked``
        self._probe_ok = True  # the last heartbeat was answered (a held call waits for one)
        self._registered = False  # the backend answered our registration: batches may go
        self._drops = DropLog(node_id, max_queued_ops)
        self.num_reregistrations = 0
        self.hit_rule = hit_rule
        self.can_resync = False  # ``enable_resync``: batches are numbered
        self._needs_resync = False  # a batch may be lost: send no delta until a resync lands
        self._num_losses = self._losses_at_resync = 0  # _enter_resync_mode calls; at the last
        # enqueue_resync: a batch lost after its snapshot is not in it, so resync mode outlives it
        self._resync_wanted = False  # the backend answers again: the caller should resync
        self._resync_wanted_at_s = 0.0  # since when (``_IDLE_RESYNC_S``)
        self.num_resyncs_sent = self.num_batches_skipped = 0  # worker thread; others read them

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
            self._stopping = self.lookups.closed = True
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
    def enable_resync(self) -> None:
        """Number the batches from now on (``can_resync``) and follow them (``listed``: exact
        if none was queued before, else once the caller's first resync is taken)."""
        with self._lock:
            self.can_resync = True
            self._queue.follow(self.tier, self.index.namespace.block_size)

    @property
    def resync_wanted(self) -> bool:
        """True while the worker waits for the caller's ``enqueue_resync`` (one lock-free read)."""
        return self._resync_wanted

    needs_resync = property(lambda self: self._needs_resync or self._resync_unsent or (
        0 < self.index.parked_parts(self.node_id).oldest_seq <= self._queue.whole_set_last_seq),
        doc="A batch may be lost, or a resync's set has not all landed (queued, sent, parked).")

    @property
    def _resync_unsent(self) -> bool:  # a batch of a resync's set is queued or in a call (one
        # parked does not count: a loss after its set was taken needs a new set, which drops it)
        return self._queue.num_whole_set_ops > 0 or self._whole_set_in_call

    def enqueue_resync(self, events: list[Any]) -> None:
        """Queue the node's whole cached set (``resync.ParentMirror.resync_events``; sent in
        calls of ``_MAX_OPS_PER_RESYNC_CALL`` ops, ``jobs.resync_batches``) in place of every
        batch still queued (they are older than the set, which covers them)."""
        with self._lock:
            self._queue_whole_set(events)

    def _queue_whole_set(self, events: list[Any]) -> None:
        """``enqueue_resync``'s work, under ``_lock``."""
        if self._stopping:
            return
        self._num_batches_done += self._queue.replace_with_whole_set(
            events, _MAX_OPS_PER_RESYNC_CALL)
        self._num_batches_accepted += len(self._queue.batches)
        self._losses_at_resync = self._num_losses
        self._resync_wanted = False
        self._work.notify()
        self._done.notify_all()

    def _want_resync(self) -> None:  # under ``_lock``; asked again: the first ask's time
        if not self._resync_wanted:
            self._resync_wanted, self._resync_wanted_at_s = True, self._clock()

    def _resync_if_idle(self) -> None:
        """The resync an idle caller owes (``_idle_resync_at_s``), from the listed set, read
        off the lock (a second per 50k blocks on a busy host), then queued unless a batch was
        queued or lost meanwhile (the caller woke: it gives its own, or the next turn tries
        again). Worker thread, after ``follow_taken``."""
        with self._lock:
            if self._clock() < self._idle_resync_at_s():
                return
            mark = self._queue.mark
        events = self._queue.listed.resync_events()  # type: ignore[union-attr]
        with self._lock:
            if mark == self._queue.mark and self._resync_wanted:
                logger.info("index: %s resyncs from its index thread", self.node_id)
                self._queue_whole_set(events)

    def _idle_resync_at_s(self) -> float:
        """Under ``_lock``: when the worker makes the resync the caller owes from the listed
        set (infinity: none owed, a batch still queued, or the set misses a dropped batch)."""
        due = self._resync_wanted and not self._queue.batches and self._queue.listed_exact
        return self._resync_wanted_at_s + _IDLE_RESYNC_S if due else float("inf")

    def enqueue_publish(self, events: list[Any]) -> bool:
        """Queue one batch; False (batch dropped, counted, logged; the worker resyncs) when the
        queue holds ``max_queued_ops`` ops already, or (not counted) once ``stop`` was called."""
        num_ops = count_ops(events)
        with self._lock:
            if self._stopping:
                return False
            accepted = self._queue.num_delta_ops < self.max_queued_ops
            if accepted:
                self._queue.append(events, num_ops)
                self._num_batches_accepted += 1
                self._work.notify()
            else:
                self._queue.note_lost()
                self._enter_resync_mode()
                if self.can_resync and self.index.available and not self._resync_unsent:
                    self._want_resync()  # a full queue, not a lost backend: no probe
        self._drops.note(accepted, num_ops, self.index.stats)
        return accepted

    def flush(self, timeout_s: float) -> bool:
        """Wait until every batch accepted before this call has been handed to the backend, and
        any part of one it parked has been sent again once (blocking: for tests and shutdown
        paths, never for a scheduling step). Returns False on timeout, when the worker stopped
        first, or at once while its registration goes unanswered (the batches wait queued)."""
        with self._lock:
            target = self._num_batches_accepted
            landed = lambda: self._num_batches_done >= target and not (  # noqa: E731
                self.index.parked_parts(self.node_id).unretried)  # (parked: once sent again)
            done = self._done.wait_for(lambda: landed() or self._stopping or not self._registered,
                                       timeout_s)
            return done and landed()

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self.lookups.queued or self._can_send()):
                    if (not self._registered or self._queue.retry
                            or (self._needs_resync and not self._resync_wanted)):
                        probe_s = _RESYNC_PROBE_S if self._registered else _REGISTER_RETRY_S
                        self._next_heartbeat_s = min(self._next_heartbeat_s,
                                                     self._last_probe_s + probe_s)
                    wait_s = min(self._next_heartbeat_s, self._idle_resync_at_s(),
                                 self._parked_try_at_s()) - self._clock()
                    if wait_s <= 0:
                        break
                    self._work.wait(wait_s)
                if self._stopping:
                    break
                jobs = self.lookups.start_all()
                batches = self._take_batches() if self._can_send() else []
            self._queue.follow_taken()  # (off the lock: the engine thread may queue meanwhile)
            self._resync_if_idle()
            try:
                if self._clock() >= self._next_heartbeat_s:
                    self._heartbeat() if self._registered else self._register_again()
                if self._clock() >= self._parked_try_at_s():
                    self._send_parked()
            except Exception:
                logger.exception("index: heartbeat of %s failed", self.node_id)
            if jobs:  # answered together, in one backend call
                resolve_jobs(jobs, self._clock(), self.lookups.answered, self.index, self.directory,
                             node_id=self.node_id, group_ids=self.group_ids, hit_rule=self.hit_rule)
                with self._lock:
                    self.lookups.running = []
            if batches:
                num_done = send_batches(batches, self._publish, self._lose, self.node_id)
                with self._lock:
                    self._whole_set_in_call = False
                    self._num_batches_done += num_done
                    self._done.notify_all()
        self._shut_down()

    def _enter_resync_mode(self, warn: bool = True) -> None:
        """A batch may be lost (a WARNING says so, with ``warn``). Called under ``_lock``.
        Without ``can_resync`` (no source of the cached set) the index just misses that batch."""
        if not self.can_resync:
            return
        self._num_losses += 1
        if warn and not self._needs_resync and self.index.available:  # (a backend that does
            # not answer has said so in one line of its own, and that it resyncs once back)
            logger.warning(
                "index: a publish batch of %s may be lost; resyncing its whole cached set once "
                "the backend answers", self.node_id,
            )
        self._needs_resync = True
        self._resync_wanted = False
        self._last_probe_s = self._clock()
        self._work.notify()

    def _can_send(self) -> bool:  # under ``_lock``; a held call waits for an answered probe
        if self._queue.retry:  # (one held too long is made once more: then it is lost)
            now = self._clock()
            return self._registered and now >= self._last_probe_s + _RESYNC_PROBE_S and (
                self._probe_ok or now >= self._queue.held_since_s + _MAX_HOLD_S)
        return self._registered and bool(self._queue.batches)

    def _take_batches(self) -> list[Batch]:
        """The next call's batches (``PublishQueue.take``, up to ``_MAX_OPS_PER_SEND`` ops); in
        resync mode the deltas before a resync batch are dropped (the set it carries covers
        them). Called under ``_lock``."""
        self._whole_set_in_call = self._queue.num_whole_set_ops > 0  # before the pop: lock-free
        # readers of ``needs_resync`` never see a set neither queued nor in a call
        batches, num_dropped = self._queue.take(_MAX_OPS_PER_SEND, skip_deltas=self._needs_resync)
        self._whole_set_in_call = bool(batches) and batches[0].of_whole_set
        if num_dropped:
            self._num_batches_done += num_dropped
            self.num_batches_skipped += num_dropped
            self._done.notify_all()
        return batches

    def _lose(self) -> None:  # a batch may be lost (``jobs.send_batches``)
        with self._lock:
            self._enter_resync_mode()

    def _publish(self, batches: list[Batch], hold: bool = True) -> bool:  # True: held
        events = [event for batch in batches for event in batch.events]
        resync = batches[0].resync
        if self._needs_resync and not resync:
            return False  # deltas queued before resync mode began, taken in the same turn
        result = self.index.publish(
            self.node_id,
            self.incarnation,
            events,
            default_tier=self.tier,
            seq=(batches[0].seq, batches[-1].seq) if self.can_resync else None,
            resync=resync,
        )
        status = result.status
        if status == "fenced":
            # Our registration lapsed (a long pause, or Redis lost its data): register again;
            # the entries went with it, so the whole cached set is published again.
            logger.warning("index: publish of %s fenced; registering again", self.node_id)
            self.num_reregistrations += 1
            self._register()
        if status in ("ok", "replayed"):
            if resync:
                self.num_resyncs_sent += 1
                with self._lock:
                    self._needs_resync = self._num_losses != self._losses_at_resync
            return False
        with self._lock:
            if (status == "unavailable" and hold and self.can_resync and not self._stopping
                    and self._queue.put_back(batches, self._clock(), _MAX_HOLD_S)):
                self._last_probe_s = self._clock()  # numbered: a second landing is "replayed"
                self._probe_ok = False
                return True
            self._enter_resync_mode()  # fenced, gap: this batch or an earlier one is lost
        return False

    def _heartbeat(self) -> None:
        now = self._clock()
        self._next_heartbeat_s = now + self._heartbeat_interval_s
        self._last_probe_s = now
        status = self.index.heartbeat(self.node_id, self.incarnation, ttl_s=self.ttl_s)
        answered_before, self._probe_ok = self._probe_ok, status != "unavailable"
        if status == "fenced":
            self._fenced(warn=answered_before)
            return
        if self._address is not None and now >= self._next_announce_s:  # also when a shard
            # is down (the live ones serve the address); not at every resync probe
            self._next_announce_s = now + self._heartbeat_interval_s
            self.directory.announce(self.node_id, self._address, ttl_s=self.ttl_s)
        with self._lock:  # ("unavailable": a publish meanwhile is held and made again)
            if status == "ok" and self._needs_resync and not self._resync_unsent:
                self._want_resync()  # (not while a set is under way: it may land)

    def _fenced(self, warn: bool) -> None:
        """Expired (a long pause, Redis restarted), or a parked part refused: register, resync."""
        self.num_reregistrations += 1
        with self._lock:  # (first: no reader sees a resync landed meanwhile)
            self._enter_resync_mode(warn=warn)
        if self._register():
            with self._lock:
                self._want_resync()

    def _send_parked(self) -> None:
        """Parts of calls the backend parked (a bucket's shard down: ``redis_cluster.py``)."""
        self._last_parked_try_s = self._clock()
        if self.index.send_parked(self.node_id, self.incarnation) == "fenced":
            self._fenced(warn=True)
        with self._lock:
            self._done.notify_all()  # flush waits for each part's second call

    def _parked_try_at_s(self) -> float:  # infinity: the backend holds none of ours
        parked = self.index.parked_parts(self.node_id).parts
        return self._last_parked_try_s + _RESYNC_PROBE_S if parked else float("inf")

    def _register_again(self) -> None:
        """An unanswered registration (at ``start``, after a fence), tried every
        ``_REGISTER_RETRY_S``; batches wait queued, then go as they are (no resync: see above)."""
        self._last_probe_s = now = self._clock()
        self._next_heartbeat_s = now + self._heartbeat_interval_s
        self._register()

    def _register(self) -> bool:  # True: registered
        status = self.index.register_node(self.node_id, self.incarnation, ttl_s=self.ttl_s)
        with self._lock:  # ("unavailable": the backend said so, once)
            self._registered = status != "unavailable"
            self._done.notify_all()  # flush waits for no held batch
        if status == "fenced":
            logger.warning("index: register of %s answered %s", self.node_id, status)
        if self._address is not None and status == "ok":  # (never a fenced incarnation's)
            self.directory.announce(self.node_id, self._address, ttl_s=self.ttl_s)
        return status == "ok"

    def _shut_down(self) -> None:
        with self._lock:
            num_ops = self._queue.clear()
            self.lookups.fail_queued()
            abandoned = self._abandoned
        if num_ops:
            logger.info("index: %s closed with %d unpublished ops", self.node_id, num_ops)
        if not abandoned and self._address is not None:
            self.directory.withdraw(self.node_id)  # entries expire with the TTL
