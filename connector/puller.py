"""The puller side of a node: pulls a request's KV from its holder and reports when it settled.

``Puller`` runs every pull as a task on the connector's event-loop thread
(``loop_thread.get_loop_thread``), so a scheduling step never waits on the network:

    start_load_kv  -> submit(plan)         one task per request
                   -> wait_settled(ids)    only the sync pulls (``PullPlan.sync``): this step's
                                           forward reads their blocks
    (task)         -> connect, check the holder's identity, read_blocks, completion notice
    get_finished   -> pop_settled()        requests whose async pull landed, failed or was
                                           cancelled, and the local blocks (of every pull,
                                           sync ones too) that did not land

While a pull is in flight its holder's lease is extended by heartbeats, grouped per holder
(docs/architecture.md, "Reliability rules": a prefill node never pins blocks forever, a decode
node never waits forever: every pull has a deadline, every failure becomes failed blocks).

Tensor parallelism (``tp_layout``): a rank reads its KV heads from the holder's ranks holding
them, one read per source rank at once; the holder refuses heads it does not hold. Heartbeats
and release notices go to every holder rank (``heartbeats``, ``release_notices``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from concurrent.futures import Future
from typing import NamedTuple

from kvbridge.transport import (
    PeerAddress,
    PeerUnreachableError,
    TransferError,
    Transport,
    format_host_port,
)

from .errors import KVConnectorError, unreachable_reason
from .heartbeats import WaitingTickets, heartbeat_loop
from .lease_reads import read_under_lease
from .loop_thread import get_loop_thread
from .metadata import HolderRef, PullPlan, PullReport, ReleaseNotice, Ticket
from .pull_plan import PullSource, pull_sources, source_error
from .release_notices import DeferredNotices, PullerRank, send_notice, send_notices
from .stats import KVTransferStats
from .tp_layout import TPLayout

__all__ = ["PullOutcome", "Puller", "Settled"]

logger = logging.getLogger(__name__)

SYNC_SETTLE_GRACE_S = 5.0
"""How long past its deadline ``wait_settled`` waits for a sync pull before calling it a bug
(the transport settles every read by its deadline, a cancelled one included)."""


class PullOutcome(NamedTuple):
    """How one pull settled: ``failed_local_block_ids`` did not land (empty on success)."""

    request_id: str
    failed_local_block_ids: tuple[int, ...]
    num_bytes: int
    error: str | None


class _Part(NamedTuple):
    """How the read from one of a pull's source ranks ended."""

    failed: set[int]
    num_bytes: int
    error: str | None
    same_host: bool


class Settled(NamedTuple):
    """What ``Puller.pop_settled`` reports: ``request_ids`` of async pulls that settled
    (landed or not), the local blocks that did not land (sync pulls' too), and
    ``failed_request_ids``, the async pulls among ``request_ids`` with such blocks."""

    request_ids: set[str]
    failed_block_ids: set[int]
    failed_request_ids: set[str]


