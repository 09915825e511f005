"""The block index's counters (``IndexStats``), shared by its backends and ``IndexClient``.

docs/architecture.md, "The block index": Redis trouble is counted, never raised; a lookup that
meets malformed entries goes on without them, counted and said in a log line at most once per
``GARBAGE_LOG_INTERVAL_S``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["GARBAGE_LOG_INTERVAL_S", "IndexStats"]

logger = logging.getLogger(__name__)

GARBAGE_LOG_INTERVAL_S = 60.0  # malformed entries met by lookups: one log line this often


@dataclass(slots=True)
class IndexStats:
    """Counters. Redis trouble is counted, never raised.

    Each counter has one writer: the backend's counters are bumped by whichever thread calls
    the backend (``IndexClient``'s worker thread); the ``IndexClient`` counters at the end are
    bumped by the client's caller (the engine thread). Readers read ints, never write. (The
    in-process backend is shared by a process's nodes: one ``IndexStats`` for all of them.)
    """

    lookups: int = 0
    lookup_hits: int = 0
    lookups_failed: int = 0  # backend unreachable, slow or erroring: answered NO_HIT
    publishes: int = 0
    publish_ops: int = 0
    publishes_fenced: int = 0
    publishes_gap: int = 0  # refused: a batch before them was lost (the node resyncs)
    publishes_replayed: int = 0  # ignored: applied already (a retry that landed twice)
    resyncs: int = 0  # whole-set re-publishes applied
    publishes_dropped: int = 0  # calls unanswered (backend trouble; each try of a call made again)
    publish_ops_dropped: int = 0
    heartbeats_failed: int = 0
    garbage_entries: int = 0  # malformed entries/node records skipped by lookups
    reconnects: int = 0
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    # IndexClient (its caller's thread): lookups answered "timed_out" (no answer within its
    # lookup_timeout_s), lookups refused "overloaded" (too many in flight), publish batches and
    # their ops dropped because the publish queue was full.
    lookups_timed_out: int = 0
    lookups_refused: int = 0
    publish_batches_dropped_full: int = 0
    publish_ops_dropped_full: int = 0
    _garbage_said_until: float = field(default=float("-inf"), repr=False)

    def count_garbage(self, count: int, now_s: float) -> None:
        """Add ``count`` malformed entries a lookup skipped (backend's thread), saying so at
        most once per ``GARBAGE_LOG_INTERVAL_S`` (every lookup that passes a corrupt key
        meets it again); ``now_s``: the backend's clock."""
        if count <= 0:
            return
        self.garbage_entries += count
        if now_s >= self._garbage_said_until:
            self._garbage_said_until = now_s + GARBAGE_LOG_INTERVAL_S
            logger.warning("block index: a lookup skipped %d malformed entr%s (%d so far; not "
                           "written by this version of kvbridge?) and went on without them",
                           count, "y" if count == 1 else "ies", self.garbage_entries)
