"""Builders for the scheduler tests (``test_scheduler*.py``), driven without a model.

A fake connector plays both halves: its scheduler half offers external tokens named by the
request's ``kv_transfer_params``; its worker half completes a load after N polls of
``get_finished``. ``_step`` runs (a) schedule / (b) a fake forward / (c) update;
``_assert_scheduler_empty`` is the leak check that ends every lifecycle test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    SamplingParams,
    Scheduler,
    SchedulerOutput,
)

BLOCK_SIZE = 4
SAMPLED_TOKEN = 7


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
