"""P/D disaggregation through ``KVBridgeConnector`` over the loopback transport (issue 5).

Every lifecycle test narrates its steps, compares D's greedy tokens with a plain full-recompute
forward of the same model, and ends with both schedulers empty, ``check_integrity()`` true and
every block free on both nodes.
"""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch
from _engine_builders import reference_greedy
from _pd_builders import (
    assert_node_empty,
    assert_pair_empty,
    decode,
    drain,
    kv_bytes,
    long_prompt,
    prefill,
    run_to_completion,
)
from kvbridge.connector.errors import KVTransferParamsError
from kvbridge.connector.transfer_params import RemotePrefillParams
from kvbridge.kvmanager import SamplingParams

MAX_TOKENS = 4


def _stats(engine):
    return engine.scheduler.connector.stats.snapshot()


# Block size 16: 1 token, block size - 1, block size, block size + 1, many blocks.
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 150])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_decode_node_tokens_equal_single_node(pair_factory, hybrid, num_tokens):
    pair = pair_factory(hybrid=hybrid)
    prompt = long_prompt(num_tokens)

    # (1) P prefills and hands its blocks over under a lease.
    params = prefill(pair, "req-0", prompt)
    assert params["remote_num_tokens"] == num_tokens
    assert [len(ids) for ids in params["remote_block_ids"]] == [-(-num_tokens // 16)] * (
        2 if hybrid else 1
    )

    # (2) D pulls the prompt's KV but the last token (recomputed for its logits), then decodes.
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=hybrid)
    assert output.num_cached_tokens == num_tokens - 1
    stats = _stats(pair.d)
    # A 1-token prompt has nothing to pull: D only tells P to release its block.
    assert (stats["num_loads"], stats["num_failed_loads"]) == (int(num_tokens > 1), 0)

    # (3) D's completion notice released P's lease: P frees its blocks, nothing leaks.
    assert_pair_empty(pair)
    assert _stats(pair.p)["num_released_leases"] == 1
    assert _stats(pair.p)["num_expired_leases"] == 0


