"""Builders for driving vLLM's real ``Scheduler`` with kvbridge's scheduler half on CPU.

vLLM's own connector unit tests (``tests/v1/kv_connector/unit/utils.py``) build a
``Scheduler`` from a ``VllmConfig`` with ``DeviceConfig("cpu")`` and a hand-made
``KVCacheConfig``, add ``Request`` objects and feed ``update_from_output`` hand-made
``ModelRunnerOutput`` / ``KVConnectorOutput``: no worker, no model forward. These builders do
the same for ``KVBridgeConnector`` (``kv_connector_module_path="kvbridge.connector.vllm"``):

    make_scheduler(role)           the Scheduler (its connector is our scheduler half), with the
                                   worker half's handshake delivered as EngineCore does
    make_request(...)              a vLLM Request with block hashes (sha256, as EngineCore)
    ticket_for(...)                the kv_transfer_params P's request_finished hands D
    Step / step(...)               one schedule() + update_from_output(), the step's decoded
                                   KVBridgeConnectorMetadata kept for assertions
    assert_scheduler_empty(...)    no request left, every block free (vLLM's own check)

The model config reads the tiny Llama of ``kvbridge.connector.serve.demo.tiny_checkpoint``
(written once, no download); nothing here loads weights.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from kvbridge.connector.metadata import (
    KVBridgeConnectorMetadata,
    KVBridgeWorkerMeta,
    PullReport,
    StatsDelta,
    WorkerHandshake,
    decode_metadata,
    encode_worker_meta,
)
from kvbridge.connector.serve.demo import tiny_checkpoint as _model
from kvbridge.connector.transfer_params import RemotePrefillParams
from kvbridge.connector.vllm.adapter import KVBridgeConnector, _Handshake, _WorkerReport
from kvbridge.transport import BlockIdentity
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "BLOCK_SIZE",
    "NUM_BLOCKS",
    "WINDOW",
    "Step",
    "assert_scheduler_empty",
    "connector_of",
    "make_request",
    "make_scheduler",
    "model_runner_output",
    "num_free_blocks",
    "run_to_end",
    "step",
    "ticket_for",
    "worker_report",
]

BLOCK_SIZE = 32
NUM_BLOCKS = 64  # block 0 is vLLM's null block: 63 usable
EOS_TOKEN_ID = 2
HASH_ALGO = "sha256"
WORKER_HOST, WORKER_PORT = "127.0.0.1", 47001
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
WINDOW = 64  # the hybrid scheduler's sliding window (tiny_checkpoint.HYBRID)

_ids = itertools.count(1)


def _vllm_config(
    role: str, engine_id: str, policy: str, extra: dict[str, Any] | None, hybrid: bool = False,
    kv_events: bool = False, hash_algo: str = HASH_ALGO, async_scheduling: bool = False,
    model: str | None = None,
) -> VllmConfig:
    model_config = ModelConfig(
        model=model or str(_model.tiny_llama(hybrid=hybrid)),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=1024,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="kvbridge.connector.vllm",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config=dict(extra or {}),
        kv_load_failure_policy=policy,
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if kv_events else None,
    )


def make_scheduler(
    role: str = "kv_consumer",
    *,
    engine_id: str | None = None,
    policy: str = "fail",
    extra: dict[str, Any] | None = None,
    hybrid: bool = False,
    tp_size: int | None = None,
    incarnation: str | None = None,
    worker_port: int = WORKER_PORT,
    kv_events: bool = False,
    hash_algo: str = HASH_ALGO,
    async_scheduling: bool = False,
    model: str | None = None,
) -> Scheduler:
    """A real vLLM ``Scheduler`` whose connector is ``KVBridgeConnector``'s scheduler half.

    ``tp_size``: the workers' handshakes name their ranks as a tensor-parallel engine's do
    (rank ``r`` of ``tp_size``, the tiny Llama's 2 KV heads, head-major; port
    ``WORKER_PORT + r``, incarnation ``<engine_id>-inc-<r + 1>``); None: one handshake that
    names no heads.

    The KV cache is one full-attention group of the tiny Llama's two layers (2 KV heads,
    head size 32, float32), ``NUM_BLOCKS`` blocks of ``BLOCK_SIZE`` tokens. ``hybrid``: the
    hybrid Llama's two groups as vLLM's hybrid allocator makes them, sliding-window
    (``WINDOW`` tokens; layers 0 and 2) then full attention (layers 1 and 3), sharing the
    ``NUM_BLOCKS`` blocks. The worker half's handshake (host, port, incarnation) is
    delivered the way EngineCore does at start-up (``incarnation`` default
    ``"<engine_id>-inc-1"``; a node with an ``index_url`` needs a number). ``kv_events``:
    vLLM's own KV events on (``KVEventsConfig``, the "null" publisher). ``hash_algo``: vLLM's
    ``prefix_caching_hash_algo`` (``make_request`` hashes with ``HASH_ALGO``).
    ``async_scheduling``: vLLM's ``AsyncScheduler`` (the next step may be scheduled before
    the last one's output is given back), as vLLM runs by default on a GPU. ``model``: the
    checkpoint's path (default the tiny Llama's; the geometry above stays).
    """
    assert incarnation is None or tp_size is None, "incarnation names one rank's"
    engine_id = engine_id or role.removeprefix("kv_")
    vllm_config = _vllm_config(role, engine_id, policy, extra, hybrid, kv_events, hash_algo,
                               async_scheduling, model)
    geometry = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups = [KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(**geometry))]
    if hybrid:
        assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        layer = "model.layers.{}.self_attn.attn".format
        groups = [
            KVCacheGroupSpec([layer(0), layer(2)],
                             SlidingWindowSpec(**geometry, sliding_window=WINDOW)),
            KVCacheGroupSpec([layer(1), layer(3)], FullAttentionSpec(**geometry)),
        ]
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    # (vLLM's CPU platform turns async scheduling off in the config; on a GPU it stays on)
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    identity = BlockIdentity(  # what the worker half's transport would announce
        model_name=connector_of(scheduler).config.model_name,  # as the worker half names it
        model_revision=connector_of(scheduler).config.model_revision,  # (the same)
        block_size=BLOCK_SIZE,
        hash_fn_name=str(vllm_config.cache_config.prefix_caching_hash_algo),
        **connector_of(scheduler)._identity,  # dtypes and hash root, as the adapter's worker
    )
    handshakes = {}
    for rank in range(tp_size or 1):
        tp = {} if tp_size is None else dict(
            tp_rank=rank, tp_size=tp_size, total_num_kv_heads=2, heads_sliceable=True)
        handshake = WorkerHandshake(
            engine_id=engine_id, incarnation=incarnation or f"{engine_id}-inc-{rank + 1}",
            host=WORKER_HOST, port=worker_port + rank, identity=identity, **tp)
        handshakes[(0, rank)] = _Handshake(msgspec.msgpack.encode(handshake))
    connector_of(scheduler).set_xfer_handshake_metadata_pp_aware(handshakes)
    return scheduler


def connector_of(scheduler: Scheduler) -> KVBridgeConnector:
    connector = scheduler.get_kv_connector()
    assert isinstance(connector, KVBridgeConnector)
    return connector


def make_request(
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 3,
    kv_transfer_params: dict[str, Any] | None = None,
    request_id: str | None = None,
) -> Request:
    """A vLLM ``Request`` as EngineCore builds it: block hashes by sha256 over 32-token
    blocks, ``kv_transfer_params`` in ``SamplingParams.extra_args`` (the same dict)."""
    hash_fn = get_hash_fn_by_name(HASH_ALGO)
    init_none_hash(hash_fn)
    extra_args = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    sampling_params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, extra_args=extra_args
    )
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn),
    )


def ticket_for(
    num_tokens: int,
    p_block_ids: list[int] | None = None,
    *,
    remote_request_id: str = "p-req-1",
    **overrides: Any,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` P's ``request_finished`` returns for a ``num_tokens`` prompt
    (``RemotePrefillParams.to_dict()``, JSON-like): P's blocks ``p_block_ids`` (default 41,
    42, ...), then ``overrides`` applied as they are (so a test can spoil any field)."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    ids = p_block_ids if p_block_ids is not None else list(range(41, 41 + num_blocks))
    params = RemotePrefillParams(
        remote_engine_id="prefill",
        remote_incarnation="prefill-inc-1",
        remote_request_id=remote_request_id,
        remote_host="127.0.0.1",
        remote_port=47000,
        remote_block_ids=(tuple(ids),),
        remote_num_tokens=num_tokens,
        remote_block_size=BLOCK_SIZE,
        lease_expires_at=time.time() + 30.0,
    ).to_dict()
    params.update(overrides)
    return params


def worker_report(*, pulls: Iterable[PullReport] = (), tp_rank: int = 0, step_id: int = 0,
                  offload_outcomes: Iterable[tuple[int, bytes, bool, bool]] = (),
                  store_incarnation: int = 0, **counters: int) -> _WorkerReport:
    """The ``kv_connector_worker_meta`` a worker half (rank ``tp_rank``) sends with these
    counter increments and settled ``pulls`` at the end of step ``step_id`` (0: unnumbered);
    ``offload_outcomes`` from the store of ``store_incarnation`` (``OffloadOutcome`` tuples)."""
    meta = KVBridgeWorkerMeta(tp_rank=tp_rank, stats=StatsDelta(counters=dict(counters)),
                              pulls=list(pulls), step_id=step_id,
                              offload_outcomes=list(offload_outcomes),
                              store_incarnation=store_incarnation)
    return _WorkerReport([encode_worker_meta(meta)])


def model_runner_output(
    scheduler_output: SchedulerOutput,
    *,
    finished_sending: Iterable[str] | None = None,
    finished_recving: Iterable[str] | None = None,
    failed_recving: Iterable[str] | None = None,
    invalid_block_ids: Iterable[int] | None = None,
    worker_meta: Any = None,
    token_id: int = 7,
) -> ModelRunnerOutput:
    """What the worker would answer to ``scheduler_output``: one sampled token per scheduled
    request, and the connector's finished ids / failed blocks as given."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    kv = (finished_sending, finished_recving, failed_recving, invalid_block_ids, worker_meta)
    has_kv = any(x is not None for x in kv)
    kv_output = (
        KVConnectorOutput(
            finished_sending=None if finished_sending is None else set(finished_sending),
            finished_recving=None if finished_recving is None else set(finished_recving),
            failed_recving=set(failed_recving or ()),
            invalid_block_ids=set(invalid_block_ids or ()),
            kv_connector_worker_meta=worker_meta,
        )
        if has_kv
        else None
    )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[token_id] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_output,
    )


