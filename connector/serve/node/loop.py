"""``EngineLoop``: runs a synchronous ``Engine`` in one background thread for an asyncio server.

The engine is not thread-safe, so exactly one thread (the loop thread) touches it. HTTP handlers
call :meth:`EngineLoop.submit` from the event loop; the request is handed to the loop thread
through a queue, and every ``RequestOutput`` for it comes back on an ``asyncio.Queue`` owned by
the handler (``loop.call_soon_threadsafe``). A request the engine rejects (``ValueError`` from
``Engine.add_request``) comes back as a :class:`RequestRejected` item, so the handler answers 400
and the node keeps serving. A body the HTTP layer refuses before it reaches the engine may still
carry a pull ticket: :meth:`EngineLoop.release_remote` has the connector tell that prefill node
to release its blocks (from the loop thread, like every other engine call).

Per-request timings (seconds, ``time.monotonic``) are taken in the loop thread by watching each
request's status after every step: arrival, the first step in ``WAITING_FOR_REMOTE_KVS`` and the
first step out of it (the KV load as the scheduler sees it), and the first token.

The loop keeps stepping until the scheduler is empty (``Scheduler.is_empty``): while requests
are unfinished, and while finished or aborted requests still hold blocks (a prefill node's
``delay_free`` blocks wait for the decode node's pull; an aborted request's blocks wait for its
load in flight; the connector reports them from inside a step). Only an empty scheduler sleeps
on a condition variable. The scheduler figures in :class:`NodeCounters` (queues, KV usage) are
refreshed at start, after every step and after every abort, before the step's or abort's outputs
are delivered, so /metrics is current when the loop goes idle (a disconnected client's request
does not stay "running") and a client that got an output reads figures at least that recent.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbridge.kernels.device_binding import bound
from kvbridge.kvmanager import Engine, RequestOutput, RequestStatus, SamplingParams

__all__ = ["EngineLoop", "NodeCounters", "RequestRejected", "RequestTimings"]

logger = logging.getLogger("kvbridge.node")

_HELD_POLL_S = 0.002  # step period while only held blocks (or remote loads) are outstanding
_IDLE_WAIT_S = 0.5


@dataclass(slots=True)
class RequestTimings:
    """Monotonic timestamps of one request on this node (None: not reached)."""

    arrival_s: float
    load_start_s: float | None = None
    load_end_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        """Durations in seconds: ``queue_s`` (arrival to load start or first token),
        ``kv_load_s`` (time in WAITING_FOR_REMOTE_KVS), ``ttft_s``, ``e2e_s``."""

        def since(t: float | None, t0: float | None) -> float | None:
            return None if t is None or t0 is None else t - t0

        return {
            "queue_s": since(self.load_start_s or self.first_token_s, self.arrival_s),
            "kv_load_s": since(self.load_end_s, self.load_start_s),
            "after_load_to_first_token_s": since(self.first_token_s, self.load_end_s),
            "ttft_s": since(self.first_token_s, self.arrival_s),
            "e2e_s": since(self.finished_s, self.arrival_s),
        }


@dataclass(slots=True)
class RequestRejected:
    """The engine refused the request at the door (a caller mistake: answer 400)."""

    message: str


@dataclass
class NodeCounters:
    """Totals kept by the loop thread (read by /metrics under ``lock``).

    Token counts are prompt tokens; ``cached_tokens`` = local APC hit + external (pulled)
    tokens as reported by the scheduler at admission (``RequestOutput.num_cached_tokens``);
    ``local_hit_tokens`` / ``local_query_tokens`` come from the ``KVCacheManager``'s prefix
    cache stats. ``pd_*`` count requests that arrived with ``do_remote_prefill`` params.
    """

    requests_finished: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    pd_prompt_tokens: int = 0
    pd_cached_tokens: int = 0
    local_hit_tokens: int = 0
    local_query_tokens: int = 0
    kv_loads: int = 0
    kv_load_s_sum: float = 0.0
    steps: int = 0
    step_errors: int = 0
    scheduler: dict[str, float | int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            out = {k: v for k, v in vars(self).items() if k not in ("lock", "scheduler")}
            out.update(self.scheduler)
        return out


@dataclass(slots=True)
class _Pending:
    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict[str, Any] | None
    sink: Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Release:
    kv_transfer_params: dict[str, Any]
    reason: str


@dataclass(slots=True)
class _Live:
    sink: Callable[[Any], None]
    timings: RequestTimings
    remote_prefill: bool
    status: RequestStatus | None = None


class EngineLoop:
    """Owns ``engine`` and the thread that steps it.

    Args:
        engine: a built ``Engine``; after :meth:`start` only the loop thread touches it.

    Attributes:
        counters: totals for /metrics and /v1/stats.
        error: the exception that stopped the loop (``Engine.step`` raised), or None. A node whose
            loop died answers /health with 503.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.counters = NodeCounters()
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Pending | _Abort | _Release] = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._live: dict[str, _Live] = {}
        # the thread runs the model over the KV caches: bound to their device first
        kv_device = next(iter(engine.runner.kv_caches.values())).device
        self._thread = threading.Thread(
            target=bound(kv_device, self._run), name="engine-loop", daemon=True
        )
        self._refresh_counters()  # the thread has not started: this thread may read the engine

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None,
    ) -> asyncio.Queue:
        """Queue a request; returns the asyncio queue that receives, in order, one
        ``(RequestOutput, RequestTimings)`` per step that produced something for it (the last one
        has ``finished``), or a single :class:`RequestRejected`. Call from the event loop."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def sink(item: Any) -> None:
            loop.call_soon_threadsafe(out.put_nowait, item)

        self._inbox.put(_Pending(request_id, prompt, sampling_params, kv_transfer_params, sink))
        self._notify()
        return out

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away). Safe for unknown or finished ids."""
        self._inbox.put(_Abort(request_id))
        self._notify()

    def release_remote(self, kv_transfer_params: dict[str, Any], reason: str) -> None:
        """A request carrying a pull ticket was refused before it reached the engine (a
        malformed body): the connector's ``on_request_rejected`` sends the prefill node a
        release notice, so its blocks do not stay pinned until the lease expires. Best effort
        and safe for any mapping (the no-op connector does nothing); runs on the loop thread,
        in order with submitted requests."""
        self._inbox.put(_Release(kv_transfer_params, reason))
        self._notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and shut the engine (and its connector) down."""
        self._stop.set()
        self._notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            self.engine.shutdown()
        except Exception:  # shutting down: log, never raise
            logger.exception("engine shutdown failed")

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # ------------------------------------------------------------------ loop-thread side
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                scheduler = self.engine.scheduler
                if not scheduler.is_empty():
                    produced = self._step()
                    if not produced and not scheduler.running:
                        # Only loads in flight or blocks held for a peer: poll, do not spin.
                        time.sleep(_HELD_POLL_S)
                    continue
                with self._wake:
                    if self._inbox.empty() and not self._stop.is_set():
                        self._wake.wait(_IDLE_WAIT_S)
        except BaseException as exc:  # the loop is dead: fail everything still waiting
            logger.exception("engine loop stopped")
            self.error = exc
            for live in self._live.values():
                live.sink(RequestRejected(f"engine loop stopped: {exc!r}"))
            self._live.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Abort):
                self._abort(item.request_id)
                continue
            if isinstance(item, _Release):
                self._release_remote(item)
                continue
            timings = RequestTimings(arrival_s=time.monotonic())
            try:
                self.engine.add_request(
                    item.request_id, item.prompt, item.sampling_params, item.kv_transfer_params
                )
            except ValueError as exc:
                with self.counters.lock:
                    self.counters.requests_rejected += 1
                item.sink(RequestRejected(str(exc)))
                continue
            remote = bool(item.kv_transfer_params) and (
                item.kv_transfer_params.get("do_remote_prefill") is True
            )
            self._live[item.request_id] = _Live(item.sink, timings, remote)

    def _release_remote(self, item: _Release) -> None:
        try:
            self.engine.scheduler.connector.on_request_rejected(
                item.kv_transfer_params, item.reason
            )
        except Exception:  # best effort: the lease still expires; never stop the loop
            logger.exception("release notice for a refused pull ticket failed")

    def _abort(self, request_id: str) -> None:
        outputs = self.engine.abort_request([request_id])
        if outputs:
            self._refresh_counters()  # before delivering: a client that sees the abort sees it
        for output in outputs:
            self._deliver(output)

    def _step(self) -> bool:
        # A load that settled is admitted by the schedule() at the start of the next step, so a
        # request seen leaving WAITING_FOR_REMOTE_KVS after a step had its KV before that step
        # began (load_end = step start), and the step's duration is its first decode step.
        step_start = time.monotonic()
        outputs = self.engine.step()
        now = time.monotonic()
        requests = self.engine.scheduler.requests
        for request_id, live in self._live.items():
            request = requests.get(request_id)
            if request is None or request.status == live.status:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                live.timings.load_start_s = now
            elif live.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                live.timings.load_end_s = step_start
            live.status = request.status
        with self.counters.lock:
            self.counters.steps += 1
        self._refresh_counters()  # before delivering, as in _abort
        for output in outputs:
            self._deliver(output, now, step_start)
        return bool(outputs)

    def _deliver(
        self, output: RequestOutput, now: float | None = None, step_start: float | None = None
    ) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        now = time.monotonic() if now is None else now
        timings = live.timings
        if live.status == RequestStatus.WAITING_FOR_REMOTE_KVS and timings.load_end_s is None:
            timings.load_end_s = now if step_start is None else step_start
        if output.new_token_ids and timings.first_token_s is None:
            timings.first_token_s = now
        if output.finished:
            timings.finished_s = now
            del self._live[output.request_id]
            self._count_finished(output, live)
        live.sink((output, timings))

    def _count_finished(self, output: RequestOutput, live: _Live) -> None:
        c = self.counters
        num_prompt = len(output.prompt_token_ids)
        with c.lock:
            if output.finish_reason == "error":
                c.requests_failed += 1
            elif output.finish_reason == "abort":
                c.requests_aborted += 1
            else:
                c.requests_finished += 1
            c.prompt_tokens += num_prompt
            c.generation_tokens += len(output.token_ids)
            c.cached_tokens += output.num_cached_tokens
            if live.remote_prefill:
                c.pd_prompt_tokens += num_prompt
                c.pd_cached_tokens += output.num_cached_tokens
            load_s = live.timings.to_dict()["kv_load_s"]
            if load_s is not None:
                c.kv_loads += 1
                c.kv_load_s_sum += load_s

    def _refresh_counters(self) -> None:
        """Take the scheduler's figures now and add the prefix cache stats since the last call
        (``make_prefix_cache_stats`` resets them)."""
        stats = self.engine.kv_cache_manager.make_prefix_cache_stats()
        scheduler = self.engine.scheduler
        pool = self.engine.kv_cache_manager.block_pool
        scheduler_stats = {
            **scheduler.make_stats(),
            # The leak check of a run (connector/serve/demo/chaos.py): an idle node has an empty
            # scheduler and every usable block (all but the null block) on its free queue.
            "scheduler_empty": scheduler.is_empty(),
            "num_free_blocks": pool.get_num_free_blocks(),
            "num_usable_blocks": pool.num_gpu_blocks - 1,
        }
        with self.counters.lock:
            self.counters.scheduler = scheduler_stats
            if stats is not None:
                self.counters.local_hit_tokens += stats.hits + stats.preempted_hits
                self.counters.local_query_tokens += stats.queries + stats.preempted_queries
