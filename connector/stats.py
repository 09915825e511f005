"""Transfer statistics a node exports (issue 5, part 5; the node server turns them into
Prometheus metrics).

All counters only grow; durations are kept as running sums plus a bounded window of recent
samples for percentiles. Thread-safe: the worker half updates them from the transport's event
loop thread while the server reads them.
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["COUNTER_NAMES", "COUNTER_SET", "KVTransferStats"]

_WINDOW = 4096


def _percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class KVTransferStats:
    """Counters and durations of KV movement on one node.

    Attributes (units in the names): ``bytes_received`` / ``bytes_sent`` (KV payload bytes;
    sent: a handoff's when its lease is released, an index read's as each block is served),
    ``num_loads`` (pulls that landed), ``num_failed_loads`` (pulls that failed, timed out or were
    refused), ``num_blocks_received``, ``num_load_errors_blocks`` (local blocks that did not
    land), ``num_expired_leases`` (blocks held for a puller that never came back),
    ``num_index_lookups`` / ``num_index_hits`` (cross-node prefix lookups and pulls they started),
    ``num_index_lookup_failures`` (lookups answered without asking a holder: the index down or
    erroring, no answer within ``index_lookup_timeout_s``, too many in flight; the request went
    on with its local hit), ``num_index_blocks_served`` (blocks this holder served to a pull
    found through the index, re-checked after their bytes left; their bytes are in
    ``bytes_sent``),
    ``bytes_received_same_host`` (the part of ``bytes_received`` pulled by a same-host copy,
    ``kvbridge.transport.cma``), ``num_one_sided_loads`` / ``num_board_fallbacks`` (same-host
    handoff pulls checked on the holder's block board alone, and those the board did not vouch
    for, which then asked the holder: ``kvbridge.transport.cma_board``), ``num_sync_loads``
    (pulls that fed the step that planned them: ``load_mode`` "sync", or "auto"'s one-sided
    handoffs),
    ``remote_hit_tokens`` / ``store_hit_tokens`` (prompt tokens
    planned from another node's device/host blocks, or from the store tier),
    ``num_released_leases`` (completion notices), ``num_window_gaps`` (tickets D computed
    itself because P had already dropped a sliding-window block D's window needs:
    ``pull_plan.window_gap_groups``), ``num_refused_lease_tokens`` (heartbeats and
    release notices naming a lease without its ticket's token: refused, the lease untouched),
    ``num_offloaded_blocks`` / ``bytes_offloaded`` (blocks the store tier now holds from this
    node's writes), ``num_offload_failures`` (writes that failed: store unreachable or refused),
    ``num_offload_refused_blocks`` (the store had no room), ``num_offload_skipped_blocks`` (not
    snapshotted: too many bytes already waiting for the store), ``num_offload_missing_ancestors``
    (names in the store's put replies of ancestors it does not hold: a block may be named by
    several puts; the planner writes it again only if the pool still caches it),
    ``num_restored_blocks`` / ``bytes_restored`` (blocks pulled back from the store tier),
    ``transfer_s`` (pull durations, seconds), ``queue_s`` (from the request's arrival to the
    pull's start, seconds).

    Per holder (``pulls_by_holder()``, kept by the scheduler half, which plans every pull): pulls
    planned from each holder engine id, their blocks (summed over KV cache groups, as
    ``num_blocks_received``) and how many of them the index found (the rest are P/D handovers
    under a ticket). A planned pull that then fails is also counted in ``num_failed_loads``.
    """

    bytes_received: int = 0
    bytes_received_same_host: int = 0
    num_one_sided_loads: int = 0
    num_board_fallbacks: int = 0
    num_sync_loads: int = 0
    bytes_sent: int = 0
    num_loads: int = 0
    num_failed_loads: int = 0
    num_blocks_received: int = 0
    num_load_errors_blocks: int = 0
    num_expired_leases: int = 0
    num_released_leases: int = 0
    num_refused_lease_tokens: int = 0
    num_rejected_params: int = 0
    num_role_mismatches: int = 0
    num_window_gaps: int = 0
    num_index_lookups: int = 0
    num_index_hits: int = 0
    num_index_lookup_failures: int = 0
    num_index_blocks_served: int = 0
    remote_hit_tokens: int = 0
    store_hit_tokens: int = 0
    num_offloaded_blocks: int = 0
    bytes_offloaded: int = 0
    num_offload_failures: int = 0
    num_offload_refused_blocks: int = 0
    num_offload_skipped_blocks: int = 0
    num_offload_missing_ancestors: int = 0
    num_restored_blocks: int = 0
    bytes_restored: int = 0
    transfer_s_sum: float = 0.0
    queue_s_sum: float = 0.0
    _transfer_s: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW), repr=False)
    _queue_s: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reported: tuple[int, ...] = field(default=(), repr=False)  # take_report's last values
    _unreported_transfer_s: list[float] = field(default_factory=list, repr=False)
    _unreported_queue_s: list[float] = field(default_factory=list, repr=False)
    _holder_to_pulls: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)

    def record_load(
        self, *, nbytes: int, num_blocks: int, transfer_s: float, queue_s: float
    ) -> None:
        """A pull landed: ``nbytes`` of KV in ``num_blocks`` blocks took ``transfer_s``."""
        with self._lock:
            self.num_loads += 1
            self.bytes_received += nbytes
            self.num_blocks_received += num_blocks
            self.transfer_s_sum += transfer_s
            self.queue_s_sum += queue_s
            self._transfer_s.append(transfer_s)
            self._queue_s.append(queue_s)
            self._unreported_transfer_s.append(transfer_s)
            self._unreported_queue_s.append(queue_s)

    def record_pull_planned(self, holder_engine_id: str, *, num_blocks: int,
                            via_index: bool) -> None:
        """A pull of ``num_blocks`` blocks from ``holder_engine_id`` was ordered (``via_index``:
        found through the block index; otherwise a P/D handover's ticket)."""
        with self._lock:
            counts = self._holder_to_pulls.setdefault(
                holder_engine_id, {"pulls": 0, "blocks": 0, "index_pulls": 0}
            )
            counts["pulls"] += 1
            counts["blocks"] += num_blocks
            counts["index_pulls"] += int(via_index)

    def pulls_by_holder(self) -> dict[str, dict[str, int]]:
        """``{holder engine id: {"pulls", "blocks", "index_pulls"}}`` (a copy)."""
        with self._lock:
            return {holder: dict(counts) for holder, counts in self._holder_to_pulls.items()}

    def record_failed_load(self, *, num_failed_blocks: int) -> None:
        with self._lock:
            self.num_failed_loads += 1
            self.num_load_errors_blocks += num_failed_blocks

    def add(self, name: str, amount: int = 1) -> None:
        """Increase the integer counter ``name`` (e.g. ``"num_expired_leases"``)."""
        if name not in COUNTER_SET:
            raise ValueError(f"{name!r} is not a counter of KVTransferStats")
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def counters(self) -> dict[str, int]:
        """Every integer counter by name, as it is now (a copy, read under the lock)."""
        return dict(zip(COUNTER_NAMES, self.counter_values(), strict=True))

    def counter_values(self) -> tuple[int, ...]:
        """Every integer counter's value, in ``COUNTER_NAMES`` order (read under the lock, in
        one C call: for a caller that compares them every engine step)."""
        with self._lock:
            return _read_counters(self)

    def take_report(self) -> tuple[dict[str, int], list[float], list[float]]:
        """What changed since the last call: ``(counter increments, transfer_s samples, queue_s
        samples)``. The worker half sends it to the scheduler half each step."""
        with self._lock:
            values, reported = _read_counters(self), self._reported or _NO_COUNTS
            counters = {} if values == reported else {
                name: value - old
                for name, value, old in zip(COUNTER_NAMES, values, reported, strict=True)
                if value != old}
            self._reported = values
            transfer, self._unreported_transfer_s = self._unreported_transfer_s, []
            queue, self._unreported_queue_s = self._unreported_queue_s, []
        return counters, transfer, queue

    def apply_report(
        self, counters: dict[str, int], transfer_s: list[float], queue_s: list[float]
    ) -> None:
        """Add another half's ``take_report`` (the node's totals live in the scheduler half).

        Raises:
            ValueError: a name that is not a counter (a message from an incompatible peer).
        """
        for name in counters:
            if name not in COUNTER_SET:
                raise ValueError(f"{name!r} is not a counter of KVTransferStats")
        with self._lock:
            for name, delta in counters.items():
                setattr(self, name, getattr(self, name) + delta)
            self.transfer_s_sum += sum(transfer_s)
            self.queue_s_sum += sum(queue_s)
            self._transfer_s.extend(transfer_s)
            self._queue_s.extend(queue_s)

    def snapshot(self) -> dict[str, Any]:
        """A plain dict of every counter plus transfer p50/p99 and GB/s, for reports/metrics."""
        with self._lock:
            transfer = list(self._transfer_s)
            queue = list(self._queue_s)
            out = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        out["transfer_s_p50"] = _percentile(transfer, 0.50)
        out["transfer_s_p99"] = _percentile(transfer, 0.99)
        out["queue_s_p50"] = _percentile(queue, 0.50)
        out["receive_gb_per_s"] = (
            out["bytes_received"] / out["transfer_s_sum"] / 1e9 if out["transfer_s_sum"] else None
        )
        return out


COUNTER_NAMES: tuple[str, ...] = tuple(
    f.name for f in fields(KVTransferStats)
    if f.type in ("int", int) and not f.name.startswith("_"))
"""``KVTransferStats``' integer counters, in field order."""
COUNTER_SET = frozenset(COUNTER_NAMES)
"""The same names, for membership tests."""
_read_counters = operator.attrgetter(*COUNTER_NAMES)
_NO_COUNTS = (0,) * len(COUNTER_NAMES)
