"""``KVBridgeConnector`` for vLLM: ``KVConnectorBase_V1`` over kvbridge's two halves.

vLLM builds one instance per role (vllm/distributed/kv_transfer/kv_connector/v1/base.py): the
scheduler half in the EngineCore process, the worker half in the Worker process (with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` both in one). Each instance wraps one kvbridge half
(``KVBridgeScheduler`` / ``KVBridgeWorker``, the same ones kvbridge's own engine runs), so the
transport, tickets, leases, deadlines, hash checks and failure reports are the same; vLLM's own
KV cache manager does the block management and vLLM's ``kv_load_failure_policy`` applies to
the blocks the worker reports in ``get_block_ids_with_load_errors``.

Between processes everything the halves say to each other travels as msgpack bytes inside
vLLM's metadata types (``_StepOrders``, ``_WorkerReport``, ``_Handshake``: ``wire.py``): vLLM
pickles those, and bytes pickle as themselves; a step's orders are encoded only when pickled.

Tensor parallelism (issue 30): vLLM builds one worker half per rank and sends each step's
orders to all of them. Each rank registers the KV heads its cache holds (``TPLayout``: vLLM's
rank and size, the model's KV heads) and pulls exactly those, from the prefill rank(s) holding
them; the scheduler half takes every rank's handshake and names every rank in its tickets.
vLLM's ``KVOutputAggregator`` reports a request finished once every rank has (the default
``get_finished_count``, the world size), which is when each rank's pull or lease has ended.
Layouts the connector does not serve are refused when the engine starts, before anything is
started (``refuse_unsupported_layout``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..errors import KVTransferParamsError
from ..metadata import (
    WorkerHandshake,
    decode_worker_meta,
    encode_worker_meta,
)
from ..scheduler_half import KVBridgeScheduler
from ..stats import KVTransferStats
from ..worker_half import KVBridgeWorker
from .engine_identity import engine_identity_fields, warn_unnamed_weights, weights_revision_of
from .load_modes import load_mode_for, recompute_shares_in_step_loads
from .logs import route_to_vllm
from .metrics import KVBridgeConnectorStats, KVBridgePromMetrics, StatsTap
from .offload_pool import VllmOffloadPool
from .pool_follower import VllmPoolFollower
from .rank_regions import rank_regions
from .request_view import RequestView
from .store_events import StoreTierEvents
from .store_tier import check_store_tier
from .translate import (
    config_from_vllm,
    kv_cache_config_from_vllm,
    refuse_unsupported_layout,
)
from .wire import _Handshake, _StepOrders, _WorkerReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PARAMS_ERROR_KEY", "KVBridgeConnector"]

logger = logging.getLogger(__name__)

PARAMS_ERROR_KEY = "kvbridge_error"
"""Key of the error entry in a finished request's returned ``kv_transfer_params``
(``RequestOutput.kv_transfer_params``, the OpenAI server's top-level ``kv_transfer_params``) when
its own params were malformed: ``"kv_transfer_params.<field>: <problem>; computed locally"``."""


_ASK_AGAIN = (None, False)  # get_num_new_matched_tokens: no answer yet


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge as a vLLM KV connector (one half per instance, chosen by ``role``).

    Args:
        vllm_config: the engine's config; ``kv_transfer_config`` carries kvbridge's settings.
        role: ``KVConnectorRole.SCHEDULER`` or ``WORKER``.
        kv_cache_config: vLLM's KV cache config (groups, layer names, block count).

    Statistics reach vLLM's log line and Prometheus (``metrics.py``) from the scheduler half,
    which holds the node's totals; external prefix hits are reported as ``CacheHitSource.P2P``
    (another node's blocks, a handoff's prefill node included) or, for the store tier,
    ``EXTERNAL_UNSPECIFIED`` (vLLM's label for a remote store).

    Raises:
        KVTransferConfigError: bad ``kv_connector_extra_config`` (naming the key), a KV cache
            group kvbridge cannot move, or a parallel layout it does not serve (pipeline,
            data or context parallel, MLA: ``translate.refuse_unsupported_layout``),
            ``load_mode`` "sync" where vLLM cannot take a failed sync load
            (``load_modes.load_mode_for``), all before anything is started.
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        refuse_unsupported_layout(vllm_config)  # first: nothing is started for a refused one
        super().__init__(vllm_config, role, kv_cache_config)
        route_to_vllm()  # kvbridge's log lines in vLLM's stream and format (logs.py)
        self._vllm_config = vllm_config
        model_config = vllm_config.model_config
        self.config = config_from_vllm(
            vllm_config.kv_transfer_config,
            model_name=str(model_config.served_model_name or "vllm"),
            model_revision=weights_revision_of(model_config, vllm_config.kv_transfer_config),
        )
        # Refuses index_url on a hash root no other engine shares, before anything starts.
        self._identity = engine_identity_fields(
            vllm_config, python_hash_seed=os.environ.get("PYTHONHASHSEED"),
            default_seed=DEFAULT_NONE_HASH_SEED, shared=bool(self.config.index_url))
        check_store_tier(vllm_config, self.config)
        if role == KVConnectorRole.SCHEDULER:  # (once per engine)
            warn_unnamed_weights(self.config, model_config)
        self._ours = kv_cache_config_from_vllm(kv_cache_config)
        # Several groups (vLLM's hybrid allocator): a failed pull is reported by request
        # (``failed_recving``), since vLLM refuses block-level load errors there.
        self._hybrid = len(self._ours.kv_cache_groups) > 1
        self.config = load_mode_for(vllm_config, self.config, say=role == KVConnectorRole.SCHEDULER,
                                    num_groups=len(self._ours.kv_cache_groups))
        hash_fn_name = str(vllm_config.cache_config.prefix_caching_hash_algo)
        self._store_events: StoreTierEvents | None = None
        self._follower: VllmPoolFollower | None = None
        self._block_pool: BlockPool | None = None  # vLLM's, once bound (scheduler side)
        self._scheduler: KVBridgeScheduler | None = None
        self._worker: KVBridgeWorker | None = None
        self._tap: StatsTap | None = None
        self._hit_tiers: dict[str, str] = {}  # request id -> holder tier, until reported
        self._params_errors: dict[str, str] = {}  # request id -> its error, until it finishes
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVBridgeScheduler(
                self.config, block_size=self._ours.kv_cache_groups[0].kv_cache_spec.block_size,
                num_groups=len(self._ours.kv_cache_groups), hash_fn_name=hash_fn_name,
                kv_cache_config=self._ours, handoffs_only_alone=recompute_shares_in_step_loads(
                    self.config))
            self._tap = StatsTap(self._scheduler.stats)
        else:
            self._worker = KVBridgeWorker(self.config, self._ours, hash_fn_name=hash_fn_name)
            self._worker.report_failed_recving = self._hybrid

    @property
    def stats(self) -> KVTransferStats:
        """This half's statistics (the scheduler half's include the worker's reports)."""
        half = self._scheduler if self._scheduler is not None else self._worker
        assert half is not None
        return half.stats

    @property
    def rank_stats(self) -> dict[int, KVTransferStats]:
        """The scheduler half: each worker rank's own statistics, by tp rank
        (``RankReports.by_rank``); the worker half: {}."""
        return {} if self._scheduler is None else self._scheduler.rank_reports.by_rank

    def _sched(self) -> KVBridgeScheduler:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on the worker half")
        return self._scheduler

    def _work(self) -> KVBridgeWorker:
        if self._worker is None:
            raise RuntimeError("worker-side method called on the scheduler half")
        return self._worker

    # ================================================================== scheduler half
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """With ``index_url``: follow vLLM's block pool (``pool_follower.VllmPoolFollower``),
        whose prefix-cache changes become the scheduler half's block events (published to
        the index, mirrored by the worker half for the holder's re-check), and, with ``offload:
        "evict"``, whose free queue the offload planner reads (``offload_pool.VllmOffloadPool``).
        vLLM calls it once, when its KV cache manager exists, before the workers' handshake;
        without an index the pool is left alone.

        Raises:
            KVTransferConfigError: the pool hashes at another granularity than its blocks.
        """
        self._block_pool = gpu_block_pool
        if self._scheduler is None or not self.config.index_url:
            return
        block_size = self._ours.kv_cache_groups[0].kv_cache_spec.block_size
        self._follower = VllmPoolFollower(gpu_block_pool, block_size=block_size)
        # With offload "evict" the planner reads the cold end of vLLM's free queue through it.
        pool = VllmOffloadPool(gpu_block_pool, self._follower.snapshot_cached_blocks,
                               self._follower.resync_events)
        self._scheduler.bind_block_pool(pool, self._follower.take_changes,  # type: ignore[arg-type]
                                        self._follower.settle)
        planner = self._scheduler.offload_planner
        if planner is not None:
            self._store_events = StoreTierEvents(block_size=block_size,
                                                 parent_of=planner.written_parent_of)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The store tier's events (``store_events.StoreTierEvents``: blocks this engine wrote
        to the store, and those the store reported missing, medium ``KVBRIDGE_STORE``); vLLM
        publishes its pool's own. The scheduler half's copies of the pool's events, kept for
        kvbridge's own engine, are dropped here each step so they never pile up."""
        if self._scheduler is not None:
            self._scheduler.take_events()
        return () if self._store_events is None else self._store_events.take()

    def on_new_request(self, request: Request) -> None:
        """Admission, as in kvbridge's own engine: a ticket is parsed once (and heart-beaten
        while the request queues, released if it ends before its pull). A malformed one is
        counted, its prefill node told to release (when its address is usable) and the
        request computed locally: vLLM offers no way to refuse it here. The error reaches the
        request's caller in its returned ``kv_transfer_params`` (``PARAMS_ERROR_KEY``, added by
        ``request_finished``)."""
        params = request.kv_transfer_params
        self._sched().admit(request.request_id)  # in the engine, whatever its params
        try:
            self._sched().validate_kv_transfer_params(
                request.request_id, params, request.num_prompt_tokens  # type: ignore[arg-type]
            )
        except KVTransferParamsError as exc:
            logger.warning("request %s: %s; computing it locally", request.request_id, exc)
            self._sched().on_request_rejected(params, str(exc))
            self._params_errors[request.request_id] = f"{exc}; computed locally"
            if isinstance(params, dict):
                params["do_remote_prefill"] = False  # never parsed (or counted) again

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """``(None, False)`` ("ask again") while the request's index lookup is out, in O(1)
        (vLLM asks at every step); else the scheduler half's answer. A request without
        ``kv_transfer_params`` goes straight to the index as it is (``match_from_index``: the
        index reads ``request_id``, ``block_hashes``, ``num_tokens`` and
        ``skip_reading_prefix_cache``, which vLLM's ``Request`` has): no ``RequestView``."""
        sched = self._sched()
        if not request.kv_transfer_params:
            return sched.match_from_index(request, num_computed_tokens)  # type: ignore[arg-type,return-value]
        if sched.index_lookup_pending(request.request_id):
            return _ASK_AGAIN
        matched = sched.get_num_new_matched_tokens(RequestView.of(request), num_computed_tokens)
        return matched.num_external_tokens, matched.load_kv_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the request's pull (or release its ticket) when it matched; a request that
        matched nothing (most) costs one dict read."""
        sched = self._sched()
        tier = sched.match_tier(request.request_id)
        if tier is None:
            return  # nothing matched: nothing to plan
        if num_external_tokens > 0:
            self._hit_tiers[request.request_id] = tier
        sched.update_state_after_alloc(RequestView.of(request), blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Where ``num_external_tokens`` came from (vLLM calls it right after
        ``update_state_after_alloc``): another node's blocks are ``P2P``, the store tier's
        ``EXTERNAL_UNSPECIFIED``."""
        tier = self._hit_tiers.pop(request.request_id, None)
        if num_external_tokens == 0:
            return {}
        if tier == "store":
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {CacheHitSource.P2P: num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return _StepOrders(self._sched().build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Also takes the blocks whose load failed out of vLLM's prefix cache: vLLM caches a
        sync load's blocks when it allocates them, and under ``recompute`` leaves them cached
        for the request to rewrite; a request aborted or preempted first would leave KV never
        written under their hashes, for a local hit or an offload to find. Uncached, the
        request still recomputes them (they stay uncached: vLLM counts them as cached). The
        step's publish to the index ends with their removal."""
        pool, invalid = self._block_pool, connector_output.invalid_block_ids
        if pool is not None and invalid:
            pool.evict_blocks({b for b in invalid if 0 <= b < len(pool.blocks)})
        report = connector_output.kv_connector_worker_meta
        payloads = report.payloads if isinstance(report, _WorkerReport) else []
        metas = [decode_worker_meta(payload) for payload in payloads]
        # Every rank's report at once: a block's offload settles when every rank's did.
        outcomes = self._sched().update_connector_output(metas, invalid or ())
        if self._store_events is not None:
            self._store_events.observe(outcomes)
        if self._tap is not None:
            for meta in metas:
                self._tap.observe_load_s(meta.stats.transfer_s)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A single-group engine's ``request_finished_all_groups`` (vLLM calls this one only
        for a connector that is not ``SupportsHMA``; kept for callers that still do)."""
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """kvbridge's ``request_finished`` with every KV cache group's blocks (vLLM's
        ``SupportsHMA``: the hybrid allocator stays on). ``block_ids`` is one list per group,
        by position from the request's first token; a sliding-window group's positions that
        fell out of the window are vLLM's null block (id 0), and the ticket keeps them so
        (``remote_block_ids`` per group, docs/architecture.md, "Tickets"). A request whose
        params were refused at admission also returns ``{PARAMS_ERROR_KEY: message}`` (beside
        P's ticket, if it is one)."""
        self._hit_tiers.pop(request.request_id, None)  # vLLM skips the sources when not logging
        if request.kv_transfer_params:
            result = self._sched().request_finished(
                RequestView.of(request), tuple(list(ids) for ids in block_ids))
        else:  # no ticket to issue: the half reads only the id and the (absent) params
            result = self._sched().request_finished(request, block_ids)  # type: ignore[arg-type]
        params = result.kv_transfer_params
        error = self._params_errors.pop(request.request_id, None)
        if error is not None:
            params = {**(params or {}), PARAMS_ERROR_KEY: error}
        return result.delay_free, params

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker rank's transport (``tp_rank -> _Handshake``): the tickets name them
        all, so each decode rank reads its heads from the prefill rank that holds them."""
        handshakes = {
            int(rank): msgspec.msgpack.decode(handshake.payload, type=WorkerHandshake)
            for rank, handshake in metadata.items()
            if isinstance(handshake, _Handshake)
        }
        if handshakes:
            self._sched().set_xfer_handshake_metadata(handshakes)

    # ================================================================== statistics
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler half: what changed since the last call (the worker half's reports
        included); the worker half: None (its statistics reach the scheduler half anyway)."""
        return None if self._tap is None else self._tap.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild ``KVBridgeConnectorStats`` from its ``to_dict()`` (vLLM's frontend)."""
        return KVBridgeConnectorStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """kvbridge's Prometheus metrics (``metrics.KVBridgePromMetrics``)."""
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================== worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the attention backend's caches as they are: block-major (the CPU backend)
        or K/V-split (FlashAttention: two regions per layer), named in the handshake
        (``translate.kv_cache_regions``) with the device and vLLM's attention backends of the
        layers (as vLLM's NIXL connector: two backends are two layouts, shapes alike or not),
        and this rank's place among vLLM's tensor-parallel ranks (the KV heads its cache holds:
        ``tp_layout``)."""
        regions, layout = rank_regions(self._vllm_config, kv_caches, self._ours)
        self._work().register_kv_caches(
            regions.regions_by_layer, kv_layout=regions.kv_layout,
            tp_layout=layout, **self._identity,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        handshake = self._work().get_handshake_metadata()
        return None if handshake is None else _Handshake(msgspec.msgpack.encode(handshake))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, _StepOrders):
            self._work().bind_connector_metadata(connector_metadata.metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._work().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-request pulls: a request runs only after its load settled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the holder serves reads from its KV tensors; nothing to push

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``, plus (several KV cache groups only) the requests whose pull failed
        as ``failed_recving``: vLLM then applies ``kv_load_failure_policy`` to the whole
        request (``recompute``: from its first token)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._work().take_failed_recving() if self._hybrid else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks that did not land; with several KV cache groups none (vLLM raises on
        them there): those requests are in ``get_transfer_results``' ``failed_recving``."""
        errors = self._work().get_block_ids_with_load_errors()
        return set() if self._hybrid else errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = self._work().build_connector_worker_meta()
        if meta.is_empty():
            return None  # nothing to report (vLLM may skip empty outputs)
        return _WorkerReport([encode_worker_meta(meta)])

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
