"""What a stalled transfer tells the operator: the connector loop's watchdog names where a blocked
loop thread is; a read that misses its deadline names what it was waiting for; a UCX receive
pending past ``STALL_CHECK_S`` says whether UCX had completed it; with ``KVBRIDGE_STALL_DUMP_S``, a
loop starved of the GIL gets every thread's stack dumped."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import time

import pytest
from kvbridge.connector import loop_thread
from kvbridge.connector.loop_thread import LoopThread
from kvbridge.transport import TransferTimeoutError
from kvbridge.transport.transfer import ReadState, drive_read
from kvbridge.transport.ucx_read import _on_stall


async def _blocking_call_on_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what nothing on the connector loop may do


def test_the_watchdog_names_where_a_blocked_loop_is_and_when_it_runs_again(monkeypatch, caplog):
    monkeypatch.setattr(loop_thread, "WATCH_S", 0.02)
    monkeypatch.setattr(loop_thread, "BLOCKED_S", 0.2)
    monkeypatch.setattr(loop_thread, "SLOW_S", 60.0)  # (the next test's line)
    caplog.set_level(logging.WARNING, logger=loop_thread.__name__)
    thread = LoopThread(name="watched-loop")
    try:
        thread.run(asyncio.sleep(0.1))  # a loop that runs: nothing said
        assert not caplog.records
        thread.run(_blocking_call_on_the_loop(0.6))
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        thread.loop.call_soon_threadsafe(thread.loop.stop)
    time.sleep(0.4)  # past BLOCKED_S: a stopped loop is not reported as blocked
    blocked, ran_again = (r.getMessage() for r in caplog.records[:2])
    assert blocked.startswith("connector loop blocked for ")
    assert "_blocking_call_on_the_loop" in blocked  # the loop thread's stack, innermost last
    assert ran_again.startswith("connector loop ran again after ")
    assert len(caplog.records) == 2  # once per episode


def test_a_slow_loop_is_logged_once_per_period_with_its_latest_delay(monkeypatch, caplog):
    monkeypatch.setattr(loop_thread, "WATCH_S", 0.02)
    monkeypatch.setattr(loop_thread, "BLOCKED_S", 60.0)
    monkeypatch.setattr(loop_thread, "SLOW_S", 0.1)
    caplog.set_level(logging.WARNING, logger=loop_thread.__name__)
    thread = LoopThread(name="slow-loop")
    try:
        thread.run(asyncio.sleep(0.1))
        assert not caplog.records
        for _ in range(3):  # three late pings within one SLOW_LOG_EVERY_S: one line
            thread.run(_blocking_call_on_the_loop(0.3))
            time.sleep(0.1)
    finally:
        thread.loop.call_soon_threadsafe(thread.loop.stop)
    (slow,) = (r.getMessage() for r in caplog.records)
    assert re.fullmatch(r"connector loop slow: 1 ping\(s\) answered later than 0\.1 s, the "
                        r"latest after 0\.[23]\d s", slow), slow


async def test_a_missed_deadline_names_the_phase_and_the_await_it_was_stuck_in(caplog):
    caplog.set_level(logging.WARNING)
    state = ReadState(request_id="req-7", transfer_id=7, groups=[], local_block_ids=[])

    async def waiting_for_the_holder() -> None:
        await asyncio.Event().wait()

    async def core():
        state.phase = "waiting for ReadOk"
        await waiting_for_the_holder()

    async def abort(reason: str) -> None:
        return None

    with pytest.raises(TransferTimeoutError, match=r"deadline \(waiting for ReadOk\)"):
        await drive_read(state, core(), abort, 0.05)
    (record,) = [r for r in caplog.records if "missed its" in r.getMessage()]
    assert re.search(r"\(waiting for ReadOk; the loop woke 0\.\d{3} s after it\)",
                     record.getMessage())
    assert "core (" in record.getMessage()
    assert "waiting_for_the_holder (" in record.getMessage()


class _Request:
    def __init__(self, completed: bool) -> None:
        self.completed = completed


async def test_a_stalled_receive_says_whether_ucx_completed_it(caplog):
    caplog.set_level(logging.WARNING)

    async def recv() -> None:
        req = _Request(completed=False)  # the local ucxx's Endpoint.recv awaits on
        await asyncio.sleep(10)
        del req

    task = asyncio.ensure_future(recv())
    await asyncio.sleep(0)  # the task runs up to its await
    try:
        _on_stall(3, 1, task)
    finally:
        task.cancel()
    (record,) = caplog.records
    assert record.getMessage() == ("transfer 3: the receive of chunk 1 is pending after 1.0 s; "
                                   "UCX request completed: False")


_STARVED_LOOP = """
import asyncio, time
from kvbridge.connector.loop_thread import LoopThread
thread = LoopThread(name="dumped-loop")
thread.run(asyncio.sleep(0.6))  # a loop that runs past the dump time: no dump
print("hogging", flush=True)
def hold_the_gil():
    sum(range({n}))  # one C call that never lets the GIL go
hold_the_gil()
thread.loop.call_soon_threadsafe(thread.loop.stop)
time.sleep(0.8)  # a stopped loop is not stalled: no second dump
print("done", flush=True)
"""


@pytest.mark.parametrize("hog", [False, True])
def test_the_stall_dump_shows_the_thread_that_holds_the_gil(hog):
    """``KVBRIDGE_STALL_DUMP_S``: a loop starved by another thread's long C call (the Python
    watchdog needs the GIL too, so it says nothing) gets every thread's stack on stderr, the
    starving call's included; a loop that runs, or has stopped, gets none."""
    script = _STARVED_LOOP.replace("{n}", str(150_000_000 if hog else 1))
    env = {**os.environ, loop_thread.STALL_DUMP_ENV: "0.3"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == ["hogging", "done"]
    if not hog:
        assert "Timeout (" not in out.stderr, out.stderr
        return
    assert out.stderr.count("Timeout (0:00:00.300000)!") == 1, out.stderr
    assert "in hold_the_gil" in out.stderr  # the thread that held the GIL
    assert "in _run" in out.stderr  # the loop thread, waiting for it