def test_partial_local_hit_pulls_only_the_missing_blocks(pair_factory):
    pair = pair_factory()
    shared = long_prompt(100)
    # (1) D has served the first 48 tokens (3 full blocks) of this prompt locally before.
    pair.d.add_request("warm", shared[:50], SamplingParams(max_tokens=1))
    run_to_completion(pair.d, "warm")

    # (2) P prefills the whole 100-token prompt (7 blocks).
    params = prefill(pair, "req-0", shared)
    # (3) D hits 48 tokens locally and pulls positions 3..6 only, paired by position.
    output = decode(pair, "req-0", shared, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(shared, MAX_TOKENS, hybrid=False)
    assert _stats(pair.d)["num_blocks_received"] == 4
    # One handover pull from P (its ticket, not the index) of those 4 blocks.
    assert pair.d.scheduler.connector.stats.pulls_by_holder() == {
        "prefill-0": {"pulls": 1, "blocks": 4, "index_pulls": 0}
    }
    assert output.num_cached_tokens == 99  # 48 local + 51 pulled; the last token is recomputed
    assert_pair_empty(pair)


@pytest.mark.parametrize("extra_tokens_on_d", [0, 1])
def test_2048_token_prompt_lands_in_the_right_blocks(pair_factory, extra_tokens_on_d):
    # 2,048 tokens at block size 64 is exactly 32 blocks: the last token's block is full, so the
    # last token's recompute must not shift the pairing (docs/architecture.md, "Pairing by
    # position").
    pair = pair_factory(block_size=64, num_blocks=80, max_model_len=2112)
    prompt = long_prompt(2048)
    params = prefill(pair, "req-0", prompt)
    remote_ids = params["remote_block_ids"][0]
    assert len(remote_ids) == 32
    p_rows = [kv_bytes(pair.p, 0, block_id) for block_id in remote_ids]

    d_prompt = prompt + long_prompt(1 + extra_tokens_on_d)[1:] if extra_tokens_on_d else prompt
    pair.d.add_request("req-0", d_prompt, SamplingParams(max_tokens=2), params)
    # Step until the load has landed and the request runs; capture D's table then.
    deadline = time.monotonic() + 30
    while _stats(pair.d)["num_loads"] == 0:
        assert time.monotonic() < deadline
        pair.d.step()
    local_ids = pair.d.kv_cache_manager.get_block_ids("req-0")[0][:32]
    for pos, (local_id, p_layers) in enumerate(zip(local_ids, p_rows, strict=True)):
        d_layers = kv_bytes(pair.d, 0, local_id)
        for layer, (d_row, p_row) in enumerate(zip(d_layers, p_layers, strict=True)):
            # Slot 63 of the last block is the recomputed last prompt token when D's prompt
            # is exactly P's; every other slot is P's bytes, bit for bit.
            n = 63 if (pos == 31 and not extra_tokens_on_d) else 64
            assert torch.equal(d_row[:, :n], p_row[:, :n]), (pos, layer)
    output = run_to_completion(pair.d, "req-0")
    assert output.token_ids == reference_greedy(d_prompt, 2, hybrid=False)
    assert_pair_empty(pair)


def test_abort_mid_transfer_keeps_blocks_until_the_load_settles(pair_factory):
    pair = pair_factory()
    prompt = long_prompt(120)
    params = prefill(pair, "req-0", prompt)
    pair.p_faults.serve_delay_s = 0.3  # the pull stays in flight for a while

    # (1a) D admits req-0 and starts the pull.
    pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    pair.d.step()
    loading_ids = set(pair.d.kv_cache_manager.get_block_ids("req-0")[0])
    # (1b) The client aborts req-0 while its bytes are still on the way.
    pair.d.abort_request("req-0")
    assert "req-0" in pair.d.scheduler.held_req_ids
    # (1c) Another request arrives: it must not be handed any block the pull writes into.
    other = long_prompt(90, salt="Another request. ")
    pair.d.add_request("req-1", other, SamplingParams(max_tokens=MAX_TOKENS))
    pair.d.step()
    assert not loading_ids & set(pair.d.kv_cache_manager.get_block_ids("req-1")[0])

    # (2) The load settles (cancelled or landed); the other request's KV is intact.
    output = run_to_completion(pair.d, "req-1")
    assert output.token_ids == reference_greedy(other, MAX_TOKENS, hybrid=False)
    assert_pair_empty(pair)


@pytest.mark.parametrize(("wait_s", "landed_in_first_step"), [(1.0, True), (0.0, False)])
def test_idle_step_waits_for_the_pull_in_flight(pair_factory, wait_s, landed_in_first_step):
    """D's first step only starts the pull (nothing to compute): with ``idle_pull_wait_s`` its
    ``get_finished`` waits for that pull (P answers after 50 ms), so it lands and is reported
    in that very step; with 0 the step returns at once and the pull is still in flight. The
    tokens are the same either way."""
    pair = pair_factory(idle_pull_wait_s=wait_s)
    prompt = long_prompt(70)
    params = prefill(pair, "req-0", prompt)
    pair.p_faults.serve_delay_s = 0.05

    # (1) D admits req-0: one step, which computes nothing and starts the pull.
    pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    started = time.monotonic()
    pair.d.step()
    took_s = time.monotonic() - started
    assert (_stats(pair.d)["num_loads"] == 1) is landed_in_first_step
    assert (took_s >= 0.05) is landed_in_first_step
    assert took_s < 0.9  # not the whole budget: it returns when the pull settles
    # (2) The rest decodes as usual.
    output = run_to_completion(pair.d, "req-0")
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert_pair_empty(pair)


@pytest.mark.parametrize("num_tokens", [17, 150])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_a_sync_load_lands_inside_the_step_that_computes_the_request(
    pair_factory, hybrid, num_tokens
):
    """``load_mode`` "sync" (vLLM's synchronous external load): D's first step pulls the KV
    and computes the last prompt token in the same step, so the first token comes out of that
    step; the request never waits in ``WAITING_FOR_REMOTE_KVS`` and is never reported in
    ``finished_recving``."""
    pair = pair_factory(hybrid=hybrid, load_mode="sync")
    prompt = long_prompt(num_tokens)
    params = prefill(pair, "req-0", prompt)

    # (1) One D step: the pull, then the forward that reads its blocks.
    pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    first = pair.d.step()
    assert [len(o.token_ids) for o in first if o.request_id == "req-0"] == [1]
    assert _stats(pair.d)["num_loads"] == 1
    assert pair.d.scheduler.held_req_ids == set()  # no load in flight, nothing held
    # (2) The rest decodes; the tokens are a single node's.
    output = run_to_completion(pair.d, "req-0")
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=hybrid)
    assert output.num_cached_tokens == num_tokens - 1
    assert _stats(pair.d)["num_failed_loads"] == 0
    assert_pair_empty(pair)


