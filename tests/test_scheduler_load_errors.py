"""Scheduler and the load-failure policy: async and sync load errors under ``"recompute"``
(truncate to the first bad block, or restart from scratch when a sliding window's blocks do not
allow it) and ``"fail"``; no block leaks either way.

Builders (the fake connector, ``_step``) are in ``_scheduler_builders``. Each lifecycle test
narrates its steps as (Na) schedule / (Nb) forward / (Nc) update, and ends with the scheduler
empty and ``check_integrity()``.
"""

from __future__ import annotations

import torch
from _scheduler_builders import (
    BLOCK_SIZE,
    _assert_scheduler_empty,
    _block_hashes_set,
    _FakeConnector,
    _forward,
    _make_request,
    _make_scheduler,
    _step,
)
from kvbridge.kvmanager import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVConnectorBase,
    RequestStatus,
    Scheduler,
    SlidingWindowSpec,
)


# ---------------------------------------------------------------------------- load errors
def test_async_load_error_with_recompute_truncates_to_the_first_bad_block():
    connector = _FakeConnector(load_polls=1)
    scheduler = _make_scheduler(connector=connector, policy="recompute")
    request = _make_request(scheduler, "d", 12, do_remote_prefill=True)
    connector.fail_block_positions["d"] = [1, 2]
    _step(scheduler, connector)  # (1) 3 blocks; blocks 1 and 2 fail, the load settles
    # (2a) progress is cut to the start of block 1 (token 4); only block 0 is published, and
    # tokens 4..11 are recomputed in this step.
    output, outs = _step(scheduler, connector)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 4
    assert output.num_scheduled_tokens == {"d": 8}
    assert request.num_output_tokens == 1 and outs[0].finish_reason == "length"
    _assert_scheduler_empty(scheduler)


def test_async_load_error_with_fail_finishes_with_error():
    connector = _FakeConnector(load_polls=1)
    scheduler = _make_scheduler(connector=connector, policy="fail")
    request = _make_request(scheduler, "d", 12, do_remote_prefill=True)
    _make_request(scheduler, "fine", 5)
    connector.fail_block_positions["d"] = [2]
    # (1) d's load settles with a bad block: d ends with FINISHED_ERROR, its blocks are freed.
    _, outs = _step(scheduler, connector)
    errors = [o for o in outs if o.request_id == "d"]
    assert [o.finish_reason for o in errors] == ["error"]
    assert request.status == RequestStatus.FINISHED_ERROR
    # The node keeps serving: "fine" ran in the same step.
    assert [o.finish_reason for o in outs if o.request_id == "fine"] == ["length"]
    _assert_scheduler_empty(scheduler)


def test_sync_load_error_drops_the_token_and_recomputes():
    connector = _FakeConnector()
    scheduler = _make_scheduler(connector=connector, policy="recompute")
    request = _make_request(scheduler, "d", 10, do_remote_prefill=True, sync_load=True)
    connector.fail_block_positions["d"] = [1]
    # (1a) sync: 9 external tokens (the last is computed), scheduled in the same step.
    # (1c) block 1 failed inside the forward: the sampled token is void, progress cut to 4.
    output, outs = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {"d": 1}
    assert outs == [] and request.num_computed_tokens == 4
    # The bad block lost its hash: no later request may hit it.
    assert _block_hashes_set(scheduler, "d")[1] is False
    # (2) tokens 4..9 recomputed; the request completes.
    output, outs = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {"d": 6}
    assert outs[0].finish_reason == "length"
    _assert_scheduler_empty(scheduler)


def test_sync_load_error_of_a_request_aborted_during_the_step_is_ignored():
    connector = _FakeConnector()
    scheduler = _make_scheduler(connector=connector, policy="recompute")
    _make_request(scheduler, "d", 10, do_remote_prefill=True, sync_load=True)
    connector.fail_block_positions["d"] = [1]
    # (1a) sync load of 9 tokens scheduled with the last token.
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"d": 1}
    # An abort lands between schedule and update: d's blocks are freed at once (no async
    # load holds them), so its load range must not be looked up again.
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    # (1b) the forward reports d's block 1 bad; (1c) nothing is left to recover: no output.
    outs = scheduler.update_from_output(output, _forward(output, connector))
    assert outs == []
    _assert_scheduler_empty(scheduler)


