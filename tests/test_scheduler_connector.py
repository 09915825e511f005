"""Scheduler and the connector protocol: hooks in vLLM's order, remote prefill through
``WAITING_FOR_REMOTE_KVS``, "ask again" lookups, delayed free, aborts and sends/loads settling.

Builders (the fake connector, ``_step``) are in ``_scheduler_builders``. Each lifecycle test
narrates its steps as (Na) schedule / (Nb) forward / (Nc) update, and ends with the scheduler
empty and ``check_integrity()``.
"""

from __future__ import annotations

from _scheduler_builders import (
    SAMPLED_TOKEN,
    _assert_scheduler_empty,
    _block_hashes_set,
    _FakeConnector,
    _make_request,
    _make_scheduler,
    _num_free,
    _step,
)
from kvbridge.kvmanager import RequestStatus


# ---------------------------------------------------------------------------- connector protocol
def test_connector_hooks_are_called_in_vllm_order():
    connector = _FakeConnector()
    scheduler = _make_scheduler(connector=connector)
    _make_request(scheduler, "r", 5, max_tokens=1)
    _step(scheduler, connector)
    assert connector.calls == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",  # r finished in update_from_output, before its blocks were freed
        "update_connector_output",
    ]
    _step(scheduler, connector)  # an empty step still builds metadata and reads the output
    assert connector.calls[-2:] == ["build_connector_meta", "update_connector_output"]
    _assert_scheduler_empty(scheduler)


def test_remote_prefill_waits_for_kvs_then_caches_and_recomputes_last_token():
    connector = _FakeConnector(load_polls=2)
    scheduler = _make_scheduler(connector=connector)
    request = _make_request(scheduler, "d", 11, do_remote_prefill=True)
    # (1a) all 11 tokens are external and async: 3 blocks allocated, nothing scheduled.
    output, _ = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == 0
    # delay_cache_blocks: no hash is published before the data lands.
    assert _block_hashes_set(scheduler, "d") == [False, False, False]
    # (1b/1c) first poll: still in flight. (2b/2c) second poll: finished_recving.
    _step(scheduler, connector)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # (3a) the load landed: cache_blocks publishes the 2 full blocks, and progress is
    # min(11, 11 - 1) = 10, so only the last prompt token is computed (for its logits).
    output, outs = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {"d": 1}
    assert [new.num_computed_tokens for new in output.scheduled_new_reqs] == [10]
    assert outs[0].new_token_ids == [SAMPLED_TOKEN] and outs[0].finish_reason == "length"
    assert outs[0].num_cached_tokens == 11
    _assert_scheduler_empty(scheduler)


def test_remote_prefill_of_whole_blocks_recomputes_the_last_block():
    connector = _FakeConnector(load_polls=1)
    scheduler = _make_scheduler(connector=connector)
    request = _make_request(scheduler, "d", 8, do_remote_prefill=True)
    _step(scheduler, connector)  # (1) allocate 2 blocks; the load settles at this poll
    # (2a) 8 tokens loaded, progress min(8, 7) = 7: block 1 is not full, so only block 0 is
    # published, and the 8th token is recomputed into block 1.
    output, _ = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {"d": 1}
    assert request.num_computed_tokens == 8 and request.num_output_tokens == 1
    _assert_scheduler_empty(scheduler)


def test_unknown_match_asks_again_next_step():
    connector = _FakeConnector(unknown_polls=2, load_polls=1)
    scheduler = _make_scheduler(connector=connector)
    request = _make_request(scheduler, "d", 6, do_remote_prefill=True)
    # (1a, 2a) None: the request is skipped, holds no block, stays WAITING.
    for _ in range(2):
        output, _ = _step(scheduler, connector)
        assert output.num_scheduled_tokens == {}
        assert request.status == RequestStatus.WAITING
        assert _num_free(scheduler) == 31
    # (3a) the connector knows now: allocation and the async wait.
    _step(scheduler, connector)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.calls.count("get_num_new_matched_tokens") == 3
    while scheduler.has_unfinished_requests():
        _step(scheduler, connector)
    _assert_scheduler_empty(scheduler)


def test_skipped_request_does_not_block_the_ones_behind_it():
    connector = _FakeConnector(unknown_polls=1)
    scheduler = _make_scheduler(connector=connector)
    _make_request(scheduler, "first", 6)
    _make_request(scheduler, "second", 6)
    # (1a) both lookups answer None this step (unknown_polls is per request): nothing runs.
    output, _ = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {}
    assert [r.request_id for r in scheduler.waiting] == ["first", "second"]  # order kept
    output, _ = _step(scheduler, connector)
    assert list(output.num_scheduled_tokens) == ["first", "second"]
    _assert_scheduler_empty(scheduler)


def test_delay_free_keeps_blocks_until_finished_sending():
    connector = _FakeConnector()
    scheduler = _make_scheduler(connector=connector)
    _make_request(scheduler, "p", 9, do_remote_decode=True)
    # (1) prefill and first token: finished, but request_finished asked to delay the free.
    _, outs = _step(scheduler, connector)
    assert outs[0].finish_reason == "length"
    assert outs[0].kv_transfer_params == {"remote_block_ids": [[1, 2, 3]]}
    assert scheduler.held_req_ids == {"p"} and _num_free(scheduler) == 28
    # (2) the peer has not read yet: still held.
    _step(scheduler, connector)
    assert _num_free(scheduler) == 28
    # (3) finished_sending: the blocks go back; a repeated report is ignored.
    connector.finished_sending_next = {"p"}
    _step(scheduler, connector)
    connector.finished_sending_next = {"p"}
    _step(scheduler, connector)
    _assert_scheduler_empty(scheduler)


def test_abort_while_load_in_flight_keeps_blocks_until_it_settles():
    connector = _FakeConnector(load_polls=3)
    scheduler = _make_scheduler(num_blocks=5, max_model_len=16, connector=connector)
    _make_request(scheduler, "d", 16, do_remote_prefill=True)
    _step(scheduler, connector)  # (1) 4 blocks allocated (all usable blocks), load started
    # (2) abort: the transfer still writes into those blocks, so they stay referenced.
    [aborted] = scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert aborted.finish_reason == "abort"
    assert scheduler.held_req_ids == {"d"} and _num_free(scheduler) == 0
    # (3) another request cannot be handed the blocks while the load is in flight.
    _make_request(scheduler, "other", 4)
    output, _ = _step(scheduler, connector)
    assert output.num_scheduled_tokens == {}
    # (4) the load settles (3rd poll): the aborted request's blocks are released, exactly once.
    _step(scheduler, connector)
    assert scheduler.held_req_ids == set()
    while scheduler.has_unfinished_requests():
        _step(scheduler, connector)
    _assert_scheduler_empty(scheduler)


def test_finished_sending_and_recving_in_one_step_free_once():
    connector = _FakeConnector(load_polls=100)
    scheduler = _make_scheduler(connector=connector)
    _make_request(scheduler, "x", 8, do_remote_prefill=True, do_remote_decode=True)
    _step(scheduler, connector)  # (1) load in flight
    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    # Held for two reasons: the load in flight, and request_finished's delay_free.
    assert scheduler.held_req_ids == {"x"}
    # (2) the worker reports both completions in the same step.
    connector._inflight.clear()
    connector.finished_recving_next = {"x"}
    connector.finished_sending_next = {"x"}
    _step(scheduler, connector)
    # (3) a late duplicate of both races the free: ignored.
    connector.finished_recving_next = {"x"}
    connector.finished_sending_next = {"x"}
    _step(scheduler, connector)
    _assert_scheduler_empty(scheduler)