# Long beside a tiny-model step (ms), so that "waited" and "did not" stay apart on a loaded host.
_IDLE_HOLD_WAIT_S = 0.5


def _timed_step(engine) -> float:
    started = time.monotonic()
    engine.step()
    return time.monotonic() - started


def test_idle_holder_waits_grow_with_the_lull_and_end_with_its_leases(pair_factory):
    """An idle step of P waits while P holds a lease for D (vLLM would otherwise step it
    without pause): 1 ms at first, twice as long at each further idle step in a row, up to
    ``idle_hold_wait_s``. A step that computes starts the next lull at 1 ms again, and once no
    lease is held an idle step does not wait at all."""
    pair = pair_factory(idle_hold_wait_s=_IDLE_HOLD_WAIT_S)
    prompts = {"req-0": long_prompt(70), "req-1": long_prompt(70, salt="other ")}
    params = {"req-0": prefill(pair, "req-0", prompts["req-0"])}  # (1) P holds req-0's blocks

    # (2) a lull: each step lasts at least its wait, 1, 2, 4, ... 256 ms, then the cap; the
    # step_after of prefill() was already one idle step, so each wait may be one doubling on
    waits = [min(0.001 * 2**i, _IDLE_HOLD_WAIT_S) for i in range(11)]
    durations = [_timed_step(pair.p) for _ in waits]
    assert all(d >= w for d, w in zip(durations, waits, strict=True)), durations
    assert durations[-1] >= _IDLE_HOLD_WAIT_S

    # (3) P computes another prompt: its next lull starts short (1 ms, not the cap)
    params["req-1"] = prefill(pair, "req-1", prompts["req-1"], step_after=False)
    assert _timed_step(pair.p) < _IDLE_HOLD_WAIT_S

    # (4) D pulls both; its notices end the leases; P's idle steps no longer wait
    for request_id, prompt in prompts.items():
        output = decode(pair, request_id, prompt, params[request_id], MAX_TOKENS)
        assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert_pair_empty(pair)
    assert _timed_step(pair.p) < _IDLE_HOLD_WAIT_S  # a step of the tiny model: ms


_STALL_CASES = {  # load mode -> (the pair's deadlines, the bound D's request ends within)
    "async": ({"load_timeout_s": 0.3}, 5.0),
    # A sync load holds the engine step, so it has a deadline of its own: 0.3 s against a
    # 30 s load_timeout_s; the policy then applies to that step's request.
    "sync": ({"load_mode": "sync", "sync_load_timeout_s": 0.3, "load_timeout_s": 30.0}, 10.0),
}


