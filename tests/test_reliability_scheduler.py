"""Reliability cases 1-3 of issue 15 (scheduler and load-failure policy), each from a report in
another system, each on kvbridge's own engine and connector over the loopback transport.

Every test narrates its steps, compares greedy tokens with a plain full-recompute forward of the
same model, and ends with both nodes empty (no request held, integrity true, every block free).
"""

from __future__ import annotations

import time

import pytest
from _engine_builders import reference_greedy
from _pd_builders import assert_pair_empty, long_prompt, make_pd_pair, prefill
from kvbridge.kvmanager import SamplingParams
from kvbridge.kvmanager.request import RequestStatus


@pytest.fixture
def pair_factory():
    pairs = []

    def build(**kwargs):
        pair = make_pd_pair(**kwargs)
        pairs.append(pair)
        return pair

    yield build
    for pair in pairs:
        pair.close()


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
