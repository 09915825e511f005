"""Release notices: a puller telling a holder that it may free the blocks of a lease.

``send_notice`` delivers one on the connector loop, and tries it again a few times, in a task of
its own, when the holder did not get it (``NOTIFY_RETRY_AFTER_S``). ``DeferredNotices`` keeps
the notices of the handoffs a worker read one-sided (``Puller._pull_here``) until a step later,
so that the wake-up of the connector loop falls outside the step that computes the handed-off
request's first token.

A tensor-parallel puller's ranks each send their own notice to every rank of the holder
(``PullerRank``); the holder's lease ends once every puller rank has (``lease``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import NamedTuple

from kvbridge.transport import PeerAddress, Transport

from .metadata import ReleaseNotice

__all__ = [
    "NOTIFY_RETRY_AFTER_S",
    "NOTIFY_TIMEOUT_S",
    "DeferredNotices",
    "PullerRank",
    "send_last_notices",
    "send_notice",
    "send_notices",
]

logger = logging.getLogger(__name__)

NOTIFY_TIMEOUT_S = 5.0
"""How long one try of a release notice may take (seconds): the connection to the holder, its
handshake included, and the send."""
NOTIFY_RETRY_AFTER_S = (1.0, 4.0, 12.0)
"""After a try that failed, the notice is tried again after each of these pauses (seconds)
until one try delivers it: four tries over at most about 37 s, inside a lease that the
puller's heartbeats kept alive up to the pull's end (``lease_s``, 30 s by default, from
there). Why: a puller whose connector loop was starved for longer than a try (a
decode rank held ~19 s in a torchinductor kernel on a loaded host, seen in CI) lost every
notice of the pulls that ended meanwhile, and the holder kept those blocks until the leases ran
out. A second delivery is harmless: the holder counts each puller rank once and ignores an
ended lease (``LeaseTable.release``). Every failure is tried again, a refused handshake
included: the transport raises the same ``HandshakeError`` for a holder too busy to answer in
time as for one that refuses the cluster key, and a refusal costs three more handshakes."""

_retries: weakref.WeakKeyDictionary[Transport, set[asyncio.Task[None]]] = (
    weakref.WeakKeyDictionary()
)
"""The retry tasks of each transport (held here: the loop keeps only weak references)."""
_closed: weakref.WeakSet[Transport] = weakref.WeakSet()
"""Transports that sent their last notices (``send_last_notices``): no retry goes over them."""


class PullerRank(NamedTuple):
    """Which rank of the puller sends a notice (``rank`` of ``num_ranks``: its tensor-parallel
    rank and size; ``(0, 1)`` for a puller of one rank)."""

    rank: int
    num_ranks: int


SOLE_PULLER = PullerRank(0, 1)


async def send_notice(
    transport: Transport, notice: ReleaseNotice, puller: PullerRank = SOLE_PULLER
) -> None:
    """Deliver a release notice from ``puller``: one try now and, if it failed (timed out, did
    not reach the holder, a handshake not answered), more tries in a task of its own
    (``NOTIFY_RETRY_AFTER_S``), so a caller never waits longer than one try
    (``NOTIFY_TIMEOUT_S``). Best effort: a notice that no try delivered is logged, and the
    holder releases the blocks at lease expiry. Never raises. Runs on the connector loop."""
    only_try = not NOTIFY_RETRY_AFTER_S or transport in _closed
    if await _try_notice(transport, notice, puller, last_of=1 if only_try else 0) or only_try:
        return
    task = asyncio.get_running_loop().create_task(_retry_notice(transport, notice, puller))
    tasks = _retries.setdefault(transport, set())
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _try_notice(
    transport: Transport, notice: ReleaseNotice, puller: PullerRank, *, last_of: int
) -> bool:
    """One try: True if the holder got the notice. A failed try that is the last of
    ``last_of`` tries (not 0) is logged."""
    ticket = notice.ticket
    try:
        await asyncio.wait_for(
            transport.notify_transfer_done(
                PeerAddress(ticket.host, ticket.port),
                ticket.remote_request_id,
                success=notice.success,
                reason=notice.reason,
                token=ticket.token,
                puller_rank=puller.rank,
                num_pullers=puller.num_ranks,
            ),
            NOTIFY_TIMEOUT_S,
        )
        return True
    except Exception as exc:
        if last_of:
            logger.info("release notice for %s not delivered (tries: %d): %r",
                        ticket.remote_request_id, last_of, exc)
        return False


async def _retry_notice(transport: Transport, notice: ReleaseNotice, puller: PullerRank) -> None:
    """The tries after the first (``NOTIFY_RETRY_AFTER_S``); the last failure is logged."""
    num_tries = 1 + len(NOTIFY_RETRY_AFTER_S)
    for i, pause_s in enumerate(NOTIFY_RETRY_AFTER_S, start=2):
        await asyncio.sleep(pause_s)
        if await _try_notice(transport, notice, puller,
                             last_of=num_tries if i == num_tries else 0):
            return


async def send_last_notices(
    transport: Transport, notices: list[ReleaseNotice], puller: PullerRank = SOLE_PULLER
) -> None:
    """The last notices over ``transport``, which is about to close (a worker shutting down):
    one try each; every retry still pending over it stops, and no notice sent over it from
    now on (a pull ending as the transport closes) is tried again (the holders of notices no
    try delivered release at lease expiry)."""
    await send_notices(transport, notices, puller)
    _closed.add(transport)
    for task in list(_retries.pop(transport, ())):
        task.cancel()


async def send_notices(
    transport: Transport, notices: list[ReleaseNotice], puller: PullerRank = SOLE_PULLER
) -> None:
    """Deliver release notices at once (``send_notice`` each)."""
    await asyncio.gather(*(send_notice(transport, notice, puller) for notice in notices))


class DeferredNotices:
    """Release notices held back from the step that made them until the end of the next step.

    Why a step late. The step that reads a handoff one-sided also computes that request's first
    token. Waking the connector loop to send the notice at the end of that step delayed that
    token in vLLM (the loop takes the GIL while the step still samples and reports:
    ``benchmarks/bench_vllm_pd.py``; docs/architecture.md, "Design measurements"). One step
    later the same cost falls on a later token. An engine steps again
    after every step that computes a request (the request decodes on, or its finish is reported
    to the workers in the next ``SchedulerOutput.finished_req_ids``: vLLM's
    ``Scheduler.has_finished_requests``), except an offline engine whose caller stops stepping
    once no request is unfinished; for that case the connector loop's heartbeat tick sends
    whatever is still held (``take_all``), so a holder waits at most one heartbeat interval.
    A holder keeps the blocks that much longer: memory on the holder, never correctness.

    Thread-safety: the worker thread calls ``add`` and ``end_step``; ``take_all`` may be called
    from any thread (the loop's heartbeat, a worker shutting down). One lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._this_step: list[ReleaseNotice] = []
        self._last_step: list[ReleaseNotice] = []

    def add(self, notice: ReleaseNotice) -> None:
        """Hold ``notice`` (made in the current step)."""
        with self._lock:
            self._this_step.append(notice)

    def end_step(self) -> list[ReleaseNotice]:
        """At the end of a step: the notices made in the step before it, now due; this step's
        are held until the next call."""
        with self._lock:
            due, self._last_step, self._this_step = self._last_step, self._this_step, []
        return due

    def take_all(self) -> list[ReleaseNotice]:
        """Every notice still held, oldest first (the loop's heartbeat tick, a shutdown)."""
        with self._lock:
            notices = self._last_step + self._this_step
            self._last_step, self._this_step = [], []
        return notices