@pytest.mark.parametrize("load_mode", list(_STALL_CASES))
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_node_stops_answering(pair_factory, policy, load_mode):
    deadlines, bound_s = _STALL_CASES[load_mode]
    pair = pair_factory(load_failure_policy=policy, **deadlines)
    prompt = long_prompt(70)
    params = prefill(pair, "req-0", prompt)
    pair.p_faults.stall = True  # P accepts the read and never sends

    started = time.monotonic()
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert time.monotonic() - started < bound_s  # ended by its deadline, not hung
    if policy == "recompute":
        assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
        assert output.finish_reason == "length"
    else:
        assert output.finish_reason == "error"
    assert _stats(pair.d)["num_failed_loads"] == 1
    assert_node_empty(pair.d)
    pair.p_faults.stall = False
    assert_node_empty(pair.p)


def test_lease_expires_when_the_decode_node_never_comes(pair_factory):
    pair = pair_factory(lease_s=0.2, heartbeat_interval_s=0.05)
    params = prefill(pair, "req-0", long_prompt(40))
    assert params["lease_expires_at"] > time.time()
    assert "req-0" in pair.p.scheduler.held_req_ids  # delay_free: blocks still referenced
    time.sleep(0.25)
    # P's next steps see the expired lease and free the blocks exactly once.
    assert_node_empty(pair.p)
    assert _stats(pair.p)["num_expired_leases"] == 1
    assert_node_empty(pair.d)


def test_heartbeats_keep_the_lease_alive_during_a_slow_pull(pair_factory):
    pair = pair_factory(lease_s=0.25, heartbeat_interval_s=0.05)
    prompt = long_prompt(60)
    params = prefill(pair, "req-0", prompt)
    pair.p_faults.serve_delay_s = 0.6  # longer than the lease: only heartbeats keep it
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert _stats(pair.d)["num_failed_loads"] == 0
    assert_node_empty(pair.p)
    assert _stats(pair.p)["num_expired_leases"] == 0
    assert_node_empty(pair.d)


def test_stale_remote_block_ids_cost_a_recompute_not_wrong_output(pair_factory):
    pair = pair_factory(lease_s=0.1, num_blocks=40)
    prompt = long_prompt(100)
    params = prefill(pair, "req-0", prompt)
    # (1) D is late: P's lease runs out and P reuses the blocks for other prompts.
    time.sleep(0.15)
    drain(pair.p)
    assert pair.p.kv_cache_manager.reset_prefix_cache()
    for i in range(3):
        pair.p.add_request(
            f"other-{i}", long_prompt(150, salt=f"{i} "), SamplingParams(max_tokens=1)
        )
        run_to_completion(pair.p, f"other-{i}")
    # (2) D pulls with the stale ids: P's hash check refuses the changed blocks, D recomputes.
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    stats = _stats(pair.d)
    assert stats["num_failed_loads"] == 1 and stats["num_load_errors_blocks"] >= 1
    assert_pair_empty(pair)


