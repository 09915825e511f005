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
(DESIGN.md, "Reliability rules": a prefill node never pins blocks forever, a decode node never
waits forever: every pull has a deadline and every failure becomes failed blocks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from concurrent.futures import Future
from typing import NamedTuple

from kvbridge.transport import GroupRead, PeerAddress, TransferError, Transport

from .errors import KVConnectorError
from .loop_thread import get_loop_thread
from .metadata import PullPlan, ReleaseNotice, Ticket
from .release_notices import NOTIFY_TIMEOUT_S, DeferredNotices, send_notice, send_notices
from .stats import KVTransferStats

__all__ = ["PullOutcome", "Puller", "Settled", "WaitingTickets"]

logger = logging.getLogger(__name__)

LEASE_GRANT_RETRY_S = (0.01, 0.02, 0.05, 0.1, 0.2)
"""Waits before reading refused blocks again under a lease the holder has not been granted
yet (``ReadResult.lease_pending``: its next step hands the grant over; vLLM's engine steps
every millisecond while it holds blocks). Any other refusal ends the pull at once."""
SYNC_SETTLE_GRACE_S = 5.0
"""How long past its deadline ``wait_settled`` waits for a sync pull before calling it a bug
(the transport settles every read by its deadline, a cancelled one included)."""
TICKET_MAX_WAIT_S = 300.0
"""A ticket heart-beaten this long without its request's pull starting is dropped, so a request
lost between admission and the queue cannot pin a prefill node's blocks forever."""


class PullOutcome(NamedTuple):
    """How one pull settled: ``failed_local_block_ids`` did not land (empty on success)."""

    request_id: str
    failed_local_block_ids: tuple[int, ...]
    num_bytes: int
    error: str | None


class Settled(NamedTuple):
    """What ``Puller.pop_settled`` reports: ``request_ids`` of async pulls that settled
    (landed or not), the local blocks that did not land (sync pulls' too), and
    ``failed_request_ids``, the async pulls among ``request_ids`` with such blocks."""

    request_ids: set[str]
    failed_block_ids: set[int]
    failed_request_ids: set[str]


class WaitingTickets:
    """Handoff tickets of admitted requests whose pull has not started: their leases on the
    prefill node need heartbeats while the request waits in the queue (a queue longer than the
    lease would otherwise lose the blocks). The worker thread adds and removes (from the step's
    orders), the loop thread reads; one lock."""

    def __init__(self, max_wait_s: float = TICKET_MAX_WAIT_S) -> None:
        self._max_wait_s = max_wait_s
        self._added_at: dict[Ticket, float] = {}
        self._lock = threading.Lock()

    def add(self, ticket: Ticket) -> None:
        with self._lock:
            self._added_at.setdefault(ticket, time.monotonic())

    def discard(self, ticket: Ticket) -> None:
        with self._lock:
            self._added_at.pop(ticket, None)

    def snapshot(self) -> list[Ticket]:
        """The tickets to heartbeat now (older than ``max_wait_s`` ones are dropped)."""
        now = time.monotonic()
        with self._lock:
            for ticket in [t for t, at in self._added_at.items() if now - at > self._max_wait_s]:
                del self._added_at[ticket]
            return list(self._added_at)

    def __len__(self) -> int:
        with self._lock:
            return len(self._added_at)


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
        self._heartbeat_targets: dict[str, Ticket] = {}  # request id here -> its lease
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._notices: set[asyncio.Task[None]] = set()
        self._deferred_notices = DeferredNotices()  # one-sided loads' holders, told a step late

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
        holder = plan.holder
        started = time.monotonic()
        result = transport.read_one_sided(
            PeerAddress(holder.host, holder.port),
            plan.request_id,
            [g for g in plan.groups if g.local_block_ids],
            lease=plan.lease.lease_ref(),
            incarnation=holder.incarnation,
        )
        if result is None:
            return None
        self._record(plan, started, set(), result.num_bytes_landed, None)
        self.stats.add("bytes_received_same_host", result.num_bytes_landed)
        # the holder may free its blocks now; told a step later, because waking the connector
        # loop in this step would take the GIL from it (``DeferredNotices``)
        self._deferred_notices.add(ReleaseNotice(ticket=plan.lease, success=True, reason=""))
        return PullOutcome(plan.request_id, (), result.num_bytes_landed, None)

    def send_deferred_notices(self, transport: Transport) -> None:
        """End of a step (``get_finished``, after its forward): hand the release notices of the
        previous step's one-sided loads to the connector loop, with one wake-up for all
        (``DeferredNotices``: why a step late)."""
        notices = self._deferred_notices.end_step()
        if notices:
            get_loop_thread().submit(send_notices(transport, notices))

    def take_deferred_notices(self) -> list[ReleaseNotice]:
        """The release notices not yet handed to the loop (for a worker shutting down)."""
        return self._deferred_notices.take_all()

    def wait_settled(self, request_ids: list[str]) -> None:
        """Block the calling (worker) thread until the pulls of ``request_ids`` settled (landed
        or failed by their deadline, ``sync_load_timeout_s`` for a sync pull); their failed
        blocks are then reported by the next ``pop_settled``. The wait leaves the GIL to the
        connector loop.

        Raises:
            RuntimeError: a pull still unsettled ``SYNC_SETTLE_GRACE_S`` past its deadline
                (the forward must not run while bytes may still land in its blocks).
        """
        futures = [self._inflight[r] for r in request_ids if r in self._inflight]
        if not futures:
            return
        timeout_s = max(self.sync_load_timeout_s, self.load_timeout_s) + SYNC_SETTLE_GRACE_S
        _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        if pending:
            raise RuntimeError(
                f"{len(pending)} pull(s) of {request_ids} unsettled {timeout_s:.1f} s after "
                "they started: the transport missed a deadline"
            )

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
        """Pull one request's blocks. Never raises: every failure becomes failed blocks."""
        holder = plan.holder
        peer = PeerAddress(holder.host, holder.port)
        started = time.monotonic()
        deadline_at = started + (self.sync_load_timeout_s if plan.sync else self.load_timeout_s)
        if plan.refused:  # D refused the ticket itself: nothing to read, nobody to ask
            return self._settle(transport, plan, started, set(plan.local_block_ids()), 0,
                                plan.refused)
        failed: set[int] = set(plan.unloadable_block_ids)
        num_bytes = 0
        error: str | None = None
        if plan.lease is not None:  # a handoff under a lease (index pulls have none)
            self._heartbeat_targets[plan.request_id] = plan.lease
        try:
            peer_meta = await asyncio.wait_for(transport.connect(peer), deadline_at - started)
            if (peer_meta.engine_id, peer_meta.incarnation) != (
                holder.engine_id,
                holder.incarnation,
            ):
                raise KVConnectorError(
                    f"peer {peer.host}:{peer.port} is {peer_meta.engine_id}/"
                    f"{peer_meta.incarnation}, the plan names {holder.engine_id}/"
                    f"{holder.incarnation} (restarted or replaced)"
                )
            reads = [g for g in plan.groups if g.local_block_ids]
            refused, num_bytes = await self._read_under_lease(
                transport, peer, plan, reads, deadline_at
            )
            failed.update(refused)
            if refused:
                error = f"{len(refused)} block(s) changed on the holder"
        except TransferError as exc:
            failed.update(exc.local_block_ids)
            error = str(exc)
        except (TimeoutError, Exception) as exc:
            failed.update(plan.local_block_ids())
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self._heartbeat_targets.pop(plan.request_id, None)
        return self._settle(transport, plan, started, failed, num_bytes, error)

    def _settle(
        self,
        transport: Transport,
        plan: PullPlan,
        started: float,
        failed: set[int],
        num_bytes: int,
        error: str | None,
    ) -> PullOutcome:
        """Count a pull that ended (``failed``: its local blocks that did not land) and tell
        its holder to release the lease (in a task of its own: the request need not wait)."""
        peer = PeerAddress(plan.holder.host, plan.holder.port)
        self._record(plan, started, failed, num_bytes, error)
        if not failed and transport.peer_data_path(peer) == "cma":
            self.stats.add("bytes_received_same_host", num_bytes)
        if plan.lease is not None:
            # The holder may free its blocks now; the request need not wait for that.
            notice = ReleaseNotice(ticket=plan.lease, success=not failed, reason=error or "")
            task = asyncio.get_running_loop().create_task(send_notice(transport, notice))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)
        return PullOutcome(plan.request_id, tuple(sorted(failed)), num_bytes, error)

    async def _read_under_lease(
        self,
        transport: Transport,
        peer: PeerAddress,
        plan: PullPlan,
        reads: list[GroupRead],
        deadline_at: float,
    ) -> tuple[set[int], int]:
        """Read ``reads`` under the plan's lease (``Read.lease``, None for an index pull);
        returns the local blocks refused and the bytes landed.

        A handoff's lease reaches the holder's worker half only at the holder's next step
        after it answered the ticket, so a fast puller can arrive first and see its blocks
        refused. When the holder says so (``ReadResult.lease_pending``), refused blocks are
        read again after short waits (``LEASE_GRANT_RETRY_S``, never past the deadline). Any
        other refusal is final and ends the pull at once: another prompt's ticket (the lease
        names other hashes), a stale one (the lease ended), an index pull's evicted block.
        """
        num_bytes = 0
        refused: set[int] = set()
        waits = iter(LEASE_GRANT_RETRY_S if plan.lease is not None else ())
        lease = plan.lease.lease_ref() if plan.lease is not None else None
        while reads:
            result = await transport.read_blocks(
                peer,
                plan.request_id,
                reads,
                deadline_s=max(deadline_at - time.monotonic(), 1e-3),
                lease=lease,
            )
            num_bytes += result.num_bytes_landed
            refused = set(result.failed_local_block_ids)
            if not refused or not result.lease_pending:
                break
            wait_s = next(waits, None)
            if wait_s is None or time.monotonic() + wait_s >= deadline_at:
                break
            await asyncio.sleep(wait_s)
            reads = _only(reads, refused)
        return refused, num_bytes

    def _record(
        self, plan: PullPlan, started: float, failed: set[int], num_bytes: int, error: str | None
    ) -> None:
        stats = self.stats
        if plan.holder.tier == "store":  # a restore from the store tier
            landed = [b for g in plan.groups for b in g.local_block_ids if b not in failed]
            stats.add("num_restored_blocks", len(landed))
            stats.add("bytes_restored", num_bytes)
        if failed:
            stats.record_failed_load(num_failed_blocks=len(failed))
            logger.warning("pull of %s failed: %s", plan.request_id, error)
        else:
            stats.record_load(
                nbytes=num_bytes,
                num_blocks=sum(len(g.local_block_ids) for g in plan.groups),
                transfer_s=time.monotonic() - started,
                queue_s=started - plan.created_at,
            )

    async def _create_heartbeat_task(self, transport: Transport) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._heartbeat_loop(transport))

    async def _heartbeat_loop(self, transport: Transport) -> None:
        """Extend the leases of every pull in flight and of every admitted request still
        waiting for its pull, one message per holder; and send the release notices that no
        step has sent since the last tick (an engine that stopped stepping: ``DeferredNotices``)."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            notices = self._deferred_notices.take_all()
            if notices:
                await send_notices(transport, notices)
            by_peer: dict[PeerAddress, list[Ticket]] = {}
            for ticket in [*self._heartbeat_targets.values(), *self.waiting_tickets.snapshot()]:
                by_peer.setdefault(PeerAddress(ticket.host, ticket.port), []).append(ticket)
            for peer, tickets in by_peer.items():
                request_ids = [t.remote_request_id for t in tickets]
                tokens = [t.token for t in tickets]  # each lease's capability (``lease``)
                try:
                    await asyncio.wait_for(
                        transport.send_heartbeat(peer, request_ids, tokens), NOTIFY_TIMEOUT_S
                    )
                except Exception as exc:  # the pull's own deadline handles a dead holder
                    logger.debug("heartbeat to %s failed: %s", peer, exc)


def _only(reads: list[GroupRead], local_block_ids: set[int]) -> list[GroupRead]:
    """The parts of ``reads`` whose local block is in ``local_block_ids``."""
    out = []
    for g in reads:
        keep = [i for i, b in enumerate(g.local_block_ids) if b in local_block_ids]
        if keep:
            out.append(
                GroupRead(
                    group_id=g.group_id,
                    remote_block_ids=[g.remote_block_ids[i] for i in keep],
                    local_block_ids=[g.local_block_ids[i] for i in keep],
                    expected_hashes=None
                    if g.expected_hashes is None
                    else [g.expected_hashes[i] for i in keep],
                )
            )
    return out
