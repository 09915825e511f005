"""``KVBridgeWorker``: the worker half of a node's connector (KV tensors, transport, pulls,
serving, leases, heartbeats, notices).

It never sees the scheduler half: its orders arrive each step as ``KVBridgeConnectorMetadata``
and it answers through ``get_finished``, ``get_block_ids_with_load_errors`` and
``build_connector_worker_meta`` (docs/architecture.md, "The two connector halves"; vLLM:
``KVConnectorBase_V1`` with ``role=WORKER``). One step, in the model runner's order:

    bind_connector_metadata(meta)  hash removals (before any forward)
    start_load_kv      lease grants; tickets to heart-beat or forget; release
                       notices; pulls (tasks on the connector loop); offload snapshots; then
                       waits for the sync pulls (``load_mode`` "sync"), whose blocks this
                       step's forward reads
    -- forward --
    wait_for_save      hash stores (the forward has computed those blocks)
    get_finished       pulls settled -> finished_recving; leases ended -> finished_sending
                       (an idle step first waits briefly for a pull in flight)
    build_connector_worker_meta   the step's statistics and id; the holders this node
                                  reads one-sided, when they changed (``load_mode`` "auto")

Pulls are whole-request (not layer by layer): ``wait_for_layer_load`` / ``save_kv_layer`` have
nothing to wait for, since a request only runs after its load settled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from kvbridge.kvmanager.kv_cache_spec import KVCacheConfig
from kvbridge.transport import (
    KV_LAYOUT_NAME,
    BoardRef,
    KVHeads,
    LoopbackFaults,
    LoopbackNetwork,
    LoopbackTransport,
    NodeMetadata,
    Transport,
    format_host_port,
)

from .config import KVTransferConfig
from .errors import KVConnectorError
from .forward_marker import forward_done_marker
from .holder import HeldBlockHashes, HolderChecks
from .index import new_incarnation
from .lease import LeaseTable
from .loop_thread import get_loop_thread
from .metadata import (
    BlockHashDelta,
    KVBridgeConnectorMetadata,
    KVBridgeWorkerMeta,
    ReleaseNotice,
    StatsDelta,
    WorkerHandshake,
)
from .puller import Puller
from .release_notices import send_last_notices, send_notice
from .stats import KVTransferStats
from .store.offload_items import OffloadItem
from .store.sender import OffloadSender
from .store.url import parse_store_url
from .switch_interval import SwitchInterval
from .tp_layout import TPLayout, index_layout

__all__ = ["KVBridgeWorker"]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0
IDLE_HOLD_FIRST_WAIT_S = 0.001
"""An idle holder's first wait; each further idle step in a row doubles it, up to
``config.idle_hold_wait_s`` (``KVBridgeWorker.get_finished``)."""


def _regions(kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """A layer's block-major regions: its tensor, or the regions it is split over."""
    return (kv_cache,) if isinstance(kv_cache, torch.Tensor) else kv_cache