def test_full_local_hit_only_notifies_the_prefill_node(pair_factory):
    pair = pair_factory()
    p_prompt = long_prompt(32)
    d_prompt = long_prompt(60)  # P's prompt plus 28 more tokens
    # (1) D already holds the first 48 tokens of d_prompt in its prefix cache.
    pair.d.add_request("warm", d_prompt, SamplingParams(max_tokens=1))
    run_to_completion(pair.d, "warm")
    params = prefill(pair, "req-0", p_prompt)
    # (2) D's local hit (48) covers all 32 remote tokens: no pull, P is told to release.
    output = decode(pair, "req-0", d_prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(d_prompt, MAX_TOKENS, hybrid=False)
    assert _stats(pair.d)["num_loads"] == 0
    assert_node_empty(pair.p)
    assert _stats(pair.p)["num_released_leases"] == 1
    assert_node_empty(pair.d)


def test_different_block_sizes_are_refused_naming_the_field(pair_factory):
    pair = pair_factory(block_size=16, d_block_size=32)
    prompt = long_prompt(64)
    params = prefill(pair, "req-0", prompt)
    with pytest.raises(KVTransferParamsError, match="remote_block_size: local 32, remote 16"):
        pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=2), params)
    # The refusal told P to release its blocks now, not at lease expiry (D's next step hands
    # the notice to its worker half; D's loop steps for it although no request is left).
    assert not pair.d.scheduler.is_empty()
    drain(pair.d)
    assert_node_empty(pair.p)
    assert _stats(pair.p)["num_released_leases"] == 1
    assert_node_empty(pair.d)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_decode_node_of_another_model_revision_loads_nothing_from_the_prefill_node(
    pair_factory, policy, caplog
):
    # Issue 28 item 7: another revision of the same weights computes other KV for the same
    # tokens under the same block hashes; the handshake refuses it, naming the field, and the
    # request follows the load failure policy. Before, model_revision was no setting at all.
    pair = pair_factory(load_failure_policy=policy, d_extra={"model_revision": "5d0f2ab1"})
    prompt = long_prompt(70)
    params = prefill(pair, "req-0", prompt)
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.puller"):
        output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert "model_revision: local '', remote '5d0f2ab1'" in caplog.text  # P refused D's Hello
    s = _stats(pair.d)
    assert (s["num_failed_loads"], s["num_blocks_received"]) == (1, 0)
    if policy == "recompute":
        assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    else:
        assert output.finish_reason == "error"
    assert_pair_empty(pair)  # D's release notice freed P's blocks (loopback)


def _malformed(params, mutate):
    bad = {k: (list(map(list, v)) if k == "remote_block_ids" else v) for k, v in params.items()}
    mutate(bad)
    return bad


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda p: p.pop("remote_host"), "remote_host"),
        (lambda p: p.update(remote_port="5000"), "remote_port"),
        (lambda p: p.update(remote_port=70000), "remote_port"),
        (lambda p: p.update(remote_num_tokens=-3), "remote_num_tokens"),
        (lambda p: p.update(remote_block_ids=[[1, 2]]), r"remote_block_ids\[0\]"),
        (lambda p: p["remote_block_ids"][0].__setitem__(0, -1), r"remote_block_ids\[0\]"),
        (lambda p: p["remote_block_ids"][0].__setitem__(0, "x"), r"remote_block_ids\[0\]"),
        (lambda p: p.update(remote_block_ids="1,2,3"), "remote_block_ids"),
        (lambda p: p.update(lease_expires_at=float("inf")), "lease_expires_at"),
        (lambda p: p.update(lease_expires_at=float("nan")), "lease_expires_at"),
    ],
)
def test_malformed_params_fail_that_request_and_the_node_keeps_serving(pair_factory, mutate, field):
    pair = pair_factory()
    prompt = long_prompt(40)
    params = prefill(pair, "req-0", prompt)
    with pytest.raises(KVTransferParamsError, match=field):
        pair.d.add_request("bad", prompt, SamplingParams(max_tokens=2), _malformed(params, mutate))
    assert _stats(pair.d)["num_rejected_params"] == 1
    # The same node serves the well-formed request right after.
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert_pair_empty(pair)


