"""Scheduler without external KV: token budget, ``max_num_seqs``, preemption by recompute,
chunked prefill off, and the order of KV cache events.

Builders (the fake connector, ``_step``) are in ``_scheduler_builders``. Each lifecycle test
narrates its steps as (Na) schedule / (Nb) forward / (Nc) update, and ends with the scheduler
empty and ``check_integrity()``.
"""

from __future__ import annotations

import pytest
import torch
from _scheduler_builders import (
    BLOCK_SIZE,
    SAMPLED_TOKEN,
    _assert_scheduler_empty,
    _FakeConnector,
    _make_request,
    _make_scheduler,
    _step,
)
from kvbridge.kvmanager import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    RequestStatus,
    Scheduler,
)


# ---------------------------------------------------------------------------- local scheduling
def test_budget_chunks_prefill_and_running_requests_go_first():
    scheduler = _make_scheduler(max_num_batched_tokens=10)
    _make_request(scheduler, "a", 7, max_tokens=3)
    _make_request(scheduler, "b", 9, max_tokens=3, first_token=50)  # no prefix shared with a
    # (1a) a takes 7 tokens, b gets the remaining 3 (chunked). (1c) only a has a token.
    output, outs = _step(scheduler)
    assert output.num_scheduled_tokens == {"a": 7, "b": 3}
    assert [o.request_id for o in outs] == ["a"]
    # (2a) running first: a decodes 1, b continues its prefill with 6 of its remaining 6.
    output, outs = _step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 6}
    assert output.scheduled_cached_reqs.new_token_ids == [[SAMPLED_TOKEN], list(range(53, 59))]
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    _assert_scheduler_empty(scheduler)


def test_max_num_seqs_caps_running_requests():
    scheduler = _make_scheduler(max_num_seqs=2)
    for name in "abc":
        _make_request(scheduler, name, 3, max_tokens=2)
    output, _ = _step(scheduler)
    assert sorted(output.num_scheduled_tokens) == ["a", "b"]  # c waits for a free seat
    _step(scheduler)  # a and b finish (max_tokens=2)
    output, _ = _step(scheduler)
    assert list(output.num_scheduled_tokens) == ["c"]
    assert output.finished_req_ids == {"a", "b"}  # the runner is told to drop their rows
    _step(scheduler)
    _assert_scheduler_empty(scheduler)


def test_no_room_preempts_the_last_running_request_by_recompute():
    # 6 usable blocks; a and b take 2 blocks each (8-token prompts), then decode into a 3rd.
    scheduler = _make_scheduler(num_blocks=7, max_model_len=20)
    _make_request(scheduler, "a", 8, max_tokens=8)
    b = _make_request(scheduler, "b", 8, max_tokens=8, first_token=50)
    _step(scheduler)  # (1) both prefilled: 4 blocks used
    _step(scheduler)  # (2) both decode position 8: a 3rd block each, 6 used
    for _ in range(3):
        _step(scheduler)  # (3-5) decode positions 9..11 inside the 3rd blocks
    # (6a) position 12 needs a 4th block for a: none free, so b (last running) is preempted.
    output, _ = _step(scheduler)
    assert output.preempted_req_ids == {"b"}
    assert list(output.num_scheduled_tokens) == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b and scheduler.num_preemptions == 1
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    # b resumed from scratch as a new request and still produced all its tokens.
    assert b.num_output_tokens == 8
    _assert_scheduler_empty(scheduler)


def test_chunked_prefill_off_requires_budget_for_max_model_len():
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        Scheduler(
            _make_scheduler().kv_cache_manager, block_size=BLOCK_SIZE, max_model_len=64,
            max_num_batched_tokens=32, enable_chunked_prefill=False,
        )


# ---------------------------------------------------------------------------- events
def test_take_events_returns_the_managers_then_the_connectors():
    class _EventfulConnector(_FakeConnector):
        def take_events(self):
            return ["connector-event"]

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    config = KVCacheConfig(8, [KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    manager = KVCacheManager(config, 16, enable_kv_cache_events=True)
    connector = _EventfulConnector()
    scheduler = Scheduler(manager, block_size=BLOCK_SIZE, max_model_len=16, connector=connector)
    _make_request(scheduler, "r", 5)
    _step(scheduler, connector)
    events = scheduler.take_events()
    # One full block of the 5-token prompt was stored; the connector's event comes last.
    assert [type(e).__name__ for e in events] == ["BlockStored", "str"]
    assert events[-1] == "connector-event"
    _assert_scheduler_empty(scheduler)
