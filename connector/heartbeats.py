"""Heartbeats: a puller keeping alive the leases of the handoffs it still needs.

A handoff's prefill node holds the request's blocks under a lease that ends unless the decode
node's heartbeats extend it (docs/architecture.md, "Reliability rules": a prefill node never
pins blocks forever). A decode node extends the lease of every pull in flight and of every
admitted request still queued for its pull (``WaitingTickets``), on every rank of a
tensor-parallel holder (each holds the lease), one message per holder address per tick
(``send_heartbeats``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable

from kvbridge.transport import PeerAddress, Transport

from .metadata import Ticket
from .release_notices import NOTIFY_TIMEOUT_S, DeferredNotices, PullerRank, send_notices

__all__ = ["TICKET_MAX_WAIT_S", "WaitingTickets", "heartbeat_loop", "send_heartbeats"]

logger = logging.getLogger(__name__)

TICKET_MAX_WAIT_S = 300.0
"""A ticket heart-beaten this long without its request's pull starting is dropped, so a request
lost between admission and the queue cannot pin a prefill node's blocks forever."""


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


async def send_heartbeats(transport: Transport, tickets: Iterable[Ticket]) -> None:
    """Extend the leases of ``tickets``, one message per holder address (connector loop);
    best effort: a dead holder is found by the pull's own deadline."""
    by_peer: dict[PeerAddress, list[Ticket]] = {}
    for ticket in tickets:
        by_peer.setdefault(PeerAddress(ticket.host, ticket.port), []).append(ticket)
    for peer, group in by_peer.items():
        request_ids = [t.remote_request_id for t in group]
        tokens = [t.token for t in group]  # each lease's capability (``lease``)
        try:
            await asyncio.wait_for(
                transport.send_heartbeat(peer, request_ids, tokens), NOTIFY_TIMEOUT_S
            )
        except Exception as exc:
            logger.debug("heartbeat to %s failed: %s", peer, exc)


async def heartbeat_loop(
    transport: Transport,
    *,
    interval_s: float,
    deferred: DeferredNotices,
    in_flight: Callable[[], list[Ticket]],
    waiting: WaitingTickets,
    puller_rank: PullerRank,
) -> None:
    """Every ``interval_s``: extend the leases of every pull ``in_flight`` and of every admitted
    request still ``waiting`` for its pull, one message per holder; and send the release
    notices that no step has sent since the last tick (an engine that stopped stepping:
    ``DeferredNotices``). Runs on the connector loop until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        notices = deferred.take_all()
        if notices:
            await send_notices(transport, notices, puller_rank)
        await send_heartbeats(transport, [*in_flight(), *waiting.snapshot()])
