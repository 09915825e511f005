"""The work items an ``IndexClient`` hands its ``IndexWorker``: publish batches and lookups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .lookup import LookupResult

__all__ = ["Batch", "LookupJob", "count_ops"]


def count_ops(events: list[Any]) -> int:
    """The index ops ``events`` make: one per block hash of a ``BlockStored`` or
    ``BlockRemoved``, one for anything else (``AllBlocksCleared``)."""
    return sum(len(getattr(event, "block_hashes", None) or ()) or 1 for event in events)


class Batch(NamedTuple):
    events: list[Any]
    num_ops: int
    seq: int  # this incarnation's batch number (1, 2, ...)
    resync: bool = False  # the node's whole cached set


@dataclass(slots=True, eq=False)
class LookupJob:
    """One lookup handed to the worker. Every field but ``result`` is fixed at creation;
    ``result`` is written once (by the caller before the job is queued, or by the worker thread
    under the worker's lock) and read by the caller thread (one reference read)."""

    key: str
    block_hashes: tuple[bytes, ...]
    num_local_blocks: int
    min_gain_blocks: int
    deadline_s: float
    result: LookupResult | None = None
