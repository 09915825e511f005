"""Reliability cases 6 and 7 of issue 15 (a pull from P to D under a slow or stuck holder), each
from a report in another system, on kvbridge's own engines over the loopback transport. Every
test compares D's greedy tokens with a plain full-recompute forward of the same model and ends
with both nodes empty (no request held, integrity true, every block free)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from _engine_builders import reference_greedy
from _pd_builders import (
    assert_node_empty,
    assert_pair_empty,
    long_prompt,
    prefill,
    run_to_completion,
)
from kvbridge.kvmanager import SamplingParams

MAX_TOKENS = 4
_GATE_LIMIT_S = 60.0  # hang guards only: no step of these tests waits this long when it works


def _stats(engine):
    return engine.scheduler.connector.stats.snapshot()


def _stop_heartbeats(engine) -> list[list[str]]:
    """``engine``'s transport drops every heartbeat it is asked to send; returns the list of
    request-id lists it dropped."""
    dropped: list[list[str]] = []

    async def drop(peer, request_ids):
        dropped.append(list(request_ids))

    engine.runner.connector.worker_half.transport.send_heartbeat = drop
    return dropped


def _gate_copies(transport) -> tuple[threading.Event, threading.Event]:
    """Hold every chunk copy of the reads ``transport`` serves until the returned ``open``
    event is set; ``copy_waiting`` is set once a read has been validated and its first chunk
    waits to be copied. (The loopback holder awaits ``_wait_or_drop`` once per read before
    validating it, then once before each chunk's copy.)"""
    copy_waiting, open_ = threading.Event(), threading.Event()
    wait_or_drop = transport._wait_or_drop
    validated: set[int] = set()

    async def gated(delay_s, state):
        if state.transfer_id not in validated:  # the wait before the read is validated
            validated.add(state.transfer_id)
        else:  # validated: the wait before a chunk's copy
            copy_waiting.set()
            waited_s = 0.0
            while not open_.is_set() and waited_s < _GATE_LIMIT_S:
                await asyncio.sleep(0.01)
                waited_s += 0.01
        await wait_or_drop(delay_s, state)

    transport._wait_or_drop = gated
    return copy_waiting, open_


def _wait_until(condition, what: str, engine=None, timeout_s: float = _GATE_LIMIT_S) -> None:
    """Step ``engine`` (if any) until ``condition()`` holds; fail naming ``what`` after
    ``timeout_s`` (a hang guard, never the test's subject)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        if engine is not None:
            engine.step()
        time.sleep(0.01)


def test_case6_a_lease_that_runs_out_during_a_slow_read_never_gives_wrong_bytes(pair_factory):
    """Issue 15, case 6 (a Mooncake report: a lease that runs out during a slow read).

    Lease 0.5 s, D's heartbeats stopped (its transport drops them), and P's holder, once it
    has validated D's read, holds the copy of the first chunk until the test opens it (the
    report's injected 1 s delay, made an event so the order below holds on any machine). The
    lease expires under the read; P frees the blocks and a new 140-token request on P (9 of
    P's 9 usable blocks) overwrites every one of them; only then is the copy let go. The copy
    reads the new request's bytes; the holder's re-check after the copy refuses them (the
    lease is gone, the hashes were removed), so the read fails cleanly for those blocks and D
    recomputes: D's tokens equal a single-node run.
    """
    pair = pair_factory(
        num_blocks=10, max_model_len=144, lease_s=0.5, heartbeat_interval_s=0.1,
        load_timeout_s=_GATE_LIMIT_S,
    )
    _stop_heartbeats(pair.d)
    prompt = long_prompt(60)
    params = prefill(pair, "r1", prompt)
    leased_block_ids = {b for group in params["remote_block_ids"] for b in group}
    copy_waiting, open_copy = _gate_copies(pair.p.runner.connector.worker_half.transport)

    # P's new request's blocks, read just before it frees them.
    p_manager = pair.p.kv_cache_manager
    free = p_manager.free
    new_block_ids: set[int] = set()

    def recording_free(request):
        if request.request_id == "p-new":
            new_block_ids.update(b for group in p_manager.get_block_ids("p-new") for b in group)
        return free(request)

    p_manager.free = recording_free

    # (1) D admits r1 and starts its pull; the holder validates it and holds the copy.
    pair.d.add_request("r1", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    pair.d.step()
    assert copy_waiting.wait(_GATE_LIMIT_S), "the holder never reached the copy"

    # (2) The lease runs out under the read; P frees the blocks and reuses all of them.
    _wait_until(
        lambda: _stats(pair.p)["num_expired_leases"] == 1, "the lease's expiry", engine=pair.p
    )
    other = long_prompt(140, salt="A new request on the prefill node. ")
    pair.p.add_request("p-new", other, SamplingParams(max_tokens=1))
    run_to_completion(pair.p, "p-new")
    assert leased_block_ids <= new_block_ids, (leased_block_ids, new_block_ids)
    assert pair.p.runner.connector.worker_half.transport.serving_transfer_ids  # still open
    open_copy.set()  # the copy now reads p-new's bytes out of r1's blocks

    # (3) D's read fails for the reused blocks and D recomputes them: the right tokens.
    output = run_to_completion(pair.d, "r1")
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert _stats(pair.d)["num_failed_loads"] == 1
    assert_pair_empty(pair)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_case7_a_holder_stuck_after_part_of_the_data_is_fenced_by_the_deadline(
    pair_factory, policy
):
    """Issue 15, case 7 (an SGLang fix: a receiver stuck after the transfer started).

    P's holder sends the first chunk of D's read (2 of 7 blocks) and then nothing: no
    completion, no error, the connection open. D's 0.5 s deadline must fire in that state too;
    the read is stopped on both sides (the holder's serving of it ended and it was told to
    cancel) before any of D's blocks is written by D's own forward or freed; then the request
    follows the policy: ``recompute`` computes the prompt again (the 2 blocks that arrived count
    as landed only once the holder's ``ReadDone`` confirms their re-check, which never came;
    tokens equal a single-node run), ``fail`` finishes it with an error.
    """
    pair = pair_factory(load_timeout_s=0.5, load_failure_policy=policy)
    prompt = long_prompt(100)  # 7 blocks
    params = prefill(pair, "r1", prompt)
    p_transport = pair.p.runner.connector.worker_half.transport
    d_transport = pair.d.runner.connector.worker_half.transport
    block_nbytes = sum(
        cache[0].numel() * cache.element_size() for cache in pair.d.runner.kv_caches.values()
    )
    d_transport.chunk_bytes = 2 * block_nbytes
    pair.p_faults.stall_after_chunks = 1

    # Every forward that writes r1's blocks, and the free of r1's blocks, must come after the
    # holder stopped serving the read.
    seen_while_serving: list[str] = []
    runner, manager = pair.d.runner, pair.d.kv_cache_manager
    execute_model, free = runner.execute_model, manager.free

    def checked_execute(scheduler_output):
        if "r1" in scheduler_output.num_scheduled_tokens and p_transport.serving_transfer_ids:
            seen_while_serving.append("forward")
        return execute_model(scheduler_output)

    def checked_free(request):
        if request.request_id == "r1" and p_transport.serving_transfer_ids:
            seen_while_serving.append("free")
        return free(request)

    runner.execute_model = checked_execute
    manager.free = checked_free

    started = time.monotonic()
    pair.d.add_request("r1", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    output = run_to_completion(pair.d, "r1")
    assert time.monotonic() - started < 10.0  # ended by the 0.5 s deadline, not hung (30 s)
    assert seen_while_serving == []
    assert not p_transport.serving_transfer_ids
    assert p_transport.num_cancels_received == 1
    assert _stats(pair.d)["num_failed_loads"] == 1
    if policy == "recompute":
        assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    else:
        assert output.finish_reason == "error"
    assert_node_empty(pair.d)
    pair.p_faults.stall_after_chunks = None
    assert_node_empty(pair.p)
