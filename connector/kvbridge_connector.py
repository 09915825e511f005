"""``KVBridgeConnector``: the P/D connector (both halves), over a kvbridge ``Transport``.

One disaggregated request (DESIGN.md, "One disaggregated request, end to end"):

    P  request_finished -> delay_free, kv_transfer_params {remote_block_ids, lease...}
       (blocks stay referenced under a lease; D's heartbeats extend it)
    D  get_num_new_matched_tokens -> (remote tokens - local hit, async)
       allocate_slots(..., delay_cache_blocks=True); update_state_after_alloc pairs blocks
       build_connector_meta -> PullPlan per request
       start_load_kv -> pull on the connector loop; get_finished -> finished_recving
       (the scheduler then caches the blocks and sets num_computed_tokens <= num_tokens - 1)
    D  completion notice -> P releases the lease -> P's get_finished -> finished_sending

Which half does what follows vLLM's NIXL connector (vllm/distributed/kv_transfer/kv_connector/
v1/nixl_connector.py); the pulls are whole-request (not layer by layer), so
``wait_for_layer_load`` / ``save_kv_layer`` / ``wait_for_save`` have nothing to wait for: a
request only runs after its load settled.

Both halves of one node share a ``ConnectorContext`` (context.py, same process). The worker half
hands pulls to a ``Puller`` (puller.py: pulls on the connector loop, heartbeats, completion
notices) and registers ``HolderCallbacks`` (holder.py: hash checks before serving, leases) with
the transport; the scheduler half is this file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from kvbridge.kvmanager.connector_interface import (
    ForwardContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    MatchedTokens,
    RequestFinishedResult,
)
from kvbridge.kvmanager.request import RequestStatus
from kvbridge.transport import LoopbackTransport, NodeMetadata, Transport

from .context import ConnectorContext
from .errors import KVConnectorError, KVTransferParamsError
from .holder import HolderCallbacks
from .index.client import IndexClient, open_index
from .index.protocol import IndexNamespace
from .loop_thread import get_loop_thread
from .pull_plan import PullPlan, ReleaseNotice, lease_token, plan_group_pulls
from .puller import Puller, release_notice, send_notice
from .stats import KVTransferStats
from .transfer_params import RemotePrefillParams, wants_remote_decode, wants_remote_prefill

if TYPE_CHECKING:
    from kvbridge.kvmanager.request import Request
    from kvbridge.kvmanager.scheduler_output import SchedulerOutput

__all__ = ["ConnectorContext", "KVBridgeConnector", "KVBridgeConnectorMetadata"]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0
_PRODUCER_DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler half: pulls to start, release notices to send."""

    reqs_to_recv: dict[str, PullPlan] = field(default_factory=dict)
    notices: list[ReleaseNotice] = field(default_factory=list)


