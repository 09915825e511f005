"""A handoff ticket against its request, in the scheduler halves: P issues the ticket for the
request it finished (``issue_ticket``), and D checks it against the request it came with, before
anything is allocated or read (``ticket_refusal``).

D refuses a ticket it can tell does not fit its request:

- another prompt's: its ``remote_prompt_digest`` is not the request's own
  (``prompt_digest``). That is a load failure under the node's policy, found
  without a load: "recompute" computes the request at once, "fail" fails its load without
  reading anything. It is what protects the partial last block, which has no hash for P's check:
  without it, a prompt sharing every full block with the ticket's would load the other prompt's
  tail there;
- one whose sliding-window group no longer holds a block D's window needs
  (``pull_plan.window_gap_groups``): D computes the request itself, whatever the policy.

Owner: the scheduler half's thread (pure functions; nothing here keeps state).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .metadata import LeaseGrant, WorkerHandshake
from .prompt_digest import prompt_digest
from .pull_plan import cdiv, window_gap_groups
from .transfer_params import RemotePrefillParams

__all__ = ["TicketRefusal", "issue_ticket", "ticket_refusal"]


class TicketRefusal(NamedTuple):
    """Why D will not pull a ticket for its request.

    Attributes:
        reason: for the log, P's release notice and the failed load's error.
        window_gap: P dropped a block D's window needs (counted in ``num_window_gaps``, the
            request computed locally under any policy); False: another prompt's ticket (a
            failed load under the policy).
        num_blocks: the blocks the pull would have filled (a failed load counts them).
    """

    reason: str
    window_gap: bool
    num_blocks: int


def issue_ticket(
    request: Any,
    block_ids: Sequence[Sequence[int]],
    *,
    engine_id: str,
    worker: WorkerHandshake,
    block_size: int,
    lease_s: float,
    tp_fields: Mapping[str, Any] | None = None,
) -> tuple[LeaseGrant, RemotePrefillParams]:
    """P's lease on a finished request's prompt blocks and the ticket D pulls them with.

    Args:
        request: kvbridge's ``Request`` or vLLM's (``RequestView``): reads ``request_id``,
            ``num_prompt_tokens``, ``block_hashes`` and what ``prompt_digest`` reads.
        block_ids: the request's blocks per KV cache group, position order (0: the null block).
        engine_id, worker: this node and its worker half's transport (the ticket's address).
        block_size: tokens per block.
        lease_s: the lease's length without a heartbeat.
        tp_fields: a tensor-parallel P's ticket fields (``engine_ranks.EngineRanks.ticket_fields``:
            its ranks' addresses and KV heads); None or empty for a P of one rank.

    Returns:
        The grant for the worker half (with a fresh 128-bit token, the ticket's capability) and
        the ticket (``RemotePrefillParams``: its ``to_dict()`` is the ``kv_transfer_params``).
    """
    num_tokens = request.num_prompt_tokens
    held = tuple(tuple(ids[: cdiv(num_tokens, block_size)]) for ids in block_ids)
    grant = LeaseGrant(
        request_id=request.request_id,
        block_ids=[list(ids) for ids in held],
        block_hashes=list(request.block_hashes[: num_tokens // block_size]),
        lease_s=lease_s,
        token=secrets.token_urlsafe(16),
    )
    ticket = RemotePrefillParams(
        remote_engine_id=engine_id,
        remote_incarnation=worker.incarnation,
        remote_request_id=request.request_id,
        remote_host=worker.host,
        remote_port=worker.port,
        remote_block_ids=held,
        remote_num_tokens=num_tokens,
        remote_block_size=block_size,
        lease_expires_at=time.time() + lease_s,
        remote_lease_token=grant.token,
        remote_prompt_digest=prompt_digest(request, num_tokens, block_size),
        **(tp_fields or {}),
    )
    return grant, ticket


def ticket_refusal(
    ticket: RemotePrefillParams,
    request: Any,
    *,
    num_computed_tokens: int,
    num_remote: int,
    block_size: int,
    sliding_windows: Sequence[int | None],
) -> TicketRefusal | None:
    """Why D must not pull ``ticket`` for ``request``, or None (it may pull).

    Args:
        ticket: the request's parsed ticket.
        request: as ``prompt_digest`` reads it, with ``num_prompt_tokens``.
        num_computed_tokens: D's local prefix hit, in tokens.
        num_remote: the tokens the pull would end at (the ticket's, at most the prompt's but
            one), more than ``num_computed_tokens``.
        block_size: tokens per block.
        sliding_windows: per KV cache group, its window in tokens (None: full attention).
    """
    num_blocks = cdiv(num_remote, block_size) - num_computed_tokens // block_size
    theirs = ticket.remote_prompt_digest
    if theirs and ticket.remote_num_tokens <= request.num_prompt_tokens:
        ours = prompt_digest(request, ticket.remote_num_tokens, block_size)
        if ours and ours != theirs:
            return TicketRefusal(
                "the ticket is for another prompt: its remote_prompt_digest is not this "
                f"request's over its first {ticket.remote_num_tokens} tokens",
                window_gap=False,
                num_blocks=num_blocks,
            )
    gaps = window_gap_groups(
        remote_block_ids=ticket.remote_block_ids,
        sliding_windows=sliding_windows,
        num_computed_tokens=num_remote,
        num_remote_tokens=ticket.remote_num_tokens,
        start_block=num_computed_tokens // block_size,
        block_size=block_size,
    )
    if gaps:
        reason = f"P no longer holds the start of the last token's window (groups {gaps})"
        return TicketRefusal(reason, window_gap=True, num_blocks=num_blocks)
    return None
