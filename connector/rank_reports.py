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
    a block's offload            once, when every rank reported  rank r's num_offloaded_blocks
      (num_offloaded_blocks; the outcome the offload planner gets: held only if every rank's
       write of its KV heads was held; ``offload_outcomes``)
    a block the store names as a missing ancestor (an ``OffloadOutcome`` marked ``missing``)
                                 once a step, whichever rank's put met it
    other events (leases released or expired, sync and one-sided loads, offload failures, ...)
                                 rank 0's (every rank sees each) rank r's

With one rank (kvbridge's own engine, a vLLM engine without tensor parallelism) the totals are
that rank's, as before ranks were counted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from .metadata import KVBridgeWorkerMeta, PullReport
from .stats import COUNTER_SET, KVTransferStats
from .store.offload_items import OffloadOutcome

__all__ = ["PER_REQUEST_COUNTERS", "RankReports"]

logger = logging.getLogger(__name__)

PER_REQUEST_COUNTERS = frozenset(
    {"num_loads", "num_failed_loads", "num_blocks_received", "num_load_errors_blocks",
     "num_offloaded_blocks"}
)
"""Counters a node counts per request from ``KVBridgeWorkerMeta.pulls``, not from the ranks'
counters."""
MAX_PENDING_PULLS = 4096
"""Requests whose pull some rank has reported and another not yet; the oldest is dropped past
this (a rank that never reports: its worker died, and the engine with it)."""
MAX_PENDING_OFFLOADS = 1 << 16
"""Blocks whose offload some rank has reported and another not yet; past this the oldest is
settled as not held (the planner plans it again), so a rank that never reports pins nothing."""


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
        # (group_id, block_hash) -> whether each rank that reported holds its heads
        self._offloads: OrderedDict[tuple[int, bytes], list[bool]] = OrderedDict()
        self._unknown_logged: set[str] = set()  # unknown counter names already logged

    def set_num_ranks(self, num_ranks: int) -> None:
        """The node's worker ranks (its tensor-parallel size; the handshakes tell it).

        Raises:
            ValueError: ``num_ranks`` below 1.
        """
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks

    def apply_step(self, metas: Iterable[KVBridgeWorkerMeta]) -> list[OffloadOutcome]:
        """Add the reports of one step (one per rank; ``apply``). Returns the offload outcomes
        they settled, a ``missing`` name once however many ranks' puts met it (which rank's
        put completes a block, and so meets its missing parent, is a race)."""
        settled: dict[OffloadOutcome, None] = {}
        for meta in metas:
            settled.update(dict.fromkeys(self.apply(meta)))
        return list(settled)

    def apply(self, meta: KVBridgeWorkerMeta) -> list[OffloadOutcome]:
        """Add one rank's report (module docstring's table). Returns the offload outcomes it
        settled for the node: a block's once every rank reported it (held only if every rank's
        was), and its ``missing`` names, in the order they settled.

        A counter name ``KVTransferStats`` does not have (a worker of another kvbridge version)
        is left out and logged once per name; the rest of the report counts.
        """
        delta = meta.stats
        counters = delta.counters
        if not COUNTER_SET.issuperset(counters):
            counters = self._known(counters)
        rank_stats = self.by_rank.setdefault(meta.tp_rank, KVTransferStats())
        rank_stats.apply_report(counters, delta.transfer_s, delta.queue_s)
        node = {
            name: value
            for name, value in counters.items()
            if name not in PER_REQUEST_COUNTERS
            and (meta.tp_rank == 0 or name.startswith("bytes_"))
        }
        self.stats.apply_report(node, [], [])
        for report in meta.pulls:
            self._add(report)
        return self._settle_offloads(meta)

    def _known(self, counters: dict[str, int]) -> dict[str, int]:
        for name in counters.keys() - COUNTER_SET - self._unknown_logged:
            self._unknown_logged.add(name)
            logger.warning("a worker report names the counter %r, which this scheduler half "
                           "does not have (another kvbridge version?); it is left out", name)
        return {name: value for name, value in counters.items() if name in COUNTER_SET}

    def _settle_offloads(self, meta: KVBridgeWorkerMeta) -> list[OffloadOutcome]:
        settled: list[OffloadOutcome] = []
        for raw in meta.offload_outcomes:
            outcome = OffloadOutcome._make(raw)
            if outcome.missing:
                settled.append(outcome)
                continue
            held = self._offloads.setdefault(outcome.key, [])
            held.append(outcome.held)
            if len(held) >= self.num_ranks:
                del self._offloads[outcome.key]
                settled.append(outcome._replace(held=all(held)))
        while len(self._offloads) > MAX_PENDING_OFFLOADS:
            (group_id, block_hash), _ = self._offloads.popitem(last=False)
            settled.append(OffloadOutcome(group_id, block_hash, False))
        num_held = sum(outcome.held for outcome in settled)
        if num_held:
            self.stats.add("num_offloaded_blocks", num_held)
        return settled

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