class KVBridgeConnector(KVConnectorBase):
    """The P/D connector. Build both halves with ``KVBridgeConnectorFactory``.

    Args:
        role: which half this instance plays.
        context: the node's shared ``ConnectorContext``.
    """

    def __init__(self, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(role, context.config.kv_role)
        self.ctx = context
        # scheduler half
        self._remote: dict[str, tuple[RemotePrefillParams, int]] = {}
        self._reqs_to_recv: dict[str, PullPlan] = {}
        self._notices: list[ReleaseNotice] = []
        self._events: list[Any] = []
        # worker half
        self._puller = Puller(context)
        self._load_errors: set[int] = set()

    @property
    def stats(self) -> KVTransferStats:
        return self.ctx.stats

    # ================================================================== scheduler half
    def parse_remote_prefill(self, params: Mapping[str, Any]) -> RemotePrefillParams:
        """Validate a request's D-side ``kv_transfer_params`` (call at admission).

        Raises:
            KVTransferParamsError: naming the bad field.
        """
        return RemotePrefillParams.parse(
            params, num_groups=self.ctx.num_groups, block_size=self.ctx.block_size
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> MatchedTokens:
        params = request.kv_transfer_params
        if not (self.kv_role.is_consumer and wants_remote_prefill(params)):
            return self._match_from_index(request, num_computed_tokens)
        try:
            remote = self.parse_remote_prefill(params)  # type: ignore[arg-type]
        except KVTransferParamsError as exc:
            # Normally refused at admission; never let bad params stop the step.
            logger.warning("request %s: %s; computing locally", request.request_id, exc)
            self.ctx.stats.add("num_rejected_params")
            return MatchedTokens(0, False)
        self._remote[request.request_id] = (remote, num_computed_tokens)
        # The last prompt token is recomputed for its logits anyway: never plan it as external
        # (a sliding-window group then keeps the block that token's window starts in).
        num_remote = min(remote.remote_num_tokens, request.num_prompt_tokens - 1)
        return MatchedTokens(max(num_remote - num_computed_tokens, 0), True)

    def _match_from_index(self, request: Request, num_computed_tokens: int) -> MatchedTokens:
        """DESIGN step 6: a request without params asks the index for its longest prefix held
        on another node; a hit that beats the local one by ``min_remote_hit_blocks`` is pulled
        through the same path as a P/D handoff (no lease: the holder's hash check guards it)."""
        client = self.ctx.index_client
        if client is None or request.skip_reading_prefix_cache:
            return MatchedTokens(0, False)
        block_size = self.ctx.block_size
        # Never plan the last token's block: it is recomputed for its logits anyway.
        hashes = request.block_hashes[: (request.num_tokens - 1) // block_size]
        self.ctx.stats.add("num_index_lookups")
        found = client.find_remote_prefix(
            hashes,
            num_local_blocks=num_computed_tokens // block_size,
            min_gain_blocks=self.ctx.config.min_remote_hit_blocks,
        )
        if found is None:
            return MatchedTokens(0, False)
        num_remote_tokens = found.num_blocks * block_size
        remote = RemotePrefillParams(
            remote_engine_id=found.holder.node_id,
            remote_incarnation=str(found.holder.incarnation),
            remote_request_id="",  # not a handoff: no lease to extend or release
            remote_host=found.address.host,
            remote_port=found.address.port,
            remote_block_ids=tuple(tuple(ids) for ids in found.block_ids),
            remote_num_tokens=num_remote_tokens,
            remote_block_size=block_size,
            lease_expires_at=0.0,
        )
        self._remote[request.request_id] = (remote, num_computed_tokens)
        num_new = num_remote_tokens - num_computed_tokens
        self.ctx.stats.add("num_index_hits")
        tier_counter = "store_hit_tokens" if found.holder.tier == "store" else "remote_hit_tokens"
        if found.holder.tier == "store":
            self.ctx.store_engine_ids.add(found.holder.node_id)
        self.ctx.stats.add(tier_counter, num_new)
        return MatchedTokens(num_new, True)

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        entry = self._remote.pop(request.request_id, None)
        if entry is None:
            return
        remote, num_local = entry
        self.ctx.waiting_tickets.discard(_ticket(remote))  # the pull (or a notice) takes over
        if remote.remote_request_id and isinstance(request.kv_transfer_params, dict):
            # The ticket is used once (as vLLM's NIXL connector does): a request preempted after
            # its pull must not pull again from blocks the holder has released since.
            request.kv_transfer_params["do_remote_prefill"] = False
        if num_external_tokens == 0:
            # The local prefix cache covers everything P offered: P only releases its blocks.
            if remote.remote_request_id:
                self._notices.append(
                    release_notice(remote, success=True, reason="local prefix hit")
                )
            return
        block_size = self.ctx.block_size
        start_block = num_local // block_size
        end_block = _cdiv(num_local + num_external_tokens, block_size)
        groups, unloadable = plan_group_pulls(
            local_block_ids=blocks.get_block_ids(),
            remote_block_ids=remote.remote_block_ids,
            start_block=start_block,
            end_block=end_block,
            block_hashes=request.block_hashes,
            unhashed_token=lease_token(remote.remote_request_id)
            if remote.remote_request_id
            else b"",
        )
        self._reqs_to_recv[request.request_id] = PullPlan(
            request_id=request.request_id,
            params=remote,
            groups=groups,
            unloadable_block_ids=unloadable,
            num_external_tokens=num_external_tokens,
            created_at=time.monotonic(),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVBridgeConnectorMetadata(reqs_to_recv=self._reqs_to_recv, notices=self._notices)
        self._reqs_to_recv = {}
        self._notices = []
        return meta

    def _publish_events(self) -> None:
        """Forward this step's ``BlockPool`` events to the index (one batch) and keep them for
        ``take_events``."""
        manager = self.ctx.kv_cache_manager
        if manager is None or self.ctx.index_client is None:
            return
        events = list(manager.take_events())
        if events:
            self._events.extend(events)
            self.ctx.index_client.publish(events)
            if self.ctx.offloader is not None:
                self.ctx.offloader.observe(events)

    def update_connector_output(self, connector_output: Any) -> None:
        """End of a step, after the forward pass: publish the step's block events, offload cold
        blocks.

        Publishing waits for the forward: ``allocate_slots`` hashes a step's new full blocks
        before their KV is computed (vLLM's order, safe inside one engine), but a peer could
        pull them through the index from another thread in between.
        """
        self._publish_events()
        if self.ctx.offloader is not None and self.ctx.kv_cache_manager is not None:
            self.ctx.offloader.on_step(self.ctx.kv_cache_manager.block_pool)

    def take_events(self) -> Iterable[Any]:
        """The ``BlockPool`` events this connector forwarded to the index since the last call
        (with an index configured, the connector drains the manager's events each step)."""
        events, self._events = self._events, []
        return events

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> RequestFinishedResult:
        self._remote.pop(request.request_id, None)
        params = request.kv_transfer_params
        if self.kv_role.is_consumer and wants_remote_prefill(params):
            self._release_unused_ticket(params)  # type: ignore[arg-type]
        if not (self.kv_role.is_producer and wants_remote_decode(params)):
            return RequestFinishedResult(False, None)
        if request.status not in _PRODUCER_DONE or self.ctx.transport is None:
            return RequestFinishedResult(False, None)  # aborted or failed: nothing to hand over
        num_tokens = request.num_prompt_tokens
        num_blocks = _cdiv(num_tokens, self.ctx.block_size)
        held = tuple(tuple(ids[:num_blocks]) for ids in block_ids)
        expires_at = self.ctx.leases.grant(request.request_id, held)
        address = self.ctx.transport.address
        out = RemotePrefillParams(
            remote_engine_id=self.ctx.config.engine_id,
            remote_incarnation=self.ctx.transport.metadata.incarnation,
            remote_request_id=request.request_id,
            remote_host=address.host,
            remote_port=address.port,
            remote_block_ids=held,
            remote_num_tokens=num_tokens,
            remote_block_size=self.ctx.block_size,
            lease_expires_at=expires_at,
        )
        return RequestFinishedResult(True, out.to_dict())

    def _release_unused_ticket(self, params: Mapping[str, Any]) -> None:
        """A request finished (aborted) before its ticket was used: stop heart-beating it and
        tell the prefill node to release the blocks now."""
        try:
            remote = self.parse_remote_prefill(params)
        except KVTransferParamsError:
            return
        if self.ctx.waiting_tickets.discard(_ticket(remote)) and self.ctx.transport is not None:
            notice = release_notice(remote, success=False, reason="finished before its pull")
            get_loop_thread().submit(send_notice(self.ctx.transport, notice))

    def validate_kv_transfer_params(self, kv_transfer_params: Mapping[str, Any]) -> None:
        """Refuse malformed remote-prefill params at admission (``KVTransferParamsError``)."""
        if self.kv_role.is_consumer and wants_remote_prefill(kv_transfer_params):
            try:
                remote = self.parse_remote_prefill(kv_transfer_params)
            except KVTransferParamsError:
                self.ctx.stats.add("num_rejected_params")
                raise
            # Admitted: keep P's lease alive while the request waits for its turn.
            self.ctx.waiting_tickets.add(_ticket(remote))

    def on_request_rejected(self, kv_transfer_params: Any, reason: str) -> None:
        """A request with remote-prefill params was refused before admission: tell its prefill
        node to release the blocks now rather than at lease expiry (best effort: an unreachable
        or malformed address leaves it to the lease)."""
        transport = self.ctx.transport
        if transport is None or not isinstance(kv_transfer_params, Mapping):
            return
        if not wants_remote_prefill(kv_transfer_params):
            return
        try:
            host = kv_transfer_params["remote_host"]
            port = kv_transfer_params["remote_port"]
            remote_request_id = kv_transfer_params["remote_request_id"]
        except KeyError:
            return
        if not (isinstance(host, str) and isinstance(port, int) and 0 < port < 65536):
            return
        if not isinstance(remote_request_id, str):
            return
        notice = ReleaseNotice(host, port, remote_request_id, False, f"rejected: {reason}")
        get_loop_thread().submit(send_notice(transport, notice))

    # ================================================================== worker half
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Start this node's transport over the KV tensors (group order from the config)."""
        super().register_kv_caches(kv_caches)
        if self.ctx.transport is not None:
            raise RuntimeError("register_kv_caches called twice for one node's connector")
        by_group = [
            [kv_caches[name] for name in group.layer_names]
            for group in self.ctx.kv_cache_config.kv_cache_groups
        ]
        metadata = NodeMetadata.from_kv_caches(
            engine_id=self.ctx.config.engine_id,
            kv_caches_by_group=by_group,
            model_name=self.ctx.config.model_name,
            hash_fn_name=self.ctx.hash_fn_name,
        )
        metadata = replace(metadata, incarnation=str(self.ctx.incarnation))
        if self.ctx.offloader is not None:
            self.ctx.offloader.bind(by_group, metadata.compat_hash)
        transport = self._make_transport(metadata, by_group)
        transport.set_callbacks(**HolderCallbacks(self.ctx).as_kwargs())  # type: ignore[arg-type]
        get_loop_thread().run(transport.start(), _START_TIMEOUT_S)
        self.ctx.transport = transport
        self._puller.start_heartbeats(_START_TIMEOUT_S)
        if self.ctx.config.index_url:
            self._start_index(transport)
        logger.info(
            "%s: transport %s listening on %s:%d",
            self.ctx.config.engine_id,
            self.ctx.config.transport,
            *transport.address,
        )

    def _start_index(self, transport: Transport) -> None:
        config = self.ctx.config
        namespace = IndexNamespace(
            model_name=config.model_name,
            block_size=self.ctx.block_size,
            hash_fn_name=self.ctx.hash_fn_name,
        )
        index, directory = open_index(config.index_url, namespace)  # type: ignore[arg-type]
        client = IndexClient(
            index,
            directory,
            node_id=config.engine_id,
            incarnation=self.ctx.incarnation,
            group_ids=range(self.ctx.num_groups),
            ttl_s=config.index_ttl_s,
        )
        client.start(*transport.address)
        self.ctx.index_client = client

    def _make_transport(
        self, metadata: NodeMetadata, by_group: Sequence[Sequence[torch.Tensor]]
    ) -> Transport:
        config = self.ctx.config
        if config.transport == "loopback":
            if self.ctx.loopback_network is None:
                raise KVConnectorError("transport 'loopback' needs a LoopbackNetwork")
            return LoopbackTransport(
                metadata,
                by_group,
                network=self.ctx.loopback_network,
                host=config.host,
                port=config.port,
                faults=self.ctx.loopback_faults,
            )
        from kvbridge.transport import UcxxTransport  # ucxx is imported only when used

        return UcxxTransport(metadata, by_group, host=config.host, port=config.port, cma=config.cma)

    def start_load_kv(self, forward_context: ForwardContext) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBridgeConnectorMetadata):
            return
        transport = self.ctx.transport
        if transport is None:
            raise RuntimeError("start_load_kv before register_kv_caches")
        for notice in meta.notices:
            get_loop_thread().submit(send_notice(transport, notice))
        for plan in meta.reqs_to_recv.values():
            self._puller.submit(transport, plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-request pulls: a request runs only after its load settled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None  # the holder serves reads from its KV tensors; nothing to push

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.ctx.transport is not None:
            self._puller.cancel_aborted(self.ctx.transport, finished_req_ids)
        finished_recving, failed = self._puller.pop_settled()
        self._load_errors.update(failed)
        finished_sending, num_expired = self.ctx.leases.pop_finished()
        if num_expired:
            self.ctx.stats.add("num_expired_leases", num_expired)
            logger.warning("%d lease(s) expired without a completion notice", num_expired)
        return finished_sending or None, finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.ctx.offloader is not None:
            self.ctx.offloader.close()
        client, self.ctx.index_client = self.ctx.index_client, None
        if client is not None:
            client.close()
        transport, self.ctx.transport = self.ctx.transport, None
        if transport is None:
            return
        loop = get_loop_thread()

        async def _close() -> None:
            await self._puller.close()
            await transport.close()

        try:
            loop.run(_close(), _START_TIMEOUT_S)
        except Exception:  # shutting down: log, never raise
            logger.exception("%s: transport close failed", self.ctx.config.engine_id)


def _ticket(remote: RemotePrefillParams) -> tuple[str, int, str]:
    return (remote.remote_host, remote.remote_port, remote.remote_request_id)
