"""Tensor-parallel KV heads: which heads a rank holds, and where a rank reads the heads it owns.

vLLM shards attention's KV heads over the ranks of a tensor-parallel engine
(``vllm/config/model.py``, ``get_num_kv_heads``: ``max(1, total // tp_size)`` heads per rank;
it requires ``total % tp_size == 0`` or ``tp_size % total == 0``). Rank ``r`` of ``tp`` ranks
holds, of ``H`` heads::

    tp <= H:  heads [r * H / tp, (r + 1) * H / tp)        e.g. H=4, tp=2: [0, 2) [2, 4)
    tp >  H:  head  r * H // tp  (each head on tp / H ranks) e.g. H=2, tp=4: 0 0 1 1

A decode rank reads exactly the heads it holds, from prefill ranks that hold them
(``head_sources``); a head several prefill ranks hold (``tp > H`` on P) is read from one of
them, spread over the decode ranks that need it::

    P tp=1 -> D tp=2 (H=2):   D0 <- P0 heads [0, 1)          D1 <- P0 heads [1, 2)
    P tp=2 -> D tp=1 (H=2):   D0 <- P0 heads [0, 1), P1 heads [1, 2)
    P tp=4 -> D tp=1 (H=2):   D0 <- P0 head 0, P2 head 1     (P1, P3 hold copies)

Plain arithmetic, no I/O: the scheduler half checks a pairing with it when a ticket arrives
(``pairing_error``), each worker rank plans its reads with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "MAX_TP_SIZE",
    "HeadRange",
    "HeadSource",
    "TPLayout",
    "head_sources",
    "index_layout",
    "pairing_error",
    "rank_heads",
    "tp_size_error",
]

MAX_TP_SIZE = 1024
"""Tensor-parallel sizes a ticket may name (network input)."""


class HeadRange(NamedTuple):
    """KV heads ``[start, stop)`` of the model."""

    start: int
    stop: int


class HeadSource(NamedTuple):
    """A run of heads one rank reads from one remote rank."""

    remote_rank: int
    heads: HeadRange


def tp_size_error(tp_size: int, total_num_kv_heads: int) -> str | None:
    """Why ``tp_size`` ranks cannot share ``total_num_kv_heads`` heads as vLLM does (neither
    divides the other), or None."""
    if tp_size < 1 or total_num_kv_heads < 1:
        return f"tp_size {tp_size} and {total_num_kv_heads} KV heads must be >= 1"
    if total_num_kv_heads % tp_size and tp_size % total_num_kv_heads:
        return (
            f"tp_size {tp_size} with {total_num_kv_heads} KV heads: neither divides the other"
        )
    return None


def rank_heads(tp_rank: int, tp_size: int, total_num_kv_heads: int) -> HeadRange:
    """The heads rank ``tp_rank`` of ``tp_size`` holds (module docstring).

    Raises:
        ValueError: a rank outside ``[0, tp_size)``, or sizes vLLM would not run
            (``tp_size_error``).
    """
    error = tp_size_error(tp_size, total_num_kv_heads)
    if error is not None:
        raise ValueError(error)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
    if tp_size <= total_num_kv_heads:
        per_rank = total_num_kv_heads // tp_size
        return HeadRange(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * total_num_kv_heads // tp_size
    return HeadRange(head, head + 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class TPLayout:
    """One rank of a (possibly tensor-parallel) engine: ``tp_rank`` of ``tp_size``, of a model
    with ``total_num_kv_heads`` KV heads. ``heads_sliceable``: a run of the rank's heads is one
    byte range of each of its blocks (``transport.metadata.KVHeads.sliceable``).

    Raises:
        ValueError: as ``rank_heads``.
    """

    tp_rank: int
    tp_size: int
    total_num_kv_heads: int
    heads_sliceable: bool = True

    def __post_init__(self) -> None:
        rank_heads(self.tp_rank, self.tp_size, self.total_num_kv_heads)

    @property
    def heads(self) -> HeadRange:
        """The heads this rank holds."""
        return rank_heads(self.tp_rank, self.tp_size, self.total_num_kv_heads)


def index_layout(layout: TPLayout | None) -> str:
    """``IndexNamespace.kv_heads_layout`` of the blocks of an engine whose ranks are laid out
    as ``layout``: ``"tp2h8"`` for 2 ranks of 8 KV heads, ``""`` for one rank or None (every
    head in one block)."""
    if layout is None or layout.tp_size == 1:
        return ""
    return f"tp{layout.tp_size}h{layout.total_num_kv_heads}"


def head_sources(local: TPLayout, remote_tp_size: int) -> list[HeadSource]:
    """Where rank ``local`` reads the heads it holds from an engine of ``remote_tp_size`` ranks
    of the same model: runs of heads in order, each from one remote rank (module docstring).
    A head held by several remote ranks is read from the ``local.tp_rank % copies``-th of them.

    Raises:
        ValueError: a remote size vLLM would not run with this model (``tp_size_error``).
    """
    total = local.total_num_kv_heads
    error = tp_size_error(remote_tp_size, total)
    if error is not None:
        raise ValueError(error)
    sources: list[HeadSource] = []
    for head in range(*local.heads):
        if remote_tp_size <= total:
            rank = head // (total // remote_tp_size)
        else:  # ranks [head * c, (head + 1) * c) hold copies of this head, c = tp / H
            copies = remote_tp_size // total
            rank = head * copies + local.tp_rank % copies
        if sources and sources[-1].remote_rank == rank:
            sources[-1] = HeadSource(rank, HeadRange(sources[-1].heads.start, head + 1))
        else:
            sources.append(HeadSource(rank, HeadRange(head, head + 1)))
    return sources


def pairing_error(local: TPLayout, remote_tp_size: int) -> str | None:
    """Why this engine (``local``'s size and layout) cannot load handoffs from an engine of
    ``remote_tp_size`` ranks, or None. Names both sizes and the head count:

    - a size vLLM would not run with this model;
    - a local layout whose head runs are not byte ranges (``heads_sliceable`` False), where a
      rank would have to write part of its blocks (it reads from several remote ranks).

    The remote side's own layout is checked when its rank answers the handshake
    (``transport.heads``)."""
    total = local.total_num_kv_heads
    error = tp_size_error(remote_tp_size, total)
    if error is not None:
        return f"prefill tp_size {remote_tp_size}, decode tp_size {local.tp_size}: {error}"
    partial = any(source.heads != local.heads for source in head_sources(local, remote_tp_size))
    if partial and not local.heads_sliceable:
        return (
            f"prefill tp_size {remote_tp_size}, decode tp_size {local.tp_size}, {total} KV "
            "heads: a decode rank would write part of its blocks, which its KV cache layout "
            "does not keep in one byte range"
        )
    return None
