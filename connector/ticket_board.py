"""D's scheduler half looks at P's block board before it plans a handoff (issue 28, item 4).

A ticket D cannot refuse by itself (no ``remote_prompt_digest``: a P that sends none; a stale
ticket whose blocks P evicted and reused) used to be found out only by P's answer to the pull.
Under ``load_mode`` ``"auto"`` that pull was planned inside the step that computes the request,
so vLLM had already scheduled the request's last prompt token over blocks that never loaded: the
request was computed again one step later than a plain request would start.

Where the worker half reads P one-sided (a same-host holder with a block board, reported in
``KVBridgeWorkerMeta.one_sided_holders``), the scheduler half reads the same board entries
first (``kvbridge.transport.look_at_board``: one ``process_vm_readv``, no message to P) with the
tags the worker's read would expect (the request's own block hashes; the ticket's lease for a
position without one), and the scheduler half (``get_num_new_matched_tokens``) acts on it:

- ``OTHER_BLOCKS`` (P holds other content there under a live lease, so P would refuse the read):
  the ticket is refused before anything is allocated or read, as one of another prompt's digest
  is (``handoff.ticket_refusal``): under "recompute" the request is computed in its first step,
  under "fail" its load fails without reading anything;
- anything else: the pull is planned as before the look (``load_mode.LoadModePolicy``). Empty
  entries (a lease P's worker has not been handed yet, or one that ended) only P can answer
  for, and a correct ticket often arrives before P's next step hands its lease over, so they
  are not refused, nor moved off the step (that would cost correct tickets a step).

Owner: the scheduler half's thread (pure functions; nothing here keeps state).
"""

from __future__ import annotations

from typing import Any

from kvbridge.transport import BoardLook, BoardRef, full_block_tag, lease_block_tag, look_at_board

from .handoff import TicketRefusal
from .pull_plan import cdiv
from .transfer_params import RemotePrefillParams

__all__ = ["BOARD_REFUSAL", "ticket_on_board"]

BOARD_REFUSAL = (
    "P's block board shows other blocks at the ticket's positions: the ticket is for another "
    "prompt, or stale (P reused its blocks)"
)
"""The reason of a ticket refused by its holder's board (log, release notice, failed load)."""


def ticket_on_board(
    board: BoardRef,
    ticket: RemotePrefillParams,
    request: Any,
    *,
    num_computed_tokens: int,
    num_remote: int,
    block_size: int,
) -> TicketRefusal | None:
    """Why P's ``board`` shows that P would refuse the blocks ``ticket`` would load for
    ``request``, or None (it vouches for them, or cannot tell).

    Args:
        board: the ticket's holder's board (rank 0's, which the pull's first read goes to).
        ticket: the request's parsed ticket; its ``remote_block_ids`` name P's blocks by
            position, 0 for the null block (not on a board: skipped).
        request: reads ``block_hashes`` (vLLM's, of D's own prompt).
        num_computed_tokens: D's local prefix hit, in tokens (its blocks are not loaded).
        num_remote: the tokens the pull would end at, more than ``num_computed_tokens``.
        block_size: tokens per block.

    Returns:
        For ``BoardLook.OTHER_BLOCKS`` the refusal (``BOARD_REFUSAL``, counting the blocks the
        pull would have filled); None otherwise, also where the ticket names no block on the
        board (the worker half's own checks report such a ticket).
    """
    start_block = num_computed_tokens // block_size
    end_block = cdiv(num_remote, block_size)
    if len(ticket.remote_block_ids) > len(board.board_blocks):
        return None
    hashes = request.block_hashes
    partial = lease_block_tag(ticket.remote_request_id, ticket.remote_lease_token)
    blocks = []
    for group_id, remote_ids in enumerate(ticket.remote_block_ids):
        positions = [p for p in range(start_block, min(end_block, len(remote_ids)))
                     if 0 < remote_ids[p] < board.board_blocks[group_id]]
        if positions:
            blocks.append((group_id, [remote_ids[p] for p in positions],
                           [full_block_tag(hashes[p]) if p < len(hashes) else partial
                            for p in positions]))
    if not blocks or look_at_board(board, blocks) is not BoardLook.OTHER_BLOCKS:
        return None
    return TicketRefusal(BOARD_REFUSAL, window_gap=False, num_blocks=end_block - start_block)
