"""Reliability cases 1-3 of issue 15 (scheduler and load-failure policy), each from a report in
another system, each on kvbridge's own engine and connector over the loopback transport.

Every test narrates its steps, compares greedy tokens with a plain full-recompute forward of the
same model, and ends with both nodes empty (no request held, integrity true, every block free).
"""

from __future__ import annotations

import time

import torch
from _engine_builders import reference_greedy
from _pd_builders import assert_pair_empty, kv_bytes, long_prompt, prefill
from kvbridge.kvmanager import SamplingParams
from kvbridge.kvmanager.request import RequestStatus


def _step_until(engine, predicate, *, timeout_s: float = 20.0, what: str = "") -> list:
    """Step ``engine`` until ``predicate()``; returns every output seen on the way."""
    outputs = []
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        outputs.extend(engine.step())
        time.sleep(0.002)
    return outputs


def test_case1_a_landed_load_is_promoted_behind_a_head_that_cannot_allocate(pair_factory):
    """Issue 15, case 1 (a vLLM deadlock report: parked loads under KV pressure).

    D's pool has 10 blocks (9 usable). A's remote load lands while A holds 4 of them; B, at the
    head of the waiting queue (where a preemption puts it), needs 6 and only 5 are free. If the
    scheduler stops admission at B, A is never promoted, never frees its 4 blocks, and B never
    fits: both wait forever. A must be promoted past B and finish; B runs after it.
    """
    pair = pair_factory(num_blocks=10, max_model_len=128, load_timeout_s=20.0)
    d = pair.d
    prompt_a = long_prompt(60)  # 4 blocks; 60 + 4 output tokens stay inside them
    prompt_b = long_prompt(78, salt="A request served locally on the decode node. ")

    # (1) B runs on D alone: 78 prompt tokens in 5 blocks, decoding towards 90 tokens.
    d.add_request("B", prompt_b, SamplingParams(max_tokens=12))
    d.step()
    assert d.scheduler.running[0].request_id == "B"

    # (2) P prefills A; D admits it while P is slow to serve: A holds 4 blocks, its pull waits.
    params = prefill(pair, "A", prompt_a)
    pair.p_faults.serve_delay_s = 3.0  # longer than B takes to reach its preemption
    d.add_request("A", prompt_a, SamplingParams(max_tokens=4), params)
    d.step()
    assert d.scheduler.requests["A"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(d.kv_cache_manager.get_block_ids("A")[0]) == 4

    # (3) B grows to 80 tokens (still 5 blocks: 9 in use) and is preempted at its 81st: it goes to
    #     the head of the waiting queue needing 6 blocks, with 5 free.
    _step_until(d, lambda: d.scheduler.num_preemptions > 0, what="B's preemption")
    assert [r.request_id for r in d.scheduler.waiting] == ["B", "A"]
    assert d.kv_cache_manager.block_pool.get_num_free_blocks() == 5

    # (4) A's load lands; A is promoted past B, runs and finishes; then B fits and finishes.
    finished: dict[str, list[int]] = {}

    def collect(outputs):
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output.token_ids

    deadline = time.monotonic() + 15.0
    while len(finished) < 2:
        assert time.monotonic() < deadline, f"deadlock: finished {sorted(finished)}"
        collect(d.step())
        time.sleep(0.002)
    assert finished["A"] == reference_greedy(prompt_a, 4, hybrid=False)
    assert finished["B"] == reference_greedy(prompt_b, 12, hybrid=False)
    assert list(finished) == ["A", "B"]  # A first: it held the blocks B needed
    assert_pair_empty(pair)


def test_case2_a_failed_block_shared_by_a_second_request_is_recomputed_before_it_is_read(
    pair_factory,
):
    """Issue 15, case 2 (a vLLM report: recompute policy with shared blocks).

    Two requests with the same 64-token prompt (block size 16, 4 blocks) on D; the pull of
    block 2 fails for the first. The first lands, its progress is cut to token 32 (blocks 0-1
    are published, block 2 is not), and it recomputes blocks 2-3. The second arrives as the
    first lands: it may share only what holds the right bytes by the time it reads them (blocks
    0-1, and blocks the first recomputes in the same forward), never block 2's bytes as they
    were after the failed pull. Both outputs equal a run with no failure.
    """
    pair = pair_factory(load_failure_policy="recompute")
    d = pair.d
    prompt = long_prompt(64)
    expected = reference_greedy(prompt, 4, hybrid=False)

    # (1) P prefills r1; the holder refuses the block at position 2 as if it had changed.
    params = prefill(pair, "r1", prompt)
    p_block_2 = params["remote_block_ids"][0][2]
    p_bytes_2 = kv_bytes(pair.p, 0, p_block_2)
    pair.p_faults.fail_block_ids = {p_block_2}

    # (2) D admits r1 and pulls; the pull settles with block 2 failed (reported, not landed).
    d.add_request("r1", prompt, SamplingParams(max_tokens=4), params)
    _step_until(d, lambda: _stats(d)["num_failed_loads"] == 1, what="r1's failed pull")
    assert d.scheduler.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_block_2 = d.kv_cache_manager.get_block_ids("r1")[0][2]
    # Nothing of r1 is a prefix hit yet: its blocks are published only once its load settles.
    assert d.kv_cache_manager.block_pool.get_num_free_blocks() == d.config.num_blocks - 1 - 4

    # (3) r2, the same prompt, arrives now; the next step promotes r1 from token 32 and admits
    #     r2 behind it.
    d.add_request("r2", prompt, SamplingParams(max_tokens=4))
    outputs = d.step()
    r1 = d.scheduler.requests["r1"]
    assert r1.num_computed_tokens == 64  # resumed at 32, the 32 tokens of blocks 2-3 scheduled
    r2_blocks = d.kv_cache_manager.get_block_ids("r2")[0]
    # r2 shares r1's blocks 0-2 (block 3 holds the last token, computed by each); block 2 is
    # the one r1 recomputes in this same forward, whose KV is written before any attention.
    assert r2_blocks[:3] == d.kv_cache_manager.get_block_ids("r1")[0][:3]
    assert r2_blocks[2] == d_block_2
    for d_row, p_row in zip(kv_bytes(d, 0, d_block_2), p_bytes_2, strict=True):
        assert torch.equal(d_row, p_row)  # the recomputed bytes are P's, bit for bit

    # (4) Both finish with the tokens of a run without failure.
    finished = {o.request_id: o for o in outputs if o.finished}
    _collect_until_finished(d, finished, {"r1", "r2"})
    assert finished["r1"].token_ids == expected
    assert finished["r2"].token_ids == expected
    assert finished["r2"].num_cached_tokens == 48
    assert_pair_empty(pair)


def _collect_until_finished(engine, finished: dict, ids: set[str], timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while not ids <= set(finished):
        assert time.monotonic() < deadline, f"unfinished: {sorted(ids - set(finished))}"
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        time.sleep(0.002)


def _stats(engine):
    return engine.scheduler.connector.stats.snapshot()


def test_case3_a_failure_in_the_sliding_window_group_only_invalidates_that_block(pair_factory):
    """Issue 15, case 3 (a vLLM fix: a load failure in one hybrid group only).

    In the report the full-attention and sliding-window groups used the same local block id
    (7) for a request, and a failure in one group was applied to the other's block. In kvbridge
    a block id names one block of the node's single pool, so two groups never share a local
    id (asserted below), and a failed block is located by its group and position. A 90-token
    hybrid prompt (window 16): D's sliding-window group holds blocks 4-5 for the last token's
    window; only that group's block at position 5 fails on P. D reports exactly that block, keeps
    every full-attention block and the window's block 4, resumes at token 80 (no restart from
    scratch) and its tokens equal a single-node run.
    """
    pair = pair_factory(hybrid=True, load_failure_policy="recompute")
    d = pair.d
    prompt = long_prompt(90)
    params = prefill(pair, "r1", prompt)
    full_ids, swa_ids = params["remote_block_ids"]
    assert not set(full_ids) & set(swa_ids)  # P's pool: no id in two groups either
    pair.p_faults.fail_block_ids = {swa_ids[5]}

    worker = d.runner.connector.worker_half
    reported: set[int] = set()
    take_errors = worker.get_block_ids_with_load_errors

    def spy() -> set[int]:
        errors = take_errors()
        reported.update(errors)
        return errors

    worker.get_block_ids_with_load_errors = spy
    d.add_request("r1", prompt, SamplingParams(max_tokens=4), params)
    _step_until(
        d,
        lambda: "r1" in d.scheduler.requests
        and d.scheduler.requests["r1"].status == RequestStatus.RUNNING,
        what="r1 running",
    )
    local_full, local_swa = d.kv_cache_manager.get_block_ids("r1")
    assert not (set(local_full) & set(local_swa)) - {0}  # no local id in two groups
    assert reported == {local_swa[5]}  # the sliding-window block alone, not full's block 5
    assert _stats(d)["num_failed_loads"] == 1
    # Resumed at the failed block (token 80) and scheduled the rest: no restart from scratch.
    assert d.scheduler.requests["r1"].num_computed_tokens == 90
    pool = d.kv_cache_manager.block_pool
    for pos in range(5):  # full blocks 0-4 of the full-attention group are published
        assert pool.get_block(local_full[pos]).block_hash is not None, pos
    assert pool.get_block(local_swa[4]).block_hash is not None

    finished: dict = {}
    _collect_until_finished(d, finished, {"r1"})
    assert finished["r1"].token_ids == reference_greedy(prompt, 4, hybrid=True)
    assert_pair_empty(pair)