@pytest.mark.parametrize(
    "num_d_prompt_tokens, remote_num_tokens",
    [
        # P's ticket for 40 tokens (3 blocks of 16) with D's prompt cut to 34 (still 3 blocks).
        (34, 40),
        # One token over a 40-token prompt; cdiv(41, 16) = 3 ids, as P sent.
        (40, 41),
        # The whole third block claimed (48 tokens, 3 ids) for a 40-token prompt.
        (40, 48),
    ],
)
def test_remote_num_tokens_over_the_prompt_is_refused_at_admission(
    pair_factory, num_d_prompt_tokens, remote_num_tokens
):
    pair = pair_factory()
    prompt = long_prompt(40)
    params = prefill(pair, "req-0", prompt)
    bad = _malformed(params, lambda p: p.update(remote_num_tokens=remote_num_tokens))
    # Block ids match remote_num_tokens (3 per group), so only the prompt length is wrong.
    assert all(len(ids) == 3 for ids in bad["remote_block_ids"])
    expected = (
        f"remote_num_tokens: {remote_num_tokens} exceeds the request's prompt of "
        f"{num_d_prompt_tokens} tokens"
    )
    with pytest.raises(KVTransferParamsError, match=expected):
        pair.d.add_request(
            "bad", prompt[:num_d_prompt_tokens], SamplingParams(max_tokens=2), bad
        )
    assert _stats(pair.d)["num_rejected_params"] == 1
    assert "bad" not in pair.d.scheduler.requests
    # The refusal told P to release its blocks (D steps to deliver the notice) ...
    drain(pair.d)
    assert_node_empty(pair.p)
    assert _stats(pair.p)["num_released_leases"] == 1
    # ... and D serves the next well-formed request: a fresh prefill of the same prompt whose
    # remote_num_tokens equals D's prompt (the boundary: accepted).
    params = prefill(pair, "req-1", prompt)
    assert params["remote_num_tokens"] == len(prompt)
    output = decode(pair, "req-1", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert _stats(pair.d)["num_loads"] == 1  # the refused request never pulled
    assert_pair_empty(pair)


def test_remote_num_tokens_over_the_prompt_is_refused_without_a_prompt_length_too():
    """``RemotePrefillParams.parse`` itself: the check runs only where the prompt length is
    given (the vLLM adapter's ``on_new_request`` passes ``request.num_prompt_tokens`` to the
    same ``validate_kv_transfer_params``)."""
    params = {
        "remote_engine_id": "P", "remote_incarnation": "1", "remote_request_id": "r",
        "remote_host": "127.0.0.1", "remote_port": 5000, "remote_block_ids": [[1, 2, 3]],
        "remote_num_tokens": 40, "remote_block_size": 16, "lease_expires_at": 1.0,
    }
    parsed = RemotePrefillParams.parse(params, num_groups=1, block_size=16)
    assert parsed.remote_num_tokens == 40
    assert RemotePrefillParams.parse(
        params, num_groups=1, block_size=16, num_prompt_tokens=40
    ).remote_num_tokens == 40
    with pytest.raises(KVTransferParamsError, match=r"remote_num_tokens: 40 exceeds .* of 39"):
        RemotePrefillParams.parse(params, num_groups=1, block_size=16, num_prompt_tokens=39)


def test_block_ids_out_of_the_holders_range_become_a_load_error(pair_factory):
    pair = pair_factory()
    prompt = long_prompt(40)
    params = prefill(pair, "req-0", prompt)
    bad = _malformed(params, lambda p: p["remote_block_ids"][0].__setitem__(1, 10**6))
    output = decode(pair, "req-0", prompt, bad, MAX_TOKENS)
    # P refused the read (id out of its range); D recomputed: still the right tokens.
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert _stats(pair.d)["num_failed_loads"] == 1
    assert_pair_empty(pair)


def test_a_late_puller_never_reads_the_reused_unhashed_last_block(pair_factory):
    pair = pair_factory(lease_s=0.2, heartbeat_interval_s=0.05)
    prompt = long_prompt(40)  # 2 full blocks and a partial one, which has no hash
    params = prefill(pair, "req-0", prompt)
    # (1) D is late: the lease ends and P frees the blocks; its next prompt takes the unhashed
    #     partial block first (unhashed blocks go to the front of the free queue).
    time.sleep(0.25)
    drain(pair.p)
    prefill(pair, "other", long_prompt(40, salt="Another prompt. "))
    # (2) The partial block is served only under its lease, which is gone: a load error, a
    #     recompute from that block, and the right tokens (never the other prompt's KV).
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert _stats(pair.d)["num_failed_loads"] == 1
    assert_pair_empty(pair)


def test_a_request_preempted_after_its_pull_does_not_pull_again(pair_factory):
    pair = pair_factory(num_blocks=12, max_model_len=176)
    prompt = long_prompt(40)
    params = prefill(pair, "req-0", prompt)
    # (1) A local request grows until the pool is nearly full ...
    grower = long_prompt(16, salt="Grow. ")
    pair.d.add_request("grow", grower, SamplingParams(max_tokens=150, ignore_eos=True))
    while pair.d.scheduler.requests["grow"].num_tokens < 124:
        pair.d.step()
    # (2) ... so req-0, admitted with P's ticket, is preempted after its pull landed.
    pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=100, ignore_eos=True), params)
    outputs = {}
    deadline = time.monotonic() + 60
    while len(outputs) < 2:
        assert time.monotonic() < deadline
        outputs.update({o.request_id: o for o in pair.d.step() if o.finished})
    assert pair.d.scheduler.num_preemptions >= 1
    # (3) The ticket was used once: the re-admitted request recomputes instead of pulling from
    #     blocks P has released (and may have reused) since.
    assert (_stats(pair.d)["num_loads"], _stats(pair.d)["num_failed_loads"]) == (1, 0)
    expected = reference_greedy(prompt, 100, hybrid=False)
    assert outputs["req-0"].token_ids == expected
    assert_pair_empty(pair)


