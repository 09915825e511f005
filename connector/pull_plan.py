"""What the decode side pulls for one request: local and remote blocks paired by position.

A request on D holds, per KV cache group, a block table whose first ``start_block`` positions
came from its own prefix cache; the positions after that, up to the end of the external tokens,
are the pull's targets. Position ``i`` of D's table receives position ``i`` of P's table — pairing
is by position, never by counting from the end (docs/architecture.md, "Pairing by position"), so
a partial local hit simply trims the remote list from the front::

    position:   0 ... start_block-1 | start_block ... end_block-1 | end_block ...
    D (local):  prefix-cache hits    | pull targets                | new tokens
    P (remote): (not pulled)         | pull sources                |

A position whose local block is the null block (outside a sliding window on D) is skipped; a
position where D needs a block but P holds only its null block cannot be loaded and is reported
as a load error up front, so the engine's load-failure policy decides ("fail": the request
errors; "recompute": D computes from the first such block on). Only a sliding-window group may
legitimately hold a null block where D needs one (P dropped a block that left *its* window one
token earlier): ``window_gap_groups`` finds those before anything is allocated, so that D can
compute the request itself instead. A full-attention group keeps every block of a request, so a
ticket naming P's null block there is wrong, never a gap.

A rank of a tensor-parallel D reads the KV heads it holds of those blocks from the rank(s) of P
holding them (``pull_sources``; the arithmetic is ``tp_layout``'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvbridge.transport import GroupRead, NodeMetadata
from kvbridge.transport.heads import heads_error

from .errors import KVConnectorError
from .metadata import HolderRef, PullPlan, Ticket
from .tp_layout import TPLayout, head_sources

__all__ = [
    "NO_HASH",
    "PullSource",
    "RemoteMatch",
    "cdiv",
    "only_local_blocks",
    "plan_group_pulls",
    "pull_sources",
    "sliding_windows_of",
    "source_error",
    "window_gap_groups",
]

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class RemoteMatch:
    """What the scheduler half's ``get_num_new_matched_tokens`` found for a request, until its
    allocation pairs the blocks (``plan_group_pulls``)."""

    holder: HolderRef
    remote_block_ids: tuple[tuple[int, ...], ...]
    ticket: Ticket | None  # a handoff's lease; None for a prefix found through the index
    num_local_tokens: int
    num_remote_tokens: int
    load_async: bool = True  # what get_num_new_matched_tokens told the scheduler
    remote_ranks: tuple[HolderRef, ...] = ()  # a tensor-parallel holder's ranks (PullPlan's)
    refused: str = ""  # why D refused the ticket itself: the load fails without a read


NO_HASH = b""
"""Expected value of a position without a hash (the partial last block). A pull under a
handoff's lease presents that lease in its own field (``PullPlan.lease`` -> ``Read.lease``), and
the holder serves such a position only while that lease is held, has the ticket's token and
covers the block, so a late puller never reads a block the holder has reused and a peer without
the ticket never reads it at all. A pull without a lease (through the block index) never
reaches such a position: the index lists full blocks only."""


class PullSource(NamedTuple):
    """One read of a pull: the holder's rank and the model's KV heads ``(start, stop)`` it
    moves of each block (None: the heads the reading node holds, or whole blocks of a node
    that names none: ``Transport.read_blocks``)."""

    holder: HolderRef
    heads: tuple[int, int] | None


def pull_sources(plan: PullPlan, layout: TPLayout | None) -> list[PullSource]:
    """Where a rank of layout ``layout`` reads ``plan`` from: a handoff of a tensor-parallel
    D or P, one read per P rank holding some of the rank's heads (``tp_layout.head_sources``);
    otherwise one read of ``plan.holder`` (a pull found through the index reads the same heads
    of its one holder, whose check refuses heads it does not hold).

    Raises:
        KVConnectorError: a holder of several ranks and a reader that names no heads (the
            scheduler half plans no such pull: ``transfer_params`` refuses the ticket).
    """
    holders = plan.holders()
    if layout is None or plan.lease is None:
        if len(holders) > 1:
            raise KVConnectorError(f"a holder of {len(holders)} ranks, a reader naming no heads")
        return [PullSource(plan.holder, None)]
    return [
        PullSource(holders[source.remote_rank], (source.heads.start, source.heads.stop))
        for source in head_sources(layout, len(holders))
    ]


def source_error(plan: PullPlan, layout: TPLayout | None, holder: NodeMetadata,
                 heads: tuple[int, int] | None) -> str | None:
    """Why the holder rank ``holder`` (its handshake's metadata) cannot serve the ``heads``
    of a read of ``plan`` (a part of its blocks its layout does not keep in one byte range,
    heads it does not hold), naming both tensor-parallel sizes and the head count; None when
    it can (or the read names no heads)."""
    error = None if heads is None else heads_error(holder, heads)
    if error is None:
        return None
    local = "?" if layout is None else layout.tp_size
    return (f"prefill tp_size {len(plan.holders())}, decode tp_size {local}, "
            f"{holder.total_kv_heads} KV heads: {error}")


def only_local_blocks(reads: list[GroupRead], local_block_ids: set[int]) -> list[GroupRead]:
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


def plan_group_pulls(
    *,
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    start_block: int,
    end_block: int,
    block_hashes: Sequence[bytes],
) -> tuple[list[GroupRead], list[int]]:
    """Pair local and remote blocks of positions ``[start_block, end_block)`` in every group.

    Args:
        local_block_ids: D's block ids per group (the request's whole table).
        remote_block_ids: P's block ids per group (``kv_transfer_params``).
        start_block: first position to pull (D's local prefix hit, in blocks).
        end_block: one past the last position (``cdiv(local hit + external tokens, block_size)``).
        block_hashes: the request's full-block hashes (D computed them from the same tokens);
            position ``i`` expects ``block_hashes[i]`` on P; past the last full block it expects
            ``NO_HASH`` (the pull's lease guards it there).

    Returns:
        ``(groups, unloadable_local_block_ids)``.

    Raises:
        ValueError: a table is shorter than ``end_block`` (a caller mistake).
    """
    groups: list[GroupRead] = []
    unloadable: list[int] = []
    for group_id, (local, remote) in enumerate(zip(local_block_ids, remote_block_ids, strict=True)):
        if len(local) < end_block or len(remote) < end_block:
            raise ValueError(
                f"group {group_id}: tables of {len(local)} local / {len(remote)} remote blocks, "
                f"pull needs positions [{start_block}, {end_block})"
            )
        pulled_remote: list[int] = []
        pulled_local: list[int] = []
        expected: list[bytes] = []
        for pos in range(start_block, end_block):
            local_id, remote_id = local[pos], remote[pos]
            if local_id == NULL_BLOCK_ID:
                continue  # D does not need this position (outside its window)
            if remote_id == NULL_BLOCK_ID:
                unloadable.append(local_id)
                continue
            pulled_local.append(local_id)
            pulled_remote.append(remote_id)
            expected.append(block_hashes[pos] if pos < len(block_hashes) else NO_HASH)
        groups.append(
            GroupRead(
                group_id=group_id,
                remote_block_ids=pulled_remote,
                local_block_ids=pulled_local,
                expected_hashes=expected,
            )
        )
    return groups, unloadable


def sliding_windows_of(kv_cache_config: Any, num_groups: int) -> list[int | None]:
    """Each group's sliding window in tokens (None: full attention); with no config, every
    one of ``num_groups`` is taken as full attention."""
    if kv_cache_config is None:
        return [None] * num_groups
    return [getattr(g.kv_cache_spec, "sliding_window", None)
            for g in kv_cache_config.kv_cache_groups]


def window_gap_groups(
    *,
    remote_block_ids: Sequence[Sequence[int]],
    sliding_windows: Sequence[int | None],
    num_computed_tokens: int,
    num_remote_tokens: int,
    start_block: int,
    block_size: int,
) -> list[int]:
    """Sliding-window groups in which D would need a block that P legitimately dropped.

    Once ``num_computed_tokens`` (local hit + pulled tokens) are computed, D keeps in a group
    with window ``w`` every block from the one holding position
    ``max(num_computed_tokens - w + 1, 0)`` on (the next token's window; the blocks before
    it are D's null block: ``get_num_skipped_tokens`` of vLLM and ``kvmanager``). P, having
    computed ``num_remote_tokens``, may have dropped only the blocks wholly before its own next
    token's window, ``max(num_remote_tokens - w + 1, 0)``. The pull fills positions
    ``[start_block, cdiv(num_computed_tokens, block_size))``::

        position:   0 ...     d_first ... p_first ...       end_block
        D:          null      | kept (pulled from P)        |
        P:          null ...  X         | always real       |
                              X = a null D needs: a gap     a null here: a wrong ticket

    vLLM's prefill node drops out-of-window blocks for *its* next token (one past D's), so
    when that window starts exactly on a block boundary P no longer holds the block D's
    window starts in (e.g. window 64, block 32, a 319-token prompt: P drops block 7,
    positions 224-255, and D computing token 318 reads position 255).

    A null block where P must hold a real one — anywhere D needs in a full-attention group
    (window None: P keeps every block there), or at or after ``p_first`` in a sliding-window
    group — is a wrong ticket, not a gap: then no group is reported, and ``plan_group_pulls``
    turns those positions into load errors, so the engine's load-failure policy applies
    (vLLM's ``kv_load_failure_policy``).

    Returns:
        The ids of the groups with a gap, in order (empty: the ticket covers D, or it is wrong).
    """
    end_block = -(-num_computed_tokens // block_size)
    gaps = []
    for group_id, (remote, window) in enumerate(
        zip(remote_block_ids, sliding_windows, strict=True)
    ):
        d_first = 0 if window is None else max(num_computed_tokens - window + 1, 0) // block_size
        p_first = 0 if window is None else max(num_remote_tokens - window + 1, 0) // block_size
        first = max(start_block, d_first)
        nulls = [pos for pos in range(first, end_block) if remote[pos] == NULL_BLOCK_ID]
        if any(pos >= p_first for pos in nulls):
            return []  # a wrong ticket: a load error for the request, not D's own recompute
        if nulls:
            gaps.append(group_id)
    return gaps
