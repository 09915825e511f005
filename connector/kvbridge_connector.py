"""``KVBridgeConnector``: the P/D connector as kvbridge's engine loads it, one half per instance.

One disaggregated request (docs/architecture.md, "Life of a P/D request"):

    P  request_finished -> delay_free, kv_transfer_params {remote_block_ids, lease...}
       (the lease grant goes to P's worker half in the next step's metadata; D's heartbeats
       extend it)
    D  get_num_new_matched_tokens -> (remote tokens - local hit, async)
       allocate_slots(..., delay_cache_blocks=True); update_state_after_alloc pairs blocks
       build_connector_meta -> PullPlan per request
       start_load_kv -> pull on the connector loop; get_finished -> finished_recving
       (the scheduler then caches the blocks and sets num_computed_tokens <= num_tokens - 1)
    D  completion notice -> P releases the lease -> P's get_finished -> finished_sending

Which half does what follows vLLM's NIXL connector (vllm/distributed/kv_transfer/kv_connector/
v1/nixl_connector.py): an instance of role SCHEDULER wraps a ``KVBridgeScheduler``
(``scheduler_half.py``), one of role WORKER a ``KVBridgeWorker`` (``worker_half.py``). The two
share no object: orders go down in ``KVBridgeConnectorMetadata``, reports come back in
``KVConnectorOutput`` (finished ids, load errors, ``KVBridgeWorkerMeta``), all msgpack-ready.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from kvbridge.kvmanager.connector_interface import (
    ForwardContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    MatchedTokens,
    RequestFinishedResult,
)
from kvbridge.kvmanager.kv_cache_spec import KVCacheConfig
from kvbridge.transport import LoopbackFaults, LoopbackNetwork

from .config import KVTransferConfig
from .index import IndexStats
from .metadata import KVBridgeConnectorMetadata, KVBridgeWorkerMeta, WorkerHandshake
from .scheduler_half import KVBridgeScheduler
from .stats import KVTransferStats
from .worker_half import KVBridgeWorker

if TYPE_CHECKING:
    from kvbridge.kvmanager.block_pool import BlockPool
    from kvbridge.kvmanager.request import Request
    from kvbridge.kvmanager.scheduler_output import SchedulerOutput

__all__ = ["KVBridgeConnector", "KVBridgeConnectorMetadata"]


class KVBridgeConnector(KVConnectorBase):
    """One half of a node's P/D connector (``role`` says which). Build the two halves with
    ``KVBridgeConnectorFactory``; methods of the other half raise ``RuntimeError``.

    Args:
        role: which half this instance plays.
        config: the node's settings.
        kv_cache_config: the node's KV cache groups.
        hash_fn_name: the block hash function.
        loopback_network, loopback_faults: for ``transport: loopback`` (worker half).
    """

    def __init__(
        self,
        role: KVConnectorRole,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        *,
        hash_fn_name: str,
        loopback_network: LoopbackNetwork | None = None,
        loopback_faults: LoopbackFaults | None = None,
    ) -> None:
        super().__init__(role, config.kv_role)
        self.config = config
        self._scheduler: KVBridgeScheduler | None = None
        self._worker: KVBridgeWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = KVBridgeScheduler(
                config,
                block_size=kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
                num_groups=len(kv_cache_config.kv_cache_groups),
                hash_fn_name=hash_fn_name,
                kv_cache_config=kv_cache_config,
            )
        else:
            self._worker = KVBridgeWorker(
                config,
                kv_cache_config,
                hash_fn_name=hash_fn_name,
                loopback_network=loopback_network,
                loopback_faults=loopback_faults,
            )

    @property
    def scheduler_half(self) -> KVBridgeScheduler:
        if self._scheduler is None:
            raise RuntimeError("a worker-half KVBridgeConnector has no scheduler half")
        return self._scheduler

    @property
    def worker_half(self) -> KVBridgeWorker:
        if self._worker is None:
            raise RuntimeError("a scheduler-half KVBridgeConnector has no worker half")
        return self._worker

    @property
    def stats(self) -> KVTransferStats:
        """The node's transfer statistics: the scheduler half's totals (the worker's arrive
        with each step's report); on a worker half, its own not yet reported."""
        return self._scheduler.stats if self._scheduler is not None else self.worker_half.stats

    @property
    def index_stats(self) -> IndexStats | None:
        """The block index client's statistics (scheduler half, index configured), or None."""
        client = self._scheduler.index_client if self._scheduler is not None else None
        return None if client is None else client.index.stats

    # ================================================================== scheduler half
    def bind_block_pool(self, block_pool: BlockPool, take_events: Any) -> None:
        """Give the scheduler half the node's block pool and its manager's ``take_events``."""
        self.scheduler_half.bind_block_pool(block_pool, take_events)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> MatchedTokens:
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output)  # type: ignore[return-value]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self.scheduler_half.update_connector_output(
            meta if isinstance(meta, KVBridgeWorkerMeta) else None
        )

    def take_events(self) -> Iterable[Any]:
        return self.scheduler_half.take_events()

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> RequestFinishedResult:
        return self.scheduler_half.request_finished(request, block_ids)

    def validate_kv_transfer_params(
        self, request_id: str, kv_transfer_params: Mapping[str, Any],
        num_prompt_tokens: int | None = None,
    ) -> None:
        self.scheduler_half.validate_kv_transfer_params(
            request_id, kv_transfer_params, num_prompt_tokens
        )

    def on_new_request(self, request: Request) -> None:
        """The engine queued ``request``: it counts as in the engine for the index's
        lone-request rules until ``request_finished`` (``KVBridgeScheduler.admit``)."""
        self.scheduler_half.admit(request.request_id)

    def on_request_rejected(self, kv_transfer_params: Any, reason: str) -> None:
        self.scheduler_half.on_request_rejected(kv_transfer_params, reason)

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, Any]) -> None:
        """The worker halves' handshakes by rank (vLLM's shape; kvbridge runs one worker)."""
        handshake = metadata.get(0)
        if isinstance(handshake, WorkerHandshake):
            self.scheduler_half.set_xfer_handshake_metadata(handshake)

    def has_pending_orders(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_orders()

    # ================================================================== worker half
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.worker_half.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_half.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker_half.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext) -> None:
        self.worker_half.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-request pulls: a request runs only after its load settled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None  # the holder serves reads from its KV tensors; nothing to push

    def wait_for_save(self) -> None:
        self.worker_half.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_half.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVBridgeWorkerMeta:
        return self.worker_half.build_connector_worker_meta()

    def get_handshake_metadata(self) -> WorkerHandshake | None:
        return self.worker_half.get_handshake_metadata()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