@dataclass
class Step:
    """One engine step: what was scheduled, the connector's orders, what came out."""

    output: SchedulerOutput
    meta: KVBridgeConnectorMetadata
    engine_outputs: dict[int, Any] = field(default_factory=dict)

    @property
    def scheduled(self) -> dict[str, int]:
        return dict(self.output.num_scheduled_tokens)

    def finished(self) -> dict[str, Any]:
        """request id -> its EngineCoreOutput, for the requests that finished this step."""
        return {
            out.request_id: out
            for outs in self.engine_outputs.values()
            for out in outs.outputs
            if out.finish_reason is not None
        }


def step(scheduler: Scheduler, **kv: Any) -> Step:
    """``schedule()``, decode the adapter's msgpack metadata, ``update_from_output`` with a
    hand-made worker answer (``kv``: ``model_runner_output``'s connector arguments)."""
    output = scheduler.schedule()
    payload = output.kv_connector_metadata
    assert payload is not None, "build_connector_meta runs every step"
    meta = decode_metadata(payload.payload)
    engine_outputs = scheduler.update_from_output(output, model_runner_output(output, **kv))
    return Step(output=output, meta=meta, engine_outputs=engine_outputs)


def run_to_end(scheduler: Scheduler, *, max_steps: int = 16) -> dict[str, Any]:
    """Step with plain outputs until no request is left; the finished requests' outputs."""
    finished: dict[str, Any] = {}
    for _ in range(max_steps):
        if not scheduler.requests:
            return finished
        finished.update(step(scheduler).finished())
    raise AssertionError(f"still unfinished after {max_steps} steps: {list(scheduler.requests)}")


def num_free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """The scheduler is empty and every block free (vLLM's ``assert_scheduler_empty``): no
    request in any queue or table, no per-request block table, every block but the null block
    back in the free queue with a zero reference count."""
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert len(scheduler.waiting) == 0
    assert len(scheduler.kv_holding_waiting) == 0
    assert not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids
    assert not scheduler.failed_recving_kv_req_ids
    assert not scheduler._inflight_prefills
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not manager.req_to_blocks, f"block tables left: {list(manager.req_to_blocks)}"
        assert not manager.num_cached_block
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks if not block.is_null)
