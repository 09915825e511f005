"""Progress booster modes and the transport's copy threads (``transport.ucx_progress``,
``transport.staging``). No UCX needed: the booster is driven with a counting progress function."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvbridge.transport import staging
from kvbridge.transport.ucx_progress import ProgressBooster


class _CountingProgress:
    def __init__(self) -> None:
        self.num_calls = 0

    def __call__(self) -> None:
        self.num_calls += 1


def _booster() -> tuple[ProgressBooster, _CountingProgress]:
    progress = _CountingProgress()
    return ProgressBooster(progress, enabled=True), progress


async def _turns(num_turns: int) -> None:
    for _ in range(num_turns):
        await asyncio.sleep(0)


async def test_spin_hold_progresses_every_loop_turn():
    booster, progress = _booster()
    with booster.hold():
        await _turns(20)
        # the booster task progresses once per loop turn; its first turn starts one turn late
        assert progress.num_calls >= 19
    await _turns(2)
    assert not booster.running  # no hold left: the task ended, an idle loop sleeps


async def test_tick_hold_nested_in_spin_hold_keeps_spinning_until_spin_ends():
    booster, progress = _booster()
    with booster.hold():
        with booster.hold(spin=False):
            assert (booster.num_holds, booster.num_spin_holds) == (2, 1)
            before = progress.num_calls
            await _turns(10)
            assert progress.num_calls - before >= 9  # a spin hold is active: every turn
        assert (booster.num_holds, booster.num_spin_holds) == (1, 1)
    assert (booster.num_holds, booster.num_spin_holds) == (0, 0)


async def test_tick_hold_alone_runs_the_task_and_counts_no_spin():
    booster, progress = _booster()
    with booster.hold(spin=False):
        assert (booster.num_holds, booster.num_spin_holds) == (1, 0)
        await _turns(1)
        assert booster.running
        assert progress.num_calls >= 1  # progressed once before its first tick sleep
    assert (booster.num_holds, booster.num_spin_holds) == (0, 0)


async def test_disabled_booster_never_progresses():
    progress = _CountingProgress()
    booster = ProgressBooster(progress, enabled=False)
    with booster.hold(), booster.hold(spin=False):
        await _turns(5)
        booster.kick()
    assert progress.num_calls == 0  # other progress modes: ucxx progresses, never the booster


@pytest.mark.skipif(
    staging._openmp_runtime() is None, reason="this torch build loads no OpenMP runtime"
)
def test_copy_threads_run_one_openmp_thread_and_leave_the_caller_alone():
    caller_threads = torch.get_num_threads()
    seen = staging.copy_executor().submit(torch.get_num_threads).result()
    assert seen == 1  # copies are memory-bound: one thread each (``copy_executor``)
    assert torch.get_num_threads() == caller_threads  # set per thread, never process-wide


async def test_large_and_inline_copies_land_exactly():
    # edge sizes: one byte over the inline limit (worker thread) and exactly at it (inline)
    for nbytes in (staging.INLINE_COPY_MAX_BYTES + 1, staging.INLINE_COPY_MAX_BYTES):
        src = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        caller_threads = torch.get_num_threads()
        await staging.run_copy(dst.copy_, src, nbytes=nbytes)
        assert torch.equal(dst, src)
        assert torch.get_num_threads() == caller_threads  # the inline path restores it


async def test_a_cancelled_copy_raises_only_after_its_thread_ended():
    """A read cancelled (deadline, abort) while its scatter runs in a copy thread must not
    return before the thread stops writing: the KV blocks may go to another request next."""
    import threading
    import time

    started, finished = threading.Event(), threading.Event()

    def slow_copy() -> None:
        started.set()
        time.sleep(0.2)
        finished.set()

    task = asyncio.ensure_future(
        staging.run_copy(slow_copy, nbytes=staging.INLINE_COPY_MAX_BYTES + 1)
    )
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()


def test_run_start_takes_python_ids_of_any_integer_type():
    import numpy as np

    assert staging.run_start([5, 6, 7]) == 5
    assert staging.run_start((9,)) == 9
    assert staging.run_start([5, 7]) is None
    assert staging.run_start([]) is None
    # a fixed-width integer must not wrap while the run is compared
    assert staging.run_start(np.array([32766, 32767], dtype=np.int16)) == 32766
