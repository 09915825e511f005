"""A node's statistics from the reports of its worker ranks, each request counted once.

A tensor-parallel engine runs one worker half per rank, and every rank takes part in every
request: each pulls its own KV heads of each handed-off request, each holds its heads of each
lease (docs/architecture.md, "Inside vLLM"). The scheduler half sums what the ranks report so
that the node's counters say what happened to requests, not how many ranks saw it::

    counter                      node total                      by_rank[r]
    bytes_* (bytes moved)        sum over ranks                  rank r's
    a request's pull             once, when every rank reported  rank r's num_loads, ...
      (num_loads / num_failed_loads, num_blocks_received, num_load_errors_blocks,
       transfer_s = the slowest rank's; failed if any rank's part failed)
    other events (leases released or expired, sync and one-sided loads, ...)
                                 rank 0's (every rank sees each) rank r's

With one rank (kvbridge's own engine, a vLLM engine without tensor parallelism) the totals are
that rank's, as before ranks were counted.
"""

from __future__ import annotations

from collections import OrderedDict

from .metadata import KVBridgeWorkerMeta, PullReport
from .stats import KVTransferStats

__all__ = ["PER_REQUEST_COUNTERS", "RankReports"]

PER_REQUEST_COUNTERS = frozenset(
    {"num_loads", "num_failed_loads", "num_blocks_received", "num_load_errors_blocks"}
)
"""Counters a node counts per request from ``KVBridgeWorkerMeta.pulls``, not from the ranks'
counters."""
MAX_PENDING_PULLS = 4096
"""Requests whose pull some rank has reported and another not yet; the oldest is dropped past
this (a rank that never reports: its worker died, and the engine with it)."""


class RankReports:
    """The node's totals (``stats``) and each rank's own (``by_rank``) from worker reports.

    Owner: the scheduler half's thread (every method); the ``KVTransferStats`` it writes lock
    themselves, so other threads may read them.

    Args:
        stats: the node's statistics (mutated).
    """

    def __init__(self, stats: KVTransferStats) -> None:
        self.stats = stats
        self.by_rank: dict[int, KVTransferStats] = {}
        self.num_ranks = 1
        self._pending: OrderedDict[str, list[PullReport]] = OrderedDict()

    def set_num_ranks(self, num_ranks: int) -> None:
        """The node's worker ranks (its tensor-parallel size; the handshakes tell it).

        Raises:
            ValueError: ``num_ranks`` below 1.
        """
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks

    def apply(self, meta: KVBridgeWorkerMeta) -> None:
        """Add one rank's report (module docstring's table).

        Raises:
            ValueError: a counter name ``KVTransferStats`` does not have (``apply_report``).
        """
        delta = meta.stats
        rank_stats = self.by_rank.setdefault(meta.tp_rank, KVTransferStats())
        rank_stats.apply_report(delta.counters, delta.transfer_s, delta.queue_s)
        node = {
            name: value
            for name, value in delta.counters.items()
            if name not in PER_REQUEST_COUNTERS
            and (meta.tp_rank == 0 or name.startswith("bytes_"))
        }
        self.stats.apply_report(node, [], [])
        for report in meta.pulls:
            self._add(report)

    def _add(self, report: PullReport) -> None:
        reports = self._pending.setdefault(report.request_id, [])
        reports.append(report)
        if len(reports) < self.num_ranks:
            while len(self._pending) > MAX_PENDING_PULLS:
                self._pending.popitem(last=False)
            return
        del self._pending[report.request_id]
        num_failed = max(r.num_failed_blocks for r in reports)
        if num_failed:
            self.stats.record_failed_load(num_failed_blocks=num_failed)
        else:
            self.stats.record_load(
                nbytes=0,  # bytes arrive as the ranks' bytes_received counters
                num_blocks=max(r.num_blocks for r in reports),
                transfer_s=max(r.transfer_s for r in reports),
                queue_s=max(r.queue_s for r in reports),
            )
