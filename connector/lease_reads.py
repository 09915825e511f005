"""A puller's read of one holder rank under a handoff's lease, retried while the holder has
not been handed the lease yet (``ReadResult.lease_pending``).

Owner: the connector's event-loop thread (``loop_thread``), inside ``puller.Puller``'s pull task.
"""

from __future__ import annotations

import asyncio
import time

from kvbridge.transport import GroupRead, PeerAddress, Transport

from .metadata import PullPlan
from .pull_plan import only_local_blocks

__all__ = ["LEASE_GRANT_RETRY_S", "read_under_lease"]

LEASE_GRANT_RETRY_S = (0.01, 0.02, 0.05, 0.1, 0.2)
"""Waits before reading refused blocks again under a lease the holder has not been granted
yet (``ReadResult.lease_pending``: its next step hands the grant over; vLLM's engine steps
every millisecond while it holds blocks). Any other refusal ends the pull at once."""


async def read_under_lease(
    transport: Transport,
    peer: PeerAddress,
    plan: PullPlan,
    reads: list[GroupRead],
    deadline_at: float,
    heads: tuple[int, int] | None = None,
) -> tuple[set[int], int]:
    """Read ``reads`` (the KV ``heads`` of their blocks, ``Transport.read_blocks``) under
    the plan's lease (``Read.lease``, None for an index pull); returns the local blocks
    refused and the bytes landed.

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
            heads=heads,
        )
        num_bytes += result.num_bytes_landed
        refused = set(result.failed_local_block_ids)
        if not refused or not result.lease_pending:
            break
        wait_s = next(waits, None)
        if wait_s is None or time.monotonic() + wait_s >= deadline_at:
            break
        await asyncio.sleep(wait_s)
        reads = only_local_blocks(reads, refused)
    return refused, num_bytes

