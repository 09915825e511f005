"""Scheduler: budget, preemption and the connector protocol, driven without a model.

A fake connector plays both halves: its scheduler half offers external tokens named by the
request's ``kv_transfer_params``; its worker half completes a load after N polls of
``get_finished``. Each lifecycle test narrates its steps as (Na) schedule / (Nb) forward /
(Nc) update, and ends with the scheduler empty and ``check_integrity()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from kvbridge.kvmanager import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    MatchedTokens,
    ModelRunnerOutput,
    Request,
    RequestFinishedResult,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
    SlidingWindowSpec,
)

BLOCK_SIZE = 4
SAMPLED_TOKEN = 7


# ---------------------------------------------------------------------------- builders
@dataclass
class _FakeMetadata(KVConnectorMetadata):
    loads: dict[str, tuple[list[int], ...]] = field(default_factory=dict)


class _FakeConnector(KVConnectorBase):
    """Both halves in one object.

    Scheduler half: a request with ``kv_transfer_params["do_remote_prefill"]`` is offered
    ``remote_num_tokens - num_computed_tokens`` external tokens (async unless ``"sync"``); the
    first ``unknown_polls`` lookups answer None. ``do_remote_decode`` makes ``request_finished``
    delay the free. Worker half: a load settles after ``load_polls`` calls of ``get_finished``;
    ``fail_block_positions`` lists, per request, the block indexes whose load fails.
    """

    def __init__(self, *, load_polls: int = 2, unknown_polls: int = 0) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.load_polls = load_polls
        self.unknown_polls = unknown_polls
        self.calls: list[str] = []
        self.fail_block_positions: dict[str, list[int]] = {}
        self.finished_sending_next: set[str] = set()
        self.finished_recving_next: set[str] = set()
        self._lookups: dict[str, int] = {}
        self._new_loads: dict[str, tuple[list[int], ...]] = {}
        self._inflight: dict[str, int] = {}  # request id -> polls left
        self._load_block_ids: dict[str, tuple[list[int], ...]] = {}
        self._errors: set[int] = set()

    # scheduler half
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        self.calls.append("get_num_new_matched_tokens")
        params = request.kv_transfer_params or {}
        seen = self._lookups.get(request.request_id, 0)
        self._lookups[request.request_id] = seen + 1
        if seen < self.unknown_polls:
            return MatchedTokens(None, False)
        if not params.get("do_remote_prefill"):
            return MatchedTokens(0, False)
        num_external = params["remote_num_tokens"] - num_computed_tokens
        return MatchedTokens(num_external, not params.get("sync"))

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        self.calls.append("update_state_after_alloc")
        if num_external_tokens:
            self._new_loads[request.request_id] = blocks.get_block_ids()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> _FakeMetadata:
        self.calls.append("build_connector_meta")
        meta, self._new_loads = _FakeMetadata(loads=self._new_loads), {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append("update_connector_output")

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]):
        self.calls.append("request_finished")
        if (request.kv_transfer_params or {}).get("do_remote_decode"):
            return RequestFinishedResult(True, {"remote_block_ids": [list(g) for g in block_ids]})
        return RequestFinishedResult(False, None)

    # worker half
    def start_load_kv(self, forward_context: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id, block_ids in meta.loads.items():
            self._inflight[req_id] = self.load_polls
            self._load_block_ids[req_id] = block_ids
            for position in self.fail_block_positions.get(req_id, ()):
                self._errors.add(block_ids[0][position])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]):
        done = set(self.finished_recving_next)
        self.finished_recving_next = set()
        for req_id in list(self._inflight):
            self._inflight[req_id] -= 1
            if self._inflight[req_id] <= 0:
                del self._inflight[req_id]
                done.add(req_id)
        sending, self.finished_sending_next = self.finished_sending_next, set()
        return (sending or None), (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors


def _make_scheduler(
    *,
    num_blocks: int = 32,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    connector: KVConnectorBase | None = None,
    policy: str = "recompute",
) -> Scheduler:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    manager = KVCacheManager(config, max_model_len)
    return Scheduler(
        manager,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        connector=connector,
        kv_load_failure_policy=policy,
    )


def _make_request(
    scheduler: Scheduler,
    request_id: str,
    num_tokens: int,
    *,
    max_tokens: int = 1,
    do_remote_prefill: bool = False,
    sync_load: bool = False,
    do_remote_decode: bool = False,
    first_token: int = 1,
) -> Request:
    params: dict[str, Any] = {}
    if do_remote_prefill:
        params.update(do_remote_prefill=True, remote_num_tokens=num_tokens, sync=sync_load)
    if do_remote_decode:
        params["do_remote_decode"] = True
    request = Request(
        request_id,
        list(range(first_token, first_token + num_tokens)),
        SamplingParams(max_tokens=max_tokens),
        block_hasher=scheduler.kv_cache_manager.request_block_hasher,
        kv_transfer_params=params or None,
    )
    scheduler.add_request(request)
    return request


def _forward(scheduler_output: SchedulerOutput, connector: _FakeConnector | None):
    """(b): a fake model runner: one token per scheduled request, connector hooks in order."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    kv_output = None
    if connector is not None:
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv(None)
        sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
        kv_output = KVConnectorOutput(sending, recving, connector.get_block_ids_with_load_errors())
        connector.clear_connector_metadata()
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[SAMPLED_TOKEN] for _ in req_ids],
        kv_connector_output=kv_output,
    )


def _step(scheduler: Scheduler, connector: _FakeConnector | None = None):
    """(a) schedule, (b) forward, (c) update. Returns the schedule and the outputs."""
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output, _forward(scheduler_output, connector))
    return scheduler_output, outputs


def _num_free(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.get_num_free_blocks()


def _assert_scheduler_empty(scheduler: Scheduler) -> None:
    assert scheduler.is_empty()
    manager = scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.kv_cache_config.num_blocks - 1


def _block_hashes_set(scheduler: Scheduler, request_id: str) -> list[bool]:
    [blocks] = scheduler.kv_cache_manager.get_blocks(request_id).blocks
    return [block.block_hash is not None for block in blocks]


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
