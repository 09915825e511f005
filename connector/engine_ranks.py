"""The ranks of tensor-parallel engines as the scheduler half deals with them: its own (from its
workers' handshakes) and a ticket's prefill engine's (the holders and leases of a pull).

vLLM runs one worker half per tensor-parallel rank and hands the scheduler half every rank's
handshake (``set_xfer_handshake_metadata``, by tp rank). The scheduler half names every rank in
the tickets it gives out (``EngineRanks.ticket_fields``), and a decode node's pull names every
rank of the ticket's prefill engine (``rank_holders``); each of its own ranks then reads the KV
heads it holds from the ranks holding them (``pull_plan.pull_sources``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .metadata import HolderRef, Ticket, WorkerHandshake
from .pull_plan import RemoteMatch
from .tp_layout import TPLayout, index_layout
from .transfer_params import PrefillRank, RemotePrefillParams

__all__ = ["EngineRanks", "match_leases", "rank_holders"]


@dataclass(frozen=True, slots=True)
class EngineRanks:
    """This engine's worker ranks, by tp rank, and its layout of KV heads (None: workers that
    do not name their heads, kvbridge's own engine)."""

    workers: tuple[WorkerHandshake, ...]
    tp_layout: TPLayout | None

    @classmethod
    def of(cls, handshakes: WorkerHandshake | Mapping[int, WorkerHandshake]) -> EngineRanks:
        """The engine one handshake, or every rank's (``tp_rank -> handshake``), describes.

        Raises:
            ValueError: ranks that do not make one engine: one missing, a rank that names
                another place, or ranks that disagree on the size or the model's KV heads.
        """
        if isinstance(handshakes, WorkerHandshake):
            handshakes = {0: handshakes}
        workers = tuple(handshakes.get(rank) for rank in range(len(handshakes)))
        places = [(w.tp_rank, w.tp_size, w.total_num_kv_heads) for w in handshakes.values()]
        first = workers[0] if workers else None
        if first is None or any(
            w is None or (w.tp_rank, w.tp_size, w.total_num_kv_heads)
            != (rank, len(workers), first.total_num_kv_heads)
            for rank, w in enumerate(workers)
        ):
            raise ValueError(
                f"worker handshakes of ranks {sorted(handshakes)} do not make one engine "
                f"(tp_rank, tp_size, KV heads): {places}"
            )
        layout = None
        if first.total_num_kv_heads:
            layout = TPLayout(
                tp_rank=0, tp_size=first.tp_size, total_num_kv_heads=first.total_num_kv_heads,
                heads_sliceable=all(w.heads_sliceable for w in workers),  # type: ignore[union-attr]
            )
        return cls(workers, layout)  # type: ignore[arg-type]

    @property
    def tp_size(self) -> int:
        return len(self.workers)

    def ticket_fields(self) -> dict[str, Any]:
        """``RemotePrefillParams``' tensor-parallel fields for a ticket of this engine (none
        for an engine of one rank: its tickets stay as they were)."""
        if self.tp_size == 1:
            return {}
        return {
            "remote_tp_size": self.tp_size,
            "remote_ranks": tuple(PrefillRank(w.host, w.port, w.incarnation) for w in self.workers),
            "remote_num_kv_heads": self.workers[0].total_num_kv_heads,
        }

    def index_layout(self) -> str:
        """``IndexNamespace.kv_heads_layout`` of this engine's blocks (``tp_layout.index_layout``:
        ``"tp2h8"`` for 2 ranks of 8 KV heads, ``""`` for one rank)."""
        return index_layout(self.tp_layout)


def rank_holders(ticket: RemotePrefillParams) -> tuple[HolderRef, ...]:
    """Every rank of a ticket's P as a pull's holders (rank order)."""
    return tuple(
        HolderRef(engine_id=ticket.remote_engine_id, incarnation=r.incarnation, host=r.host,
                  port=r.port)
        for r in ticket.ranks()
    )


def match_leases(match: RemoteMatch) -> list[Ticket]:
    """A handoff match's lease at every rank of its P (empty for an index match)."""
    ticket = match.ticket
    if ticket is None:
        return []
    holders = match.remote_ranks or (match.holder,)
    return [Ticket(h.host, h.port, ticket.remote_request_id, ticket.token) for h in holders]
