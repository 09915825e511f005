"""Reliability cases 6 and 7 of issue 15 (a pull from P to D under a slow or stuck holder), each
from a report in another system, on kvbridge's own engines over the loopback transport. Every
test compares D's greedy tokens with a plain full-recompute forward of the same model and ends
with both nodes empty (no request held, integrity true, every block free)."""

from __future__ import annotations

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


def test_case6_a_lease_that_runs_out_during_a_slow_read_never_gives_wrong_bytes(pair_factory):
    """Issue 15, case 6 (a Mooncake report: a lease that runs out during a slow read).

    Lease 0.5 s, D's heartbeats stopped (its transport drops them), and P's holder waits 2 s
    (the report's 1 s, doubled so that P's reuse below surely comes first on a busy machine)
    before it copies the first chunk of the read it already validated. The lease expires under
    the read; P frees the blocks and a new 140-token request on P (9 of P's 9 usable blocks)
    overwrites every one of them before the copy. The copy then reads the new request's bytes;
    the holder's re-check after the copy refuses them (the lease is gone, the hashes were
    removed), so the read fails cleanly for those blocks and D recomputes: D's tokens equal a
    single-node run.
    """
    pair = pair_factory(
        num_blocks=10, max_model_len=144, lease_s=0.5, heartbeat_interval_s=0.1,
        load_timeout_s=10.0,
    )
    _stop_heartbeats(pair.d)
    prompt = long_prompt(60)
    params = prefill(pair, "r1", prompt)
    pair.p_faults.chunk_delay_s = 2.0

    # (1) D admits r1 and starts its pull; the holder validates it and then waits.
    pair.d.add_request("r1", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    pair.d.step()
    started = time.monotonic()

    # (2) The lease runs out under the read; P frees the blocks and reuses all of them.
    time.sleep(0.55)
    other = long_prompt(140, salt="A new request on the prefill node. ")
    pair.p.add_request("p-new", other, SamplingParams(max_tokens=1))
    run_to_completion(pair.p, "p-new")
    assert _stats(pair.p)["num_expired_leases"] == 1
    assert time.monotonic() - started < 2.0, "P's reuse came after the copy (machine too slow)"

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