class Puller:
    """Pulls in flight on one node.

    Owners: the worker thread calls ``start_heartbeats``, ``submit``, ``cancel_aborted`` and
    ``pop_settled`` (``_inflight`` is its own); the pull tasks and the heartbeat loop run on the
    connector loop thread (``_heartbeat_targets`` is theirs); ``waiting_tickets`` and ``stats``
    lock themselves.

    Args:
        load_timeout_s: deadline of one pull.
        heartbeat_interval_s: how often the leases of pulls in flight and waiting tickets are
            extended.
        stats: the worker half's statistics.
        sync_load_timeout_s: deadline of one sync pull (``PullPlan.sync``; the engine step
            waits for it).
    """

    def __init__(
        self,
        *,
        load_timeout_s: float,
        heartbeat_interval_s: float,
        stats: KVTransferStats,
        sync_load_timeout_s: float = 2.0,
    ) -> None:
        self.load_timeout_s = load_timeout_s
        self.sync_load_timeout_s = sync_load_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.stats = stats
        self.waiting_tickets = WaitingTickets()
        self._inflight: dict[str, Future[PullOutcome]] = {}
        self._sync: set[str] = set()  # requests of ``_inflight`` whose pull is sync
        # local request id -> (holder, request id on the holder), for heartbeats
        self._heartbeat_targets: dict[str, list[Ticket]] = {}  # request id here -> its leases
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._notices: set[asyncio.Task[None]] = set()
        self._deferred_notices = DeferredNotices()  # one-sided loads' holders, told a step late
        self.tp_layout: TPLayout | None = None
        """This rank's place in a tensor-parallel engine (set before the first pull; None: a
        worker that does not name its KV heads, which reads whole blocks of one rank)."""
        self._reports: list[PullReport] = []  # settled pulls not yet reported (``take_reports``)
        self._reports_lock = threading.Lock()

    @property
    def puller_rank(self) -> PullerRank:
        """Who sends this node's release notices: its rank of how many."""
        layout = self.tp_layout
        return PullerRank(0, 1) if layout is None else PullerRank(layout.tp_rank, layout.tp_size)

    def take_reports(self) -> list[PullReport]:
        """The pulls that settled since the last call (any thread)."""
        with self._reports_lock:
            reports, self._reports = self._reports, []
        return reports

    def sources(self, plan: PullPlan) -> list[PullSource]:
        """Where this rank reads ``plan`` from (``pull_plan.pull_sources``)."""
        return pull_sources(plan, self.tp_layout)

    # ------------------------------------------------------------------ engine thread
    def start_heartbeats(self, transport: Transport, timeout_s: float) -> None:
        """Start the heartbeat task on the connector loop (once, after the transport)."""
        self._heartbeat_task = get_loop_thread().run(
            self._create_heartbeat_task(transport), timeout_s
        )

    def submit(self, transport: Transport, plan: PullPlan) -> None:
        """Start pulling ``plan``: a handoff the transport can read one-sided from a holder it
        knows lands here and now (``_pull_here``); any other pull starts on the connector loop
        (returns at once). Raises RuntimeError if that request already has a pull in flight."""
        if plan.request_id in self._inflight:
            raise RuntimeError(f"request {plan.request_id!r} already has a pull in flight")
        outcome = self._pull_here(transport, plan)
        if outcome is not None:
            landed: Future[PullOutcome] = Future()
            landed.set_result(outcome)
            self._inflight[plan.request_id] = landed
        else:
            self._inflight[plan.request_id] = get_loop_thread().submit(
                self._pull(transport, plan)
            )
        if plan.sync:
            self._sync.add(plan.request_id)

    def _pull_here(self, transport: Transport, plan: PullPlan) -> PullOutcome | None:
        """A handoff read on the calling (worker) thread, checked on the holder's block board
        alone (``Transport.read_one_sided``): no hop to the connector loop and back, so the
        request is reported by this step's ``get_finished``. None: the pull must go through
        ``_pull`` (nothing counted)."""
        if plan.lease is None or plan.unloadable_block_ids:
            return None
        started = time.monotonic()
        groups = [g for g in plan.groups if g.local_block_ids]
        num_bytes = 0
        for holder, heads in self.sources(plan):  # one source whose board declines: ask them
            result = transport.read_one_sided(
                PeerAddress(holder.host, holder.port),
                plan.request_id,
                groups,
                lease=plan.lease.lease_ref(),
                incarnation=holder.incarnation,
                heads=heads,
            )
            if result is None:
                return None
            num_bytes += result.num_bytes_landed
        self._record(plan, started, set(), num_bytes, None)
        self.stats.add("bytes_received_same_host", num_bytes)
        # the holder may free its blocks now; told a step later, because waking the connector
        # loop in this step would take the GIL from it (``DeferredNotices``)
        for ticket in plan.rank_leases():
            self._deferred_notices.add(ReleaseNotice(ticket=ticket, success=True, reason=""))
        return PullOutcome(plan.request_id, (), num_bytes, None)

    def send_deferred_notices(self, transport: Transport) -> None:
        """End of a step (``get_finished``, after its forward): hand the release notices of the
        previous step's one-sided loads to the connector loop, with one wake-up for all
        (``DeferredNotices``: why a step late)."""
        notices = self._deferred_notices.end_step()
        if notices:
            get_loop_thread().submit(send_notices(transport, notices, self.puller_rank))

    def take_deferred_notices(self) -> list[ReleaseNotice]:
        """The release notices not yet handed to the loop (for a worker shutting down)."""
        return self._deferred_notices.take_all()

    def wait_settled(self, request_ids: list[str]) -> set[int]:
        """Block the calling (worker) thread until the pulls of ``request_ids`` settled (landed
        or failed by their deadline, ``sync_load_timeout_s`` for a sync pull); returns their
        local blocks that did not land, which the next ``pop_settled`` reports too. The wait
        leaves the GIL to the connector loop.

        Raises:
            RuntimeError: a pull still unsettled ``SYNC_SETTLE_GRACE_S`` past its deadline
                (the forward must not run while bytes may still land in its blocks).
        """
        futures = [self._inflight[r] for r in request_ids if r in self._inflight]
        if not futures:
            return set()
        timeout_s = max(self.sync_load_timeout_s, self.load_timeout_s) + SYNC_SETTLE_GRACE_S
        _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        if pending:
            raise RuntimeError(
                f"{len(pending)} pull(s) of {request_ids} unsettled {timeout_s:.1f} s after "
                "they started: the transport missed a deadline"
            )
        return {block_id for future in futures
                for block_id in future.result().failed_local_block_ids}

    def cancel_aborted(self, transport: Transport, finished_req_ids: set[str]) -> None:
        """Cancel the pulls of requests that finished (aborted) while their load was in flight;
        they are still reported by ``pop_settled`` once settled, and until then the scheduler
        keeps their blocks, so nobody else can be handed them."""
        for req_id in finished_req_ids:
            future = self._inflight.get(req_id)
            if future is not None and not future.done():
                get_loop_thread().submit(transport.cancel(req_id))

    @property
    def num_inflight(self) -> int:
        """Pulls submitted and not yet popped by ``pop_settled``."""
        return len(self._inflight)

    def wait_for_any(self, timeout_s: float) -> bool:
        """Block the calling (worker) thread until a pull in flight settles, at most
        ``timeout_s`` seconds; returns at once when none is in flight or one has settled
        already. True when some pull has settled (``pop_settled`` will report it). The wait
        holds no lock and leaves the GIL, so the connector loop runs the pulls meanwhile."""
        pending = list(self._inflight.values())
        if not pending or timeout_s <= 0:
            return any(f.done() for f in pending)
        done, _ = concurrent.futures.wait(
            pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
        )
        return bool(done)

    def pop_settled(self) -> Settled:
        """Requests whose async pull settled since the last call, and the local blocks (of
        every pull settled, sync ones too) that did not land. Each request is reported once; a
        sync pull's request never is (vLLM expects no ``finished_recving`` for it)."""
        settled = Settled(set(), set(), set())
        for req_id, future in list(self._inflight.items()):
            if future.done():
                del self._inflight[req_id]
                failed = future.result().failed_local_block_ids
                settled.failed_block_ids.update(failed)
                if req_id in self._sync:
                    self._sync.discard(req_id)
                else:
                    settled.request_ids.add(req_id)
                    if failed:
                        settled.failed_request_ids.add(req_id)
        return settled

    async def close(self) -> None:
        """Stop heart-beating (on the connector loop)."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()

    # ------------------------------------------------------------------ connector loop
    async def _pull(self, transport: Transport, plan: PullPlan) -> PullOutcome:
        """Pull one request's blocks: one read per source rank (``sources``), all at once.
        Never raises: every failure becomes failed blocks."""
        started = time.monotonic()
        deadline_at = started + (self.sync_load_timeout_s if plan.sync else self.load_timeout_s)
        if plan.refused:  # D refused the ticket itself: nothing to read, nobody to ask
            return self._settle(transport, plan, started, set(plan.local_block_ids()), 0,
                                plan.refused)
        failed: set[int] = set(plan.unloadable_block_ids)
        num_bytes = 0
        errors: list[str] = []
        if failed:  # the holder's null block at a position D needs: a wrong ticket
            errors.append(f"{len(failed)} block(s) the holder's table names as its null block")
        leases = plan.rank_leases()  # a handoff under a lease (index pulls have none)
        if leases:
            self._heartbeat_targets[plan.request_id] = leases
        try:
            parts = await asyncio.gather(
                *(
                    self._pull_part(transport, plan, holder, heads, deadline_at)
                    for holder, heads in self.sources(plan)
                )
            )
        except Exception as exc:  # sources() refused the plan: nothing was read
            parts = [_Part(set(plan.local_block_ids()), 0, f"{type(exc).__name__}: {exc}", False)]
        finally:
            self._heartbeat_targets.pop(plan.request_id, None)
        for part in parts:
            failed.update(part.failed)
            num_bytes += part.num_bytes
            if part.error:
                errors.append(part.error)
        same_host = all(part.same_host for part in parts)
        return self._settle(transport, plan, started, failed, num_bytes,
                            "; ".join(errors) or None, same_host=same_host)

    def _settle(
        self,
        transport: Transport,
        plan: PullPlan,
        started: float,
        failed: set[int],
        num_bytes: int,
        error: str | None,
        *,
        same_host: bool = False,
    ) -> PullOutcome:
        """Count a pull that ended (``failed``: its local blocks that did not land; ``same_host``:
        every byte came by a same-host copy) and tell every rank of its holder to release the
        lease (in tasks of their own: the request need not wait for that)."""
        self._record(plan, started, failed, num_bytes, error)
        if not failed and same_host:
            self.stats.add("bytes_received_same_host", num_bytes)
        for ticket in plan.rank_leases():
            notice = ReleaseNotice(ticket=ticket, success=not failed, reason=error or "")
            task = asyncio.get_running_loop().create_task(
                send_notice(transport, notice, self.puller_rank)
            )
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)
        return PullOutcome(plan.request_id, tuple(sorted(failed)), num_bytes, error)

    async def _pull_part(
        self,
        transport: Transport,
        plan: PullPlan,
        holder: HolderRef,
        heads: tuple[int, int] | None,
        deadline_at: float,
    ) -> _Part:
        """Read the KV ``heads`` of ``plan``'s blocks from one rank of the holder. Never
        raises: every failure becomes failed blocks (all of the plan's, when the bytes of
        some may have landed)."""
        peer = PeerAddress(holder.host, holder.port)
        failed: set[int] = set()
        num_bytes = 0
        error: str | None = None
        try:
            try:
                peer_meta = await asyncio.wait_for(transport.connect(peer),
                                                   deadline_at - time.monotonic())
            except TimeoutError:
                raise TimeoutError(f"no handshake with {holder.engine_id} at "
                                   f"{format_host_port(*peer)} before the deadline") from None
            if (peer_meta.engine_id, peer_meta.incarnation) != (
                holder.engine_id,
                holder.incarnation,
            ):
                raise KVConnectorError(
                    f"peer {format_host_port(*peer)} is {peer_meta.engine_id}/"
                    f"{peer_meta.incarnation}, the plan names {holder.engine_id}/"
                    f"{holder.incarnation} (restarted or replaced)"
                )
            error = source_error(plan, self.tp_layout, peer_meta, heads)
            if error is not None:  # before any read: the holder's layout cannot serve it
                raise KVConnectorError(error)
            reads = [g for g in plan.groups if g.local_block_ids]
            refused, num_bytes = await read_under_lease(
                transport, peer, plan, reads, deadline_at, heads
            )
            failed.update(refused)
            if refused:
                error = "; ".join(filter(None, (
                    error, f"{len(refused)} block(s) changed on the holder")))
        except TransferError as exc:
            failed.update(exc.local_block_ids)
            error = str(exc)
        except PeerUnreachableError as exc:
            failed.update(plan.local_block_ids())
            error = unreachable_reason(exc, holder.engine_id)
        except (TimeoutError, Exception) as exc:
            failed.update(plan.local_block_ids())
            error = f"{type(exc).__name__}: {exc}"
        return _Part(failed, num_bytes, error, transport.peer_data_path(peer) == "cma")

    def _record(
        self, plan: PullPlan, started: float, failed: set[int], num_bytes: int, error: str | None
    ) -> None:
        stats = self.stats
        num_blocks = sum(len(g.local_block_ids) for g in plan.groups)
        report = PullReport(plan.request_id, num_blocks, len(failed), time.monotonic() - started,
                            started - plan.created_at)
        with self._reports_lock:
            self._reports.append(report)
        if plan.holder.tier == "store":  # a restore from the store tier
            landed = [b for g in plan.groups for b in g.local_block_ids if b not in failed]
            stats.add("num_restored_blocks", len(landed))
            stats.add("bytes_restored", num_bytes)
        if failed:
            stats.record_failed_load(num_failed_blocks=len(failed))
            logger.warning("pull of %s failed: %s", plan.request_id, error)
        else:
            stats.record_load(nbytes=num_bytes, num_blocks=num_blocks,
                              transfer_s=report.transfer_s, queue_s=report.queue_s)

    async def _create_heartbeat_task(self, transport: Transport) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(heartbeat_loop(
            transport, interval_s=self.heartbeat_interval_s, deferred=self._deferred_notices,
            in_flight=lambda: [t for ts in self._heartbeat_targets.values() for t in ts],
            waiting=self.waiting_tickets, puller_rank=self.puller_rank))
