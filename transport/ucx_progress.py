"""Active UCX progress while transfers are in flight ("booster"), on top of ucxx's blocking mode.

Why (docs/architecture.md, "Design measurements"): ucxx's ``"blocking"`` progress mode
progresses the worker only when the worker's epoll fd fires, plus a 1 s fallback. A message that
arrived before its receive was posted (an eager message or a rendezvous RTS sitting in a
shared-memory FIFO) does not always fire the fd again, so a small read from an otherwise busy
process took many times its usual time. ``"polling"`` fixes that but keeps a core busy idle.

So: blocking mode when idle, and while at least one read (requester side) or serve (holder side)
is in flight, one task per event loop calls ``worker.progress()`` and yields (``sleep(0)``) in a
loop ("spin"). A bulk serve holds it in "tick" mode instead (``hold(spin=False)``): progress, then
sleep ``TICK_S``. On a small host (``benchmarks/bench_transport.py``) the holder spinning
through a multi-chunk serve took the core that the requester's receive and scatter needed,
while relying on epoll wake-ups alone is not safe: a requester
without active progress stalled about half its bulk reads for the 1 s fallback (an event that did
not wake the fd). A tick bounds such a miss to ``TICK_S`` and costs no busy core.

In blocking mode each awaited ucxx request already spins the loop the same way
(``UCXRequest.wait_yield``), so the spinning booster adds no busy CPU that was not there; it
only makes each of those spins progress the worker. It stops when the last holder of it lets go,
so an idle process sleeps in ``epoll_wait``.

The booster is only used in the ``"blocking"`` mode: ``"polling"`` progresses on every loop turn
already, and in the ``"thread"`` modes only ucxx's progress thread may progress the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import Callable, Iterator

import ucxx

BOOSTED_PROGRESS_MODES = frozenset({"blocking"})
"""Progress modes in which the booster runs (see module docstring)."""


_MAX_ARM_TRIES = 16

TICK_S = 0.004
"""Period of progress in tick mode (seconds; one scheduler tick): bounds a missed epoll
wake-up without a busy core. Much shorter ticks cost as much as spinning on the paged read
above; this long costs nothing measurable (docs/architecture.md, "Design measurements")."""


class ProgressBooster:
    """Refcounted active progress on one event loop.

    ``hold()`` (a context manager) counts one in-flight transfer; while the count is above 0 a
    task calls ``progress_fn()`` and yields, so every turn of the loop progresses UCX; while only
    ``hold(spin=False)`` holds are active it progresses every ``TICK_S`` instead. ``kick()``
    progresses once now (after posting receives or issuing sends). A booster built with
    ``enabled=False`` does nothing (other progress modes).

    Args:
        progress_fn: progresses the UCX worker once (``ucxx.progress``); must not block.
        enabled: False makes every method a no-op.
    """

    def __init__(self, progress_fn: Callable[[], object], *, enabled: bool = True):
        self._progress_fn = progress_fn
        self.enabled = enabled
        self.num_holds = 0
        self.num_spin_holds = 0
        self._task: asyncio.Task[None] | None = None
        self._arm_fn: Callable[[], bool] | None = None

    def watch_events(self, epoll_fd: int, arm_fn: Callable[[], bool]) -> None:
        """Take over the loop's reader of the worker's epoll fd: on each event, progress and
        re-arm until ``arm_fn()`` (``UCXWorker.arm``: True when armed, False when events are
        pending) succeeds, so an idle worker sleeps and every new event wakes the loop.

        ucxx 0.52's ``BlockingMode`` arms once and never again after its first event; its fd
        then either stays readable (the loop spins on it: a busy core while idle) or misses
        events (a read waits for something else to wake the loop). Replacing its reader fixes
        both; its 1 s fallback task stays and is harmless.
        """
        if not self.enabled:
            return
        self._arm_fn = arm_fn
        loop = asyncio.get_running_loop()
        loop.remove_reader(epoll_fd)
        loop.add_reader(epoll_fd, self._on_event)
        self._on_event()

    def _on_event(self) -> None:
        arm = self._arm_fn
        assert arm is not None
        for _ in range(_MAX_ARM_TRIES):
            self._progress_fn()
            if arm():
                return
        asyncio.get_running_loop().call_soon(self._on_event)  # still busy: again next turn

    @contextlib.contextmanager
    def hold(self, *, spin: bool = True) -> Iterator[None]:
        """Keep the booster running for the body's duration (nests; refcounted). ``spin=False``
        (bulk transfers): progress every ``TICK_S`` unless a spinning hold is active too."""
        if not self.enabled:
            yield
            return
        self.num_holds += 1
        self.num_spin_holds += spin
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            yield
        finally:
            self.num_holds -= 1
            self.num_spin_holds -= spin

    def kick(self) -> None:
        """Progress the worker once now (a no-op when disabled)."""
        if self.enabled:
            self._progress_fn()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        progress = self._progress_fn
        while self.num_holds > 0:
            progress()
            if self.num_spin_holds == 0:
                await asyncio.sleep(TICK_S)
                continue
            # Both ends of a transfer spin while it is in flight; when they share a core (the
            # other one is busy), each spinner kept it until the scheduler tick, tripling a large
            # read's time. Yielding hands the core over at once.
            os.sched_yield()
            await asyncio.sleep(0)


_boosters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ProgressBooster] = (
    weakref.WeakKeyDictionary()
)


def booster_for_running_loop(progress_mode: str) -> ProgressBooster:
    """The running loop's booster (one per loop, shared by every transport on it), enabled when
    ``progress_mode`` is in ``BOOSTED_PROGRESS_MODES``."""
    loop = asyncio.get_running_loop()
    booster = _boosters.get(loop)
    if booster is None:
        booster = ProgressBooster(ucxx.progress, enabled=progress_mode in BOOSTED_PROGRESS_MODES)
        _boosters[loop] = booster
        worker = ucxx.core._get_ctx().worker
        booster.watch_events(worker.epoll_file_descriptor, worker.arm)
    return booster
