"""``KVBridgeScheduler``: the scheduler half of a node's connector (admission, matching,
allocation pairing, planning).

It owns no transport, no KV tensor and no thread of its own; everything it wants done on the
network goes to the worker half as that step's ``KVBridgeConnectorMetadata`` (``metadata.py``),
and everything it learns back arrives as the worker's per-step output (docs/architecture.md,
"The two connector halves"; vLLM: ``KVConnectorBase_V1`` with ``role=SCHEDULER``):

    admission       validate_kv_transfer_params   parse the ticket once; heart-beat it; warn of a
                                                  role mismatch (``role_check``)
    schedule()      get_num_new_matched_tokens    a ticket: (remote - local hit, load_mode);
                                                  no ticket: the index, asked asynchronously
                                                  (None = "ask again next step")
                    update_state_after_alloc      pair blocks by position -> PullPlan
                    build_connector_meta          this step's orders (pulls, notices, leases,
                                                  hash changes, offload)
    update_from_output()
                    update_connector_output       the worker's identity and statistics; the
                                                  step's block events go to the index
                    request_finished              prefill side: grant a lease, return the ticket

Tensor parallel: one worker half per rank, one scheduler half, which learns every rank's
transport (``set_xfer_handshake_metadata``), names them all in its tickets, sends each step's
orders to every rank (each pulls its own KV heads) and counts their reports once (``rank_reports``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvbridge.kvmanager.connector_interface import MatchedTokens, RequestFinishedResult
from kvbridge.kvmanager.coordinator import PrefixHitRule
from kvbridge.kvmanager.request import RequestStatus

from .block_events import PoolBatches, with_removals_of
from .config import KVTransferConfig
from .engine_ranks import EngineRanks, match_leases, rank_holders
from .errors import KVTransferParamsError
from .handoff import TicketRefusal, issue_ticket, ticket_refusal
from .index import IndexClient, IndexNamespace, open_index
from .index_match import IndexMatcher
from .load_mode import LoadModePolicy
from .metadata import (
    KVBridgeConnectorMetadata,
    KVBridgeWorkerMeta,
    PullPlan,
    ReleaseNotice,
    Ticket,
    WorkerHandshake,
)
from .pull_plan import RemoteMatch, cdiv, plan_group_pulls, sliding_windows_of
from .rank_reports import RankReports
from .role_check import RoleCheck
from .stats import KVTransferStats
from .store.offload_items import OffloadOutcome
from .store.planner import OffloadPlanner
from .ticket_board import ticket_on_board
from .transfer_params import (
    RemotePrefillParams,
    rank_tickets,
    release_notices_for_rejected,
    ticket_of,
    wants_remote_decode,
    wants_remote_prefill,
)

if TYPE_CHECKING:
    from kvbridge.kvmanager.block_pool import BlockPool
    from kvbridge.kvmanager.kv_cache_spec import KVCacheConfig
    from kvbridge.kvmanager.request import Request

__all__ = ["KVBridgeScheduler"]

logger = logging.getLogger(__name__)

_PRODUCER_DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_ASK_AGAIN, _NO_MATCH = MatchedTokens(None, False), MatchedTokens(0, False)


class KVBridgeScheduler:
    """The scheduler half. Owner: the engine thread (every method; nothing here is shared).

    Args:
        config: the node's validated settings.
        block_size: tokens per block (one block size for every group).
        num_groups: KV cache groups of the node.
        hash_fn_name: the block hash function (the worker's block identity names the same).
        kv_cache_config: the node's groups: index lookups find what the local coordinator's
            rule restores (``kvmanager.PrefixHitRule``); None: all taken as full attention.
        handoffs_only_alone: ``LoadModePolicy``'s (vLLM under ``recompute``).
    """

    def __init__(self, config: KVTransferConfig, *, block_size: int, num_groups: int,
                 hash_fn_name: str, kv_cache_config: KVCacheConfig | None = None,
                 handoffs_only_alone: bool = False) -> None:
        self.config = config
        self.kv_role = config.kv_role
        self.block_size = block_size
        self.num_groups = num_groups
        self.hash_fn_name = hash_fn_name
        self.stats = KVTransferStats()
        self.rank_reports = RankReports(self.stats)  # the ranks' reports, each request once
        self._load_async = config.load_mode != "sync"  # "auto": ``LoadModePolicy`` decides
        self._load_policy = LoadModePolicy(config.load_mode, num_groups, kv_cache_config,
                                           handoffs_only_alone=handoffs_only_alone)
        self._index_matcher = IndexMatcher(
            stats=self.stats, block_size=block_size, load_async=self._load_async,
            num_groups=num_groups, alone_wait_s=config.idle_lookup_wait_s,
            alone_loads_in_step=self._load_policy.alone_loads_in_step,
            min_gain_blocks=max(config.min_remote_hit_blocks,  # a hit must add this many
                                cdiv(config.min_remote_hit_tokens, block_size)))
        self.worker: WorkerHandshake | None = None  # rank 0's
        self.ranks = EngineRanks((), None)  # every rank's handshake and the heads' layout
        self.index_client: IndexClient | None = None
        self._block_pool: BlockPool | None = None
        self._pool_batches: PoolBatches | None = None
        self._tickets: dict[str, RemotePrefillParams] = {}  # parsed once, at admission
        self._waiting: dict[str, list[Ticket]] = {}  # admitted, pull not planned: every P rank's
        self._matches: dict[str, RemoteMatch] = {}
        self._meta = KVBridgeConnectorMetadata()
        self._store_engine_ids: set[str] = set()
        self._hit_rule = kv_cache_config and PrefixHitRule(kv_cache_config)
        self._sliding_windows = sliding_windows_of(kv_cache_config, num_groups)
        self._role_check = RoleCheck(self.kv_role, self.stats)
        self.offload_planner: OffloadPlanner | None = None if config.offload == "off" else \
            OffloadPlanner(policy=config.offload, blocks_per_step=config.offload_blocks_per_step,
                           scan_blocks=config.offload_scan_blocks,
                           max_offloaded=config.offload_remember_blocks)

    # ------------------------------------------------------------------ wiring
    def bind_block_pool(self, block_pool: BlockPool, take_events: Any, settle: Any = None) -> None:
        """Give the half the node's block pool (offload's cold-block picks, the index's resyncs:
        ``BlockPool``'s public API, this thread), the manager's ``take_events`` (a list of
        events, or a batch whose events are built after the step: ``block_events.PoolBatches``)
        and what to call after each step's publish (``settle``, or None)."""
        self._block_pool = block_pool
        self._pool_batches = PoolBatches(take_events, settle)
        if self.index_client is not None:
            self.index_client.resync_from(block_pool)

    # ------------------------------------------------------------------ admission
    def ticket_for(self, request_id: str, params: Mapping[str, Any],
                   num_prompt_tokens: int | None = None) -> RemotePrefillParams:
        """The parsed handoff ticket of ``request_id`` (parsed on first use, then kept). Raises
        KVTransferParamsError naming the bad field (counted in ``num_rejected_params``)."""
        ticket = self._tickets.get(request_id)
        if ticket is None:
            try:
                ticket = RemotePrefillParams.parse(
                    params, num_groups=self.num_groups, block_size=self.block_size,
                    num_prompt_tokens=num_prompt_tokens, local_tp=self.ranks.tp_layout,
                )
            except KVTransferParamsError:
                self.stats.add("num_rejected_params")
                raise
            self._tickets[request_id] = ticket
            self._waiting[request_id] = rank_tickets(ticket)
            self._meta.tickets_to_watch.extend(rank_tickets(ticket))
        return ticket

    def validate_kv_transfer_params(self, request_id: str, kv_transfer_params: Mapping[str, Any],
                                    num_prompt_tokens: int | None = None) -> None:
        """Refuse malformed remote-prefill params at admission (``KVTransferParamsError``);
        an admitted ticket's lease is heart-beaten while the request waits in the queue."""
        self._role_check.check(request_id, kv_transfer_params)
        if self.kv_role.is_consumer and wants_remote_prefill(kv_transfer_params):
            self.ticket_for(request_id, kv_transfer_params, num_prompt_tokens)

    def admit(self, request_id: str) -> None:
        """``request_id`` was queued, whatever its params; it is live until request_finished."""
        self._index_matcher.admit(request_id)

    def on_request_rejected(self, kv_transfer_params: Any, reason: str) -> None:
        """A request with remote-prefill params was refused before admission: ask its prefill
        node (every rank) to release the blocks now (``release_notices_for_rejected``)."""
        self._meta.notices.extend(release_notices_for_rejected(kv_transfer_params, reason))

    # ------------------------------------------------------------------ schedule()
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> MatchedTokens:
        params = request.kv_transfer_params
        if not (self.kv_role.is_consumer and wants_remote_prefill(params)):
            return self.match_from_index(request, num_computed_tokens)
        try:
            ticket = self.ticket_for(request.request_id, params)  # type: ignore[arg-type]
        except KVTransferParamsError as exc:
            # Normally refused at admission; never let bad params stop the step.
            logger.warning("request %s: %s; computing locally", request.request_id, exc)
            return MatchedTokens(0, False)
        # The last prompt token is recomputed for its logits anyway: never plan it as external
        # (a sliding-window group then keeps the block that token's window starts in).
        num_remote = min(ticket.remote_num_tokens, request.num_prompt_tokens - 1)
        num_new = max(num_remote - num_computed_tokens, 0)
        refusal = ticket_refusal(
            ticket, request, num_computed_tokens=num_computed_tokens, num_remote=num_remote,
            block_size=self.block_size, sliding_windows=self._sliding_windows) if num_new else None
        ranks = rank_holders(ticket)
        holder = ranks[0]
        board = self._load_policy.board_of(holder) if num_new and not refusal else None
        if board is not None:  # P's block board, read before a step takes the load
            refusal = ticket_on_board(
                board, ticket, request, num_computed_tokens=num_computed_tokens,
                num_remote=num_remote, block_size=self.block_size)
        if refusal and (refusal.window_gap or self.config.load_failure_policy == "recompute"):
            return self._compute_locally(request, ticket, refusal)
        # vLLM: no async load of zero tokens
        num_blocks = cdiv(num_remote, self.block_size) - num_computed_tokens // self.block_size
        load_async = num_new > 0 and self._load_async and not self._load_policy.loads_in_step(
            holder, num_blocks, alone=self._index_matcher.alone(request.request_id))
        self._matches[request.request_id] = RemoteMatch(
            holder=holder, remote_block_ids=ticket.remote_block_ids, ticket=ticket_of(ticket),
            num_local_tokens=num_computed_tokens, num_remote_tokens=num_remote,
            load_async=load_async, remote_ranks=ranks if len(ranks) > 1 else (),
            refused=refusal.reason if refusal else "")
        return MatchedTokens(num_new, load_async)

    def _compute_locally(self, request: Request, ticket: RemotePrefillParams,
                         refusal: TicketRefusal) -> MatchedTokens:
        """D computes ``request`` itself (``handoff``: a window gap, or another prompt's ticket
        under ``recompute``, counted as a failed load): P releases now, the ticket is used up."""
        logger.warning("request %s: %s; computing it locally", request.request_id, refusal.reason)
        self._forget_waiting(request.request_id)
        request.kv_transfer_params["do_remote_prefill"] = False  # type: ignore[index]
        self._meta.notices.extend(ReleaseNotice(ticket=t, success=False, reason=refusal.reason)
                                  for t in rank_tickets(ticket))
        if refusal.window_gap:
            self.stats.add("num_window_gaps")
        else:
            self.stats.record_failed_load(num_failed_blocks=refusal.num_blocks)
        return MatchedTokens(0, False)

    def match_from_index(self, request: Request, num_computed_tokens: int) -> MatchedTokens:
        """No ticket, so the index is asked for the request's longest prefix held elsewhere
        (docs/architecture.md, "Life of an index hit"; ``index_match.IndexMatcher``); None
        ("ask again") until it has answered. What ``get_num_new_matched_tokens`` answers for a
        request without ``kv_transfer_params``, which may come here directly."""
        answer = self._index_matcher.match(self.index_client, request, num_computed_tokens)
        if answer.pending:
            return _ASK_AGAIN
        match = answer.match
        if match is None:
            return _NO_MATCH
        self._matches[request.request_id] = match
        return MatchedTokens(match.num_remote_tokens - num_computed_tokens, match.load_async)

    def index_lookup_pending(self, request_id: str) -> bool:
        """True while ``request_id``'s index lookup is out, so ``get_num_new_matched_tokens``
        would answer None again (``IndexMatcher.pending``: O(1), nothing allocated). vLLM asks
        about every waiting request at every step; the adapter answers these without a view."""
        return self._index_matcher.pending(self.index_client, request_id)

    def match_tier(self, request_id: str) -> str | None:
        """The matched holder's tier (``HolderRef.tier``) until the allocation; None: none."""
        match = self._matches.get(request_id)
        return None if match is None else match.holder.tier

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        match = self._matches.pop(request.request_id, None)
        if match is None:
            return
        if match.ticket is not None:
            # The pull (or the notice below) takes over from the queue's heartbeats. The ticket
            # is used once (as vLLM's NIXL connector does): a request preempted after its pull
            # must not pull again from blocks the holder has released since.
            self._forget_waiting(request.request_id)
            if isinstance(request.kv_transfer_params, dict):
                request.kv_transfer_params["do_remote_prefill"] = False
            if num_external_tokens == 0:
                # The local prefix cache covers everything P offered: P (every rank) releases.
                self._meta.notices.extend(ReleaseNotice(
                    ticket=t, success=True, reason="local prefix hit") for t in match_leases(match))
                return
        if num_external_tokens == 0:
            return
        if match.ticket is None:  # a remote hit counts once, when its blocks are allocated
            self._index_matcher.note_pull(request.request_id)
            self.stats.add("num_index_hits")
            hit_tokens = "store_hit_tokens" if match.holder.tier == "store" else "remote_hit_tokens"
            self.stats.add(hit_tokens, num_external_tokens)
        start_block = match.num_local_tokens // self.block_size
        end_block = cdiv(match.num_local_tokens + num_external_tokens, self.block_size)
        groups, unloadable = plan_group_pulls(
            local_block_ids=blocks.get_block_ids(),
            remote_block_ids=match.remote_block_ids,
            start_block=start_block,
            end_block=end_block,
            block_hashes=request.block_hashes,
        )
        if match.refused:  # a load that fails under the policy without reading anything
            unloadable = [*unloadable, *(b for g in groups for b in g.local_block_ids)]
            groups = []
        self._meta.pulls.append(
            PullPlan(
                request_id=request.request_id,
                holder=match.holder,
                lease=match.ticket,
                groups=groups,
                unloadable_block_ids=unloadable,
                num_external_tokens=num_external_tokens,
                created_at=time.monotonic(),
                sync=not match.load_async,
                remote_ranks=list(match.remote_ranks),
                refused=match.refused,
            ))
        self.stats.record_pull_planned(match.holder.engine_id, via_index=match.ticket is None,
                                       num_blocks=sum(len(g.local_block_ids) for g in groups))

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeConnectorMetadata:
        """This step's orders; the step's block events are taken here (their hash changes
        travel with the orders) and published to the index after the forward. A step that
        computes nothing while index lookups are out first waits up to
        ``config.idle_lookup_wait_s`` for one's answer (``IndexClient.wait_for_answer``)."""
        batches = self._pool_batches
        batch = None if batches is None else batches.take(publish=bool(self.config.index_url))
        if batches is not None and self.config.index_url:
            self._meta.step_id = batches.num_steps  # the worker's report of the step names it
            if batch is not None:
                self._meta.block_hashes = batch.hash_delta()
        if self.offload_planner is not None:
            self.offload_planner.observe(() if batch is None else batch.events())
            if self._block_pool is not None:  # this step's schedule may have reused a pick
                items = self._meta.offload_items
                self._meta.offload_items = self.offload_planner.drop_reused(items, self._block_pool)
        meta, self._meta = self._meta, KVBridgeConnectorMetadata()
        num_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        meta.num_scheduled_tokens = num_tokens if type(num_tokens) is int else None
        if num_tokens == 0 and self.index_client is not None and self.config.idle_lookup_wait_s:
            self.index_client.wait_for_answer(self.config.idle_lookup_wait_s)
        return meta

    # ------------------------------------------------------------------ update_from_output()
    def update_connector_output(
        self, worker_meta: KVBridgeWorkerMeta | Sequence[KVBridgeWorkerMeta] | None,
        unwritten_block_ids: Collection[int] = (),
    ) -> list[OffloadOutcome]:
        """Learn the workers' identity and statistics from this step's reports (one, or every
        rank's); publish the step's block events, then the removal of ``unwritten_block_ids``
        (vLLM's ``invalid_block_ids``: a failed sync load's, cached before it); plan the next
        offloads. Returns the offload outcomes settled (``RankReports.apply_step``). Only the
        steps up to the one these reports end (``step_id``) are published: ``allocate_slots``
        hashes a step's new full blocks before their KV is computed, and vLLM's async
        scheduling the next step's before this step's output comes back."""
        metas = [] if worker_meta is None else \
            [worker_meta] if isinstance(worker_meta, KVBridgeWorkerMeta) else list(worker_meta)
        outcomes = self.rank_reports.apply_step(metas)
        for meta in metas:
            self._load_policy.observe(meta.one_sided_holders)
        if self.index_client is not None:  # every step: a resync the index asked for is read here
            batches, ends = self._pool_batches, [meta.step_id for meta in metas if meta.step_id]
            self.index_client.publish(() if batches is None else with_removals_of(
                batches.unpublished_events(min(ends, default=None)), unwritten_block_ids))
        if self.offload_planner is not None and self._block_pool is not None:
            # After this step's frees and before the next schedule can reuse a cold block: the
            # worker snapshots the picks at the next step's start, before its forward writes.
            incarnation = max((meta.store_incarnation for meta in metas), default=0)
            self.offload_planner.apply_outcomes(outcomes, incarnation)
            items = self._meta.offload_items  # async scheduling: two outputs, one step
            items += self.offload_planner.plan(self._block_pool, num_planned=len(items))
        return outcomes

    def set_xfer_handshake_metadata(
        self, handshake: WorkerHandshake | Mapping[int, WorkerHandshake]
    ) -> None:
        """Learn the worker halves' transports (once, before the first step): one handshake,
        or every rank's by tp rank (vLLM's ``set_xfer_handshake_metadata``); with an index
        configured, register this node there under rank 0's address and incarnation.

        Raises:
            RuntimeError: a second call (a restarted worker needs a new scheduler half).
            ValueError: ranks that do not make one engine: a missing rank, or ranks that
                disagree on the tensor-parallel size or the model's KV heads.
        """
        if self.worker is not None:
            raise RuntimeError("the worker half's handshake arrived twice")
        self.ranks = EngineRanks.of(handshake)
        self.worker = self.ranks.workers[0]
        self.rank_reports.set_num_ranks(self.ranks.tp_size)
        if self.config.index_url:
            self._start_index(self.worker)

    def _start_index(self, worker: WorkerHandshake) -> None:
        # The block identity the worker's transport announces (its tensors' dtype and layout);
        # a TP engine's blocks are found by engines of its layout only.
        namespace = IndexNamespace(identity=worker.identity,
                                   kv_heads_layout=self.ranks.index_layout())
        index, directory = open_index(self.config.index_url, namespace,  # type: ignore[arg-type]
                                      socket_timeout_s=self.config.index_socket_timeout_s)
        client = IndexClient(
            index, directory,
            node_id=self.config.engine_id,
            incarnation=int(worker.incarnation),
            group_ids=range(self.num_groups),
            ttl_s=self.config.index_ttl_s,
            lookup_timeout_s=self.config.index_lookup_timeout_s,
            hit_rule=self._hit_rule,
        )
        if self._block_pool is not None:
            client.resync_from(self._block_pool)
        client.start(worker.host, worker.port)
        self.index_client = client

    def take_events(self) -> Iterable[Any]:
        """The block pool's events this half drained since the last call."""
        return [] if self._pool_batches is None else self._pool_batches.take_events()

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> RequestFinishedResult:
        request_id = request.request_id
        self._matches.pop(request_id, None)
        self._index_matcher.forget(self.index_client, request_id)
        self._tickets.pop(request_id, None)
        waiting = self._forget_waiting(request_id)
        if waiting is not None:  # finished (aborted) before its pull: release P's blocks now
            self._meta.notices.extend(ReleaseNotice(
                ticket=t, success=False, reason="finished before its pull") for t in waiting)
        params = request.kv_transfer_params
        if not (self.kv_role.is_producer and wants_remote_decode(params)):
            return RequestFinishedResult(False, None)
        if request.status not in _PRODUCER_DONE or self.worker is None:
            return RequestFinishedResult(False, None)  # aborted or failed: nothing to hand over
        grant, ticket = issue_ticket(request, block_ids, engine_id=self.config.engine_id,
                                     worker=self.worker, block_size=self.block_size,
                                     lease_s=self.config.lease_s,
                                     tp_fields=self.ranks.ticket_fields())
        self._meta.lease_grants.append(grant)
        return RequestFinishedResult(True, ticket.to_dict())

    def _forget_waiting(self, request_id: str) -> list[Ticket] | None:
        tickets = self._waiting.pop(request_id, None)
        if tickets is not None:
            self._meta.tickets_to_forget.extend(tickets)
        return tickets

    def has_pending_orders(self) -> bool:
        """True when the next ``build_connector_meta`` carries orders for the worker half."""
        m = self._meta
        return any((m.pulls, m.notices, m.lease_grants, m.tickets_to_watch, m.tickets_to_forget))

    def shutdown(self) -> None:
        client, self.index_client = self.index_client, None
        if client is not None:
            client.close()