# tiny_hybrid's window is 16 tokens at block size 16 in these builders; prompt lengths where the
# window of the last prompt token starts exactly on a block boundary used to lose that block.
@pytest.mark.parametrize("num_tokens", [31, 47, 63])
def test_hybrid_pull_resumes_at_the_last_token_without_a_restart(pair_factory, caplog, num_tokens):
    pair = pair_factory(hybrid=True)
    prompt = long_prompt(num_tokens)
    params = prefill(pair, "req-0", prompt)
    with caplog.at_level("WARNING", logger="kvbridge"):
        output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=True)
    assert not [r for r in caplog.records if "from scratch" in r.getMessage()]
    assert (_stats(pair.d)["num_loads"], _stats(pair.d)["num_failed_loads"]) == (1, 0)
    assert_pair_empty(pair)


def test_a_queued_request_keeps_the_lease_alive_until_its_pull(pair_factory):
    pair = pair_factory(lease_s=0.3, heartbeat_interval_s=0.05, d_max_num_seqs=1)
    prompt = long_prompt(40)
    params = prefill(pair, "req-0", prompt)
    # (1) D is busy with one request (one seat) and admits req-0, which waits in the queue
    # longer than the lease while both nodes keep stepping ...
    pair.d.add_request("busy", long_prompt(8, salt="busy"), SamplingParams(max_tokens=240))
    pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        pair.p.step()  # P watches its leases meanwhile
        pair.d.step()
        time.sleep(0.01)
    assert pair.d.scheduler.requests["req-0"].num_computed_tokens == 0  # still queued
    pair.d.abort_request("busy")
    # (2) ... yet heartbeats for the waiting ticket kept P's blocks: the pull lands whole.
    output = run_to_completion(pair.d, "req-0")
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert (_stats(pair.d)["num_loads"], _stats(pair.d)["num_failed_loads"]) == (1, 0)
    assert_node_empty(pair.p)
    assert _stats(pair.p)["num_expired_leases"] == 0
    assert_node_empty(pair.d)


def test_a_request_aborted_before_its_pull_releases_the_lease_at_once(pair_factory):
    pair = pair_factory(lease_s=30.0)
    prompt = long_prompt(40)
    params = prefill(pair, "req-0", prompt)
    pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    pair.d.abort_request("req-0")  # never scheduled: the ticket was not used
    # P frees its blocks now (a release notice, sent at D's next step), not after the lease.
    drain(pair.d)
    assert_node_empty(pair.p)
    assert _stats(pair.p)["num_released_leases"] == 1
    assert_node_empty(pair.d)


