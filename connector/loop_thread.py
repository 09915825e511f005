"""One asyncio event loop per process, on a daemon thread, for the connector's network work.

The engine loop is synchronous; transports are asyncio. Every connector in a process submits its
coroutines to this one loop: UCX keeps one worker per process and loopback transports of several
nodes in one process must share a loop (their events and futures are loop-bound).

The loop thread gathers, scatters and sends KV blocks, so it is bound to the KV tensors' device
(``LoopThread.bind``, from ``register_kv_caches``; ``kvbridge.kernels.device_binding``): one
CUDA device per process, as in vLLM (one worker process per GPU).

Nothing on the loop may block it: a watchdog thread pings the loop every ``WATCH_S`` and, when a
ping has waited ``BLOCKED_S``, logs once where the loop thread is (its Python stack), and once
more when it runs again; a loop that runs, but answers pings later than ``SLOW_S``, is logged
at most once per ``SLOW_LOG_EVERY_S`` (how many pings were late, the latest delay).

That watchdog needs the GIL, so it cannot see a loop starved by a thread that holds the GIL in a
long C call (or a process left off the CPU): with ``KVBRIDGE_STALL_DUMP_S`` set (seconds), the
loop also keeps re-arming ``faulthandler``'s C-level timer, which dumps every thread's Python
stack to stderr when the loop has not re-armed it for that long (one timer per process: leave it
unset where something else uses ``faulthandler.dump_traceback_later``).
"""

from __future__ import annotations

import asyncio
import atexit
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from kvbridge.kernels.device_binding import bound, resolve_device

__all__ = ["LoopThread", "get_loop_thread"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

WATCH_S = 0.5
"""How often the watchdog pings the loop (seconds)."""
BLOCKED_S = 2.0
"""A ping waiting this long means the loop thread is blocked: its stack is logged."""
SLOW_S = 0.5
"""A ping answered this late (seconds) counts as a slow loop."""
SLOW_LOG_EVERY_S = 10.0
"""At most one "connector loop slow" line per this many seconds."""
STALL_DUMP_ENV = "KVBRIDGE_STALL_DUMP_S"
"""Environment variable: seconds without the loop running before every thread's stack is
dumped (``faulthandler``; module docstring). Unset, empty or 0: off."""


class LoopThread:
    """An event loop running forever on a daemon thread.

    Attributes:
        device: the CUDA device the thread is bound to (``bind``), or None (CPU work only).
    """

    def __init__(self, name: str = "kvbridge-connector-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.device: torch.device | None = None
        self._bind_lock = threading.Lock()
        self._dump_after_s = float(os.environ.get(STALL_DUMP_ENV) or 0)  # 0: no stall dump
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._pinged_at = 0.0  # monotonic time of the ping the loop has not run yet (0: none)
        self._ping_delay_s = 0.0  # how long the last answered ping waited for the loop
        threading.Thread(target=self._watch, name=f"kvbridge-watchdog-{name}", daemon=True).start()
        if self._dump_after_s > 0:
            atexit.register(faulthandler.cancel_dump_traceback_later)  # an exit is no stall
            self.loop.call_soon_threadsafe(self._arm_stall_dump, self._dump_after_s)

    def bind(self, device: torch.device | str) -> None:
        """Bind the loop thread to ``device`` (the KV tensors' device of a connector starting in
        this process; ``device_binding.bind_device``) before it touches them. Any thread but the
        loop's may call it; it returns once the loop thread is bound.

        Raises:
            ValueError: ``device`` is a CUDA device other than the one this loop is bound to
                already: one process serves one GPU (both devices are named).
        """
        resolved = resolve_device(device)
        with self._bind_lock:
            if resolved.type == "cuda" and self.device not in (None, resolved):
                raise ValueError(
                    f"the connector loop of this process is bound to {self.device}; KV tensors "
                    f"on {resolved} need a process of their own (one GPU per process)"
                )
            self.run(_call(bound(resolved, _nothing)))
            if resolved.type == "cuda":
                self.device = resolved

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            if self._dump_after_s > 0:
                faulthandler.cancel_dump_traceback_later()  # a stopped loop is not stalled

    def _watch(self) -> None:
        """The watchdog (module docstring); ends when the loop stops."""
        blocked_since = 0.0
        num_slow, slow_logged_at = 0, 0.0
        while not self.loop.is_running():  # (the loop thread is starting)
            time.sleep(0.01)
        while self.loop.is_running():
            pinged_at = self._pinged_at
            now = time.monotonic()
            if not pinged_at:
                if blocked_since:
                    logger.warning("connector loop ran again after %.1f s", now - blocked_since)
                    blocked_since = 0.0
                elif self._ping_delay_s > SLOW_S:
                    num_slow += 1
                    if now - slow_logged_at >= SLOW_LOG_EVERY_S:
                        logger.warning("connector loop slow: %d ping(s) answered later than "
                                       "%.1f s, the latest after %.2f s", num_slow, SLOW_S,
                                       self._ping_delay_s)
                        num_slow, slow_logged_at = 0, now
                self._ping_delay_s = 0.0
                self._pinged_at = now
                try:
                    self.loop.call_soon_threadsafe(self._pong)
                except RuntimeError:  # closed
                    return
            elif not blocked_since and now - pinged_at >= BLOCKED_S:
                blocked_since = pinged_at
                frame = sys._current_frames().get(self._thread.ident or 0)
                stack = "".join(traceback.format_stack(frame, limit=12)) if frame else "?"
                logger.warning("connector loop blocked for %.1f s, at:\n%s", now - pinged_at,
                               stack)
            time.sleep(WATCH_S)

    def _pong(self) -> None:
        self._ping_delay_s = time.monotonic() - self._pinged_at
        self._pinged_at = 0.0

    def _arm_stall_dump(self, after_s: float) -> None:
        """On the loop: push ``faulthandler``'s dump ``after_s`` into the future, again every
        ``WATCH_S`` (the C timer fires only if the loop stops doing this)."""
        faulthandler.dump_traceback_later(after_s, exit=False)
        self.loop.call_later(min(WATCH_S, after_s / 4), self._arm_stall_dump, after_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (never call from the loop thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop thread (deadlock)")
        return self.submit(coro).result(timeout_s)

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


def _nothing() -> None:
    return None


async def _call(fn: Any) -> None:
    fn()


_loop_thread: LoopThread | None = None
_lock = threading.Lock()


def get_loop_thread() -> LoopThread:
    """The process's connector loop, started on first use."""
    global _loop_thread
    with _lock:
        if _loop_thread is None:
            _loop_thread = LoopThread()
        return _loop_thread