class KVBridgeWorker:
    """The worker half.

    Owners: the worker thread (the model runner's) calls every public method; the transport's
    callbacks and the pulls run on the connector loop thread. They share only the objects that
    lock themselves: ``leases`` (``LeaseTable``), ``hashes`` (``HeldBlockHashes``), ``stats``
    and the puller's waiting tickets.

    Args:
        config: the node's validated settings.
        kv_cache_config: the node's KV cache groups (layer names, block sizes).
        hash_fn_name: the block hash function (part of the handshake's compatibility hash).
        loopback_network: required when ``transport`` is ``"loopback"``.
        loopback_faults: holder-side faults for tests (loopback only).
    """

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        *,
        hash_fn_name: str,
        loopback_network: LoopbackNetwork | None = None,
        loopback_faults: LoopbackFaults | None = None,
    ) -> None:
        self.config = config
        self._switch_interval = SwitchInterval(config.gil_switch_interval_s, config.engine_id)
        self.kv_cache_config = kv_cache_config
        self.hash_fn_name = hash_fn_name
        self.incarnation = new_incarnation()
        self.stats = KVTransferStats()
        self.leases = LeaseTable(config.lease_s)
        self.hashes = HeldBlockHashes()
        self.puller = Puller(
            load_timeout_s=config.load_timeout_s,
            heartbeat_interval_s=config.heartbeat_interval_s,
            stats=self.stats,
            sync_load_timeout_s=config.sync_load_timeout_s,
        )
        self.transport: Transport | None = None
        self._loopback_network = loopback_network
        self._loopback_faults = loopback_faults
        self.offload_sender: OffloadSender | None = None
        if config.offload != "off" and config.store_url is not None:
            self.offload_sender = OffloadSender(
                store_address=parse_store_url(config.store_url),
                max_inflight_bytes=config.offload_max_inflight_bytes,
                stats=self.stats,
                probe_interval_s=config.heartbeat_interval_s,  # a store restart found this soon
            )
        self._meta: KVBridgeConnectorMetadata | None = None
        self._step_id = 0  # the last orders' KVBridgeConnectorMetadata.step_id
        self._idle_hold_wait_s = min(IDLE_HOLD_FIRST_WAIT_S, config.idle_hold_wait_s)
        self._stores_after_forward: BlockHashDelta | None = None
        self._unlisted: set[int] = set()  # blocks this step's sync pulls did not fill
        self._kv_device = torch.device("cpu")  # the KV tensors' (register_kv_caches)
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._board_counts_seen = (0, 0)  # transport.board_counts moved into stats so far
        self._one_sided_reported: list[BoardRef] | None = []  # the last report's holders
        self.tp_layout: TPLayout | None = None  # set by register_kv_caches
        self.report_failed_recving = False
        """Keep the failed pulls' request ids for ``take_failed_recving`` (vLLM's adapter
        sets it for several KV cache groups; nobody else takes them)."""

    # ------------------------------------------------------------------ start
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        *,
        kv_layout: str = KV_LAYOUT_NAME,
        kv_cache_dtype: str | None = None,
        tp_layout: TPLayout | None = None,
        model_dtype: str = "",
        hash_root: str = "",
    ) -> None:
        """Start this node's transport over the KV tensors (group order from the config).

        Args:
            kv_caches: layer name -> ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
                tensor (or a view of that shape over another engine's block-major cache), or
                a sequence of such block-major regions for a layer whose block is split over
                several (K and V of a FlashAttention cache: ``vllm.translate.kv_cache_regions``).
                The transport moves each region as it moves a layer (row ``b`` whole), so a
                read of block ``b`` moves row ``b`` of every region of every layer, and the
                handshake's ``num_layers`` counts regions.
            kv_layout: the name of the bytes' real layout inside a block (the handshake refuses
                a peer whose layout differs).
            kv_cache_dtype: the cache's element type as the engine names it, where the
                tensors' dtype does not say it (vLLM's fp8 caches are ``uint8``); None: the
                tensors' dtype. With ``config.model_name``, ``config.model_revision``,
                ``model_dtype`` and ``hash_root`` (their meanings: ``BlockIdentity``), both are
                the node's ``BlockIdentity`` (the handshake's and the index namespace's).
            tp_layout: this rank's place in a tensor-parallel engine: the transport names the
                KV heads its blocks hold (``KVHeads``), every read names the heads it moves, and
                pulls read each head from the holder's rank that holds it (``Puller.sources``).
                None: a worker that does not name its heads (kvbridge's own engine).

        Raises:
            RuntimeError: when called twice.
            ValueError: ``tp_layout`` whose heads the tensors do not hold (axis 3 of each); KV
                tensors on another GPU than the connector loop's (``LoopThread.bind``).
            OSError: the transport's port is taken; ValueError: a loopback address in use. A
                start refused at any step closes what it had started before it raises.
        """
        if self.transport is not None:
            raise RuntimeError("register_kv_caches called twice for one node's connector")
        by_group = [
            [region for name in group.layer_names for region in _regions(kv_caches[name])]
            for group in self.kv_cache_config.kv_cache_groups
        ]
        self._kv_device = by_group[0][0].device
        get_loop_thread().bind(self._kv_device)  # it gathers, scatters, sends these
        self._switch_interval.apply()
        kv_heads = None
        if tp_layout is not None:
            kv_heads = KVHeads(first=tp_layout.heads.start, total=tp_layout.total_num_kv_heads,
                               sliceable=tp_layout.heads_sliceable)
            held = tp_layout.heads.stop - tp_layout.heads.start
            shapes = {tuple(t.shape) for g in by_group for t in g if t.shape[3] != held}
            if shapes:
                raise ValueError(f"rank {tp_layout} holds {held} KV heads, tensors {shapes}")
        metadata = NodeMetadata.from_kv_caches(
            engine_id=self.config.engine_id, kv_caches_by_group=by_group,
            model_name=self.config.model_name, hash_fn_name=self.hash_fn_name,
            model_revision=self.config.model_revision, kv_cache_dtype=kv_cache_dtype,
            kv_layout=kv_layout, kv_heads=kv_heads, model_dtype=model_dtype, hash_root=hash_root,
        )
        metadata = replace(metadata, incarnation=str(self.incarnation))
        if self.offload_sender is not None:
            self.offload_sender.bind(by_group, metadata, kv_heads_layout=index_layout(tp_layout))
        transport = self._make_transport(metadata, by_group)
        self.leases.attach_board(transport.block_board)
        checks = HolderChecks(
            leases=self.leases, hashes=self.hashes, stats=self.stats,
            num_blocks=self.kv_cache_config.num_blocks,
            bytes_per_block=[group.kv_cache_spec.page_size_bytes * len(group.layer_names)
                             for group in self.kv_cache_config.kv_cache_groups])
        transport.set_callbacks(**checks.as_kwargs())  # type: ignore[arg-type]
        self.tp_layout = self.puller.tp_layout = tp_layout
        try:
            get_loop_thread().run(transport.start(), _START_TIMEOUT_S)
            self.puller.start_heartbeats(transport, _START_TIMEOUT_S)
        except BaseException:  # a refused start leaves nothing running, and no setting changed
            self._close(transport, notices=[])
            self._switch_interval.restore()
            raise
        self.transport = transport
        logger.info(
            "%s: transport %s listening on %s",
            self.config.engine_id,
            self.config.transport,
            format_host_port(*transport.address),
        )

    def _make_transport(
        self, metadata: NodeMetadata, by_group: Sequence[Sequence[torch.Tensor]]
    ) -> Transport:
        config = self.config
        if config.transport == "loopback":
            if self._loopback_network is None:
                raise KVConnectorError("transport 'loopback' needs a LoopbackNetwork")
            return LoopbackTransport(
                metadata,
                by_group,
                network=self._loopback_network,
                host=config.host,
                port=config.port,
                faults=self._loopback_faults,
                auth_key=config.auth_key_bytes(),
            )
        from kvbridge.transport import UcxxTransport  # ucxx is imported only when used

        return UcxxTransport(
            metadata,
            by_group,
            host=config.host,
            port=config.port,
            cma=config.cma,
            cma_board=config.cma_board,
            auth_key=config.auth_key_bytes(),
        )

    # ------------------------------------------------------------------ one step
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Hold this step's orders (a ``KVBridgeConnectorMetadata``; anything else: none) and
        apply their hash removals now, the one call before the forward that may overwrite
        those blocks (vLLM 0.32 calls ``start_load_kv`` after the forward when no load is
        sync): the holder stops vouching for a block before its bytes change."""
        self._meta = metadata if isinstance(metadata, KVBridgeConnectorMetadata) else None
        if self._meta is not None:
            self.hashes.apply_removals(self._meta.block_hashes)
            self._stores_after_forward = self._meta.block_hashes
            self._step_id = self._meta.step_id  # named back by this step's report

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Carry out this step's orders; network work goes to the loop, and only sync pulls
        (``PullPlan.sync``) are waited for, each at most its deadline.

        Raises:
            RuntimeError: before ``register_kv_caches``, or a sync pull unsettled well past its
                deadline (``Puller.wait_settled``).
        """
        meta = self._meta
        if meta is None:
            return
        transport = self.transport
        if transport is None:
            raise RuntimeError("start_load_kv before register_kv_caches")
        for grant in meta.lease_grants:
            self.leases.grant(grant.request_id, grant.block_ids, grant.block_hashes, grant.token)
        for ticket in meta.tickets_to_watch:
            self.puller.waiting_tickets.add(ticket)
        for ticket in meta.tickets_to_forget:
            self.puller.waiting_tickets.discard(ticket)
        loop = get_loop_thread()
        for notice in meta.notices:
            loop.submit(send_notice(transport, notice, self.puller.puller_rank))
        for plan in meta.pulls:
            self.puller.submit(transport, plan)
        if self.offload_sender is not None and meta.offload_items:
            self.offload_sender.submit([OffloadItem(*item) for item in meta.offload_items])
        sync_pulls = [plan.request_id for plan in meta.pulls if plan.sync]
        if sync_pulls:  # this step's forward reads their blocks (``load_mode`` "sync")
            self.stats.add("num_sync_loads", len(sync_pulls))
        self._unlisted = self.puller.wait_settled(sync_pulls)  # (none: at once)

    def wait_for_save(self) -> None:
        """End of the forward (issued; on a GPU maybe still running): the blocks this step
        cached are vouched for once computed (``forward_done_marker``), but those it pulled
        and did not fill (vLLM caches a sync load's blocks before the load)."""
        delta, self._stores_after_forward = self._stores_after_forward, None
        if delta is not None:  # (``_unlisted``: set by this step's ``start_load_kv``)
            self.hashes.apply_stores(delta, forward_done_marker(self._kv_device), self._unlisted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` since the last call. Pulls of requests in
        ``finished_req_ids`` (aborted while loading) are cancelled; they are still reported
        once settled, and the scheduler keeps their blocks until then.

        On an idle step (the orders say it computes no token) with pulls in flight, it first
        waits up to ``config.idle_pull_wait_s`` for one to settle: nothing else is waiting for
        this thread, the pull gets the GIL and the core, and the request it lands is promoted
        in the next step instead of a later one. An idle step of a node that only holds leases
        waits instead (``config.idle_hold_wait_s`` 0: not at all), returning as soon as a
        completion notice ends one (``LeaseTable.wait_for_release``): 1 ms
        (``IDLE_HOLD_FIRST_WAIT_S``), doubled on each further idle step in a row up to
        ``config.idle_hold_wait_s``, so a request that reaches the engine in a lull waits at
        most about as long as the lull has lasted, and never more than that cap.

        It first sends the release notices of the previous step's one-sided loads (held back so
        that the connector loop does not wake in the step that computes the handed-off
        request's first token: ``DeferredNotices``)."""
        if self.transport is not None:
            self.puller.send_deferred_notices(self.transport)  # the previous step's
            self.puller.cancel_aborted(self.transport, finished_req_ids)
            meta = self._meta
            if meta is not None and meta.num_scheduled_tokens == 0:
                if self.puller.num_inflight:
                    self.puller.wait_for_any(self.config.idle_pull_wait_s)
                elif len(self.leases) and self.config.idle_hold_wait_s > 0:
                    # a holder's idle loop yields; a lease's end is reported at once
                    self.leases.wait_for_release(self._idle_hold_wait_s)
                    self._idle_hold_wait_s = min(2 * self._idle_hold_wait_s,
                                                 self.config.idle_hold_wait_s)
            elif meta is not None:  # the engine computes again: a new lull starts short
                self._idle_hold_wait_s = min(IDLE_HOLD_FIRST_WAIT_S, self.config.idle_hold_wait_s)
        settled = self.puller.pop_settled()
        finished_recving = settled.request_ids
        self._load_errors.update(settled.failed_block_ids)
        self.hashes.forget(settled.failed_block_ids)  # (not the hash vLLM cached them under)
        if self.report_failed_recving:
            self._failed_recving.update(settled.failed_request_ids)
        finished_sending, num_expired = self.leases.pop_finished()
        if num_expired:
            self.stats.add("num_expired_leases", num_expired)
            logger.warning("%d lease(s) expired without a completion notice", num_expired)
        return finished_sending or None, finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_recving(self) -> set[str]:
        """The async pulls reported in ``get_finished`` since the last call whose blocks did
        not all land (their blocks are in ``get_block_ids_with_load_errors`` too): vLLM's
        ``failed_recving``, the only load-error report it takes with several groups."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def build_connector_worker_meta(self) -> KVBridgeWorkerMeta:
        """The statistics since the last call (and the store's incarnation: probed, when no put
        went to the store for ``heartbeat_interval_s``)."""
        self._count_board_reads()
        outcomes = []
        if self.offload_sender is not None:
            self.offload_sender.probe_if_due(time.monotonic())
            outcomes = self.offload_sender.take_outcomes()
        counters, transfer_s, queue_s = self.stats.take_report()
        holders = None if self.transport is None else self.transport.one_sided_holders()
        changed, self._one_sided_reported = holders != self._one_sided_reported, holders
        return KVBridgeWorkerMeta(
            tp_rank=0 if self.tp_layout is None else self.tp_layout.tp_rank,
            step_id=self._step_id,
            stats=StatsDelta(counters=counters, transfer_s=transfer_s, queue_s=queue_s),
            pulls=self.puller.take_reports(),
            offload_outcomes=[tuple(outcome) for outcome in outcomes],
            store_incarnation=0 if self.offload_sender is None
            else self.offload_sender.store_incarnation,
            one_sided_holders=holders if changed else None,  # None: as last reported
        )

    def _count_board_reads(self) -> None:
        """Move the transport's one-sided read counts (kept on its loop thread; ints, read
        whole) into ``stats``."""
        counts = getattr(self.transport, "board_counts", None)
        if counts is None:
            return
        now = (counts.one_sided, counts.fallbacks)
        for name, count, seen in zip(("num_one_sided_loads", "num_board_fallbacks"), now,
                                     self._board_counts_seen, strict=True):
            if count > seen:
                self.stats.add(name, count - seen)
        self._board_counts_seen = now

    def get_handshake_metadata(self) -> WorkerHandshake | None:
        """The transport's incarnation, address and block identity once ``register_kv_caches``
        started it."""
        if self.transport is None:
            return None
        host, port = self.transport.address
        layout = self.tp_layout
        tp = {} if layout is None else dict(
            tp_rank=layout.tp_rank, tp_size=layout.tp_size,
            total_num_kv_heads=layout.total_num_kv_heads, heads_sliceable=layout.heads_sliceable)
        return WorkerHandshake(
            engine_id=self.config.engine_id, incarnation=str(self.incarnation), host=host,
            port=port, identity=self.transport.metadata.identity, **tp)

    def shutdown(self) -> None:
        self._switch_interval.restore()
        if self.offload_sender is not None:
            self.offload_sender.close()
        transport, self.transport = self.transport, None
        if transport is None:
            return
        self._close(transport, notices=self.puller.take_deferred_notices())  # one-sided holders

    def _close(self, transport: Transport, *, notices: list[ReleaseNotice]) -> None:
        """Send ``notices``, stop the heartbeats and close ``transport``, on the connector
        loop; logs, never raises (a shutdown, or a start that failed part-way)."""
        puller = self.puller

        async def _close() -> None:
            await send_last_notices(transport, notices, puller.puller_rank)
            await puller.close()
            await transport.close()

        try:
            get_loop_thread().run(_close(), _START_TIMEOUT_S)
        except Exception:  # shutting down: log, never raise
            logger.exception("%s: transport close failed", self.config.engine_id)