# -------------------------------------------------------------- load errors with a sliding window
def _make_hybrid_scheduler(*, connector: KVConnectorBase, sliding_window: int) -> Scheduler:
    common = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(
        32,
        [
            KVCacheGroupSpec(["model.layers.0.self_attn"], FullAttentionSpec(**common)),
            KVCacheGroupSpec(
                ["model.layers.1.self_attn"],
                SlidingWindowSpec(**common, sliding_window=sliding_window),
            ),
        ],
    )
    return Scheduler(
        KVCacheManager(config, 64), block_size=BLOCK_SIZE, max_model_len=64,
        connector=connector, kv_load_failure_policy="recompute",
    )


def test_load_error_before_the_sliding_window_restarts_from_scratch():
    connector = _FakeConnector(load_polls=1)
    scheduler = _make_hybrid_scheduler(connector=connector, sliding_window=BLOCK_SIZE)
    _make_request(scheduler, "d", 16, do_remote_prefill=True)
    connector.fail_block_positions["d"] = [1]
    # (1a) 16 external tokens: the sliding group only needs the last window, so its first
    # three blocks are the null block; the full group gets four real blocks.
    _step(scheduler, connector)
    full_ids, sliding_ids = scheduler.kv_cache_manager.get_block_ids("d")
    assert sliding_ids[:3] == [0, 0, 0] and 0 not in full_ids
    # (2a) block 1 failed: resuming at token 4 would read the window through null blocks, so
    # the request frees everything and recomputes all 16 tokens, without asking the connector.
    output, outs = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {"d": 16}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert connector.calls.count("get_num_new_matched_tokens") == 1
    assert outs[0].finish_reason == "length"
    _assert_scheduler_empty(scheduler)


def test_load_error_with_no_null_block_resumes_at_the_bad_block():
    connector = _FakeConnector(load_polls=1)
    scheduler = _make_hybrid_scheduler(connector=connector, sliding_window=8 * BLOCK_SIZE)
    _make_request(scheduler, "d", 16, do_remote_prefill=True)
    connector.fail_block_positions["d"] = [2]
    _step(scheduler, connector)  # (1) the 32-token window covers the prompt: no null block
    assert 0 not in scheduler.kv_cache_manager.get_block_ids("d")[1]
    # (2a) every block before the bad one is real in both groups: resume at token 8.
    output, _ = _step(scheduler, connector)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 8
    assert output.num_scheduled_tokens == {"d": 8}
    _assert_scheduler_empty(scheduler)


def test_sync_load_error_before_the_window_moves_the_running_request_back():
    connector = _FakeConnector()
    scheduler = _make_hybrid_scheduler(connector=connector, sliding_window=BLOCK_SIZE)
    request = _make_request(scheduler, "d", 16, do_remote_prefill=True, sync_load=True)
    connector.fail_block_positions["d"] = [1]
    # (1a) 15 external tokens loaded inside the forward, the last token computed.
    # (1c) block 1 failed and the sliding group's early blocks are null: the request leaves
    # the running queue, its token is void and its blocks are freed.
    output, outs = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {"d": 1} and outs == []
    assert request.status == RequestStatus.PREEMPTED and scheduler.waiting[0] is request
    # (2a) the runner is told to drop d's row, and d comes back as a new request from token 0.
    output, outs = _step(scheduler, connector)
    assert output.preempted_req_ids == {"d"}
    assert [(n.req_id, n.num_computed_tokens) for n in output.scheduled_new_reqs] == [("d", 0)]
    assert output.num_scheduled_tokens == {"d": 16}
    assert outs[0].finish_reason == "length"
    _assert_scheduler_empty(scheduler)
