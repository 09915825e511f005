"""Engine end to end on the seeded tiny models: greedy tokens equal a no-cache full recompute
under prefix caching on/off, chunked prefill, preemption and the hybrid (full + sliding window)
model; bad input is refused per request; every test ends with check_integrity and a free pool.
The connector inside the engine is in ``test_engine_connector.py``."""

from __future__ import annotations

import pytest
import torch
from _engine_assertions import (
    MAX_TOKENS,
    _assert_all_blocks_free,
    _assert_matches_reference,
    _assert_runner_rows_match_manager,
)
from _engine_builders import (
    BLOCK_SIZE,
    make_engine,
    min_blocks_for,
    reference_greedy,
    text_prompt,
    tiny_model,
    varied_prompts,
)
from kvbridge.kernels.model import prompt_logprobs
from kvbridge.kvmanager import SamplingParams


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["apc", "no-apc"])
def test_greedy_tokens_equal_full_recompute(hybrid: bool, prefix_caching: bool):
    engine = make_engine(hybrid=hybrid, prefix_caching=prefix_caching)
    _assert_matches_reference(engine, varied_prompts(), hybrid=hybrid)
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("chunk_size", [5, BLOCK_SIZE, 13])
def test_chunked_prefill_gives_the_same_tokens(hybrid: bool, chunk_size: int):
    # A budget of 5 or 13 tokens splits prompts off block boundaries; 8 splits on them.
    engine = make_engine(hybrid=hybrid, chunk_size=chunk_size)
    _assert_matches_reference(engine, varied_prompts(), hybrid=hybrid)
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_small_pool_preempts_and_still_matches(hybrid: bool):
    # The smallest accepted pool holds one 96-token request; seven prompts of up to 59 tokens
    # cannot all run together, so running requests are preempted and recomputed.
    engine = make_engine(hybrid=hybrid, num_blocks=min_blocks_for(96, hybrid=hybrid))
    prompts = varied_prompts()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = output.token_ids
        _assert_runner_rows_match_manager(engine)
        engine.check_integrity()
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == reference_greedy(prompt, MAX_TOKENS, hybrid=hybrid)
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_second_run_of_shared_prefix_workload_hits_the_prefix_cache(hybrid: bool):
    engine = make_engine(hybrid=hybrid)
    prompts = varied_prompts()[-2:]  # two 53-token prompts sharing 41 tokens
    engine.generate(prompts, max_tokens=MAX_TOKENS)
    engine.kv_cache_manager.make_prefix_cache_stats()  # start counting from the second run
    outputs = _assert_matches_reference(engine, prompts, hybrid=hybrid)
    stats = engine.kv_cache_manager.make_prefix_cache_stats()
    # Every block of both prompts is cached (the pool never evicted); the hit stops at the last
    # full block before the final token: (53 - 1) // 8 * 8 = 48 tokens each. In the hybrid model
    # the sliding group keeps its last window's blocks cached too, so it agrees.
    assert [o.num_cached_tokens for o in outputs] == [48, 48]
    assert stats.queries == 2 * 53 and stats.hits == 2 * 48
    _assert_all_blocks_free(engine)


def test_prompt_logprobs_equal_the_full_forward_under_chunking():
    engine = make_engine(chunk_size=7)
    prompt = text_prompt(3 * BLOCK_SIZE + 2)
    engine.generate([prompt], max_tokens=2)  # cache the prompt: logprobs must not read it
    engine.add_request("lp", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    logits = tiny_model(hybrid=False).forward_full(torch.tensor(prompt))
    expected = prompt_logprobs(logits, torch.tensor(prompt)).token_logprobs.tolist()
    assert final is not None and final.prompt_logprobs[0] is None
    assert final.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert final.num_cached_tokens == 0  # prompt logprobs skip reading the prefix cache
    _assert_all_blocks_free(engine)


def test_stop_token_finishes_with_stop():
    prompt = text_prompt(BLOCK_SIZE + 3)
    expected = reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    engine = make_engine()
    stop_at = expected[2]
    first = expected.index(stop_at)  # the stop token may already occur earlier
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop_at,))
    [output] = engine.generate([prompt], sampling_params=params)
    assert output.token_ids == expected[: first + 1]
    assert output.finish_reason == "stop"
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", None, "empty prompt"),
        ([], None, "empty prompt"),
        (list(range(97)), None, "longer than max_model_len=96"),
        ([65, 258], None, "token id 258 is outside"),
        ([65, -1], None, "token id -1 is outside"),
    ],
    ids=["empty-text", "empty-ids", "too-long", "id-past-vocab", "negative-id"],
)
def test_bad_request_is_refused_and_the_engine_keeps_serving(prompt, params, match):
    engine = make_engine()
    good = text_prompt(2 * BLOCK_SIZE + 1)
    engine.add_request("good", good, SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()  # the good request is mid-flight when the bad one arrives
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        tokens = [o.token_ids for o in engine.step() if o.request_id == "good"] or tokens
    assert tokens == [reference_greedy(good, MAX_TOKENS, hybrid=False)]
    _assert_all_blocks_free(engine)


def test_max_tokens_below_one_is_refused():
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        SamplingParams(max_tokens=0)
    engine = make_engine()
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate([text_prompt(4)], max_tokens=0)
    # Nothing was queued; the engine still serves.
    assert not engine.has_unfinished_requests()
    _assert_matches_reference(engine, [text_prompt(5)], hybrid=False)
    _assert_all_blocks_free(engine)


def test_duplicate_request_id_is_refused():
    engine = make_engine()
    engine.add_request("a", text_prompt(3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", text_prompt(3))
    engine.abort_request("a")
    _assert_all_blocks_free(engine)


def test_abort_mid_generation_frees_blocks_and_others_finish():
    engine = make_engine()
    keep, drop = text_prompt(BLOCK_SIZE + 1), text_prompt(3 * BLOCK_SIZE, offset=20)
    engine.add_request("keep", keep, SamplingParams(max_tokens=MAX_TOKENS))
    engine.add_request("drop", drop, SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    engine.step()
    [aborted] = engine.abort_request(["drop", "unknown-id"])
    assert aborted.finish_reason == "abort" and aborted.finished
    assert engine.abort_request("drop") == []  # a second abort is ignored
    tokens = []
    while engine.has_unfinished_requests():
        tokens = [o.token_ids for o in engine.step()] or tokens
    assert tokens == [reference_greedy(keep, MAX_TOKENS, hybrid=False)]
    _assert_all_blocks_free(engine)


def test_step_with_nothing_to_do_returns_nothing():
    engine = make_engine()
    assert engine.step() == []
    _assert_all_blocks_free(engine)


def test_pool_too_small_for_max_model_len_is_refused():
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_engine(num_blocks=min_blocks_for(96, hybrid=False) - 1)