def test_a_pull_that_arrives_before_the_lease_grant_retries_and_lands_whole(pair_factory):
    pair = pair_factory()
    prompt = long_prompt(100)
    # (1) P answers the ticket but has not stepped since: its worker half holds no lease yet.
    params = prefill(pair, "req-0", prompt, step_after=False)
    pair.d.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    pair.d.step()  # (2) D's pull goes out now and is refused (no lease on P) ...
    time.sleep(0.03)
    pair.p.step()  # (3) ... P's next step grants the lease; D's retry finds it.
    output = run_to_completion(pair.d, "req-0")
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert (_stats(pair.d)["num_loads"], _stats(pair.d)["num_failed_loads"]) == (1, 0)
    assert_pair_empty(pair)


def test_a_lease_never_granted_ends_in_a_recompute_after_the_retries(pair_factory):
    pair = pair_factory()
    prompt = long_prompt(100)
    params = prefill(pair, "req-0", prompt, step_after=False)
    # P never steps while D pulls: every retry is refused, D recomputes with the right tokens.
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert (_stats(pair.d)["num_loads"], _stats(pair.d)["num_failed_loads"]) == (0, 1)
    assert_pair_empty(pair)


def _full_attention_group(engine) -> int:
    """The first KV cache group without a sliding window (the hybrid model's full-attention one)."""
    groups = engine.kv_cache_manager.kv_cache_config.kv_cache_groups
    return next(i for i, g in enumerate(groups)
                if getattr(g.kv_cache_spec, "sliding_window", None) is None)


@pytest.mark.parametrize("position", [0, 2])  # the first block, a middle one
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_a_null_block_in_a_full_attention_group_is_a_load_failure(
    pair_factory, hybrid, policy, position
):
    # P keeps every block of a full-attention group: its null block there is a wrong ticket,
    # never a sliding window's gap, so the engine's load-failure policy decides.
    pair = pair_factory(hybrid=hybrid, load_failure_policy=policy)
    prompt = long_prompt(70)  # 5 blocks; D pulls positions 0..4 (69 tokens)
    params = prefill(pair, "req-0", prompt)
    group = _full_attention_group(pair.d)
    bad = _malformed(params, lambda p: p["remote_block_ids"][group].__setitem__(position, 0))

    output = decode(pair, "req-0", prompt, bad, MAX_TOKENS)
    if policy == "recompute":
        assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=hybrid)
        assert output.finish_reason == "length"
    else:
        assert output.finish_reason == "error"
    stats = _stats(pair.d)
    assert (stats["num_failed_loads"], stats["num_window_gaps"]) == (1, 0)
    assert stats["num_load_errors_blocks"] >= 1
    # D's failure notice released P's lease at once (30 s lease: expiry cannot pass this).
    assert_pair_empty(pair)
    assert _stats(pair.p)["num_released_leases"] == 1


def test_a_pd_pair_leaves_the_process_switch_interval_alone(pair_factory):
    # A library does not change its host's process-wide settings unasked: Python's GIL switch
    # interval is the same before, during and after a handover on nodes with the defaults.
    before = sys.getswitchinterval()
    pair = pair_factory()
    prompt = long_prompt(40)
    decode(pair, "req-0", prompt, prefill(pair, "req-0", prompt), MAX_TOKENS)
    assert sys.getswitchinterval() == before
    pair.close()
    assert sys.getswitchinterval() == before


def test_an_opted_in_switch_interval_holds_while_the_nodes_run_and_is_put_back(pair_factory):
    before = sys.getswitchinterval()
    assert before != 0.0005
    pair = pair_factory(extra_config={"gil_switch_interval_s": 0.0005})
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    prompt = long_prompt(40)
    output = decode(pair, "req-0", prompt, prefill(pair, "req-0", prompt), MAX_TOKENS)
    assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    pair.close()
    assert sys.getswitchinterval() == before
