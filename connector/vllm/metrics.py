"""kvbridge's transfer statistics in vLLM's own metrics: the log line and Prometheus.

vLLM 0.32 carries a connector's statistics from EngineCore to the frontend each step
(vllm/v1/core/sched/scheduler.py: ``connector.get_kv_connector_stats()`` on the scheduler side,
merged with the workers' and sent as ``to_dict()`` in ``SchedulerStats.kv_connector_stats``);
the frontend rebuilds them with the connector class's ``build_kv_connector_stats(data)``, sums
them over the logging interval (``KVConnectorStats.aggregate``), prints ``reduce()`` as "KV
Transfer metrics: ..." and hands the same dicts to the ``KVConnectorPromMetrics`` that the
class's ``build_prom_metrics`` made (vllm/distributed/kv_transfer/kv_connector/v1/metrics.py).

kvbridge reports from the scheduler half only: every step the worker half's counters and pull
durations already reach it (``KVBridgeWorkerMeta``), so the scheduler half's
``KVTransferStats`` holds the node's totals, and ``StatsTap`` turns them into per-step deltas.
The worker half returns None, so nothing is counted twice.
"""

from __future__ import annotations

import statistics
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from ..stats import COUNTER_NAMES, KVTransferStats

__all__ = ["KVBridgeConnectorStats", "KVBridgePromMetrics", "StatsTap"]

METRIC_PREFIX = "vllm:kvbridge_"
"""Prefix of every Prometheus metric (vLLM unregisters ``vllm:`` collectors on restart)."""
MAX_SAMPLES = 4096
"""Pull durations kept between two reports at most (older ones are dropped)."""
_STORE_TIER_COUNTERS = (
    ("blocks offloaded", "num_offloaded_blocks"),
    ("blocks restored", "num_restored_blocks"),
    ("store write failures", "num_offload_failures"),
)
LOAD_TIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)


class KVBridgeConnectorStats(KVConnectorStats):
    """One interval's kvbridge statistics, as vLLM moves them.

    ``data`` is ``{"counters": {name: increment}, "load_s": [seconds, ...]}``: increments of
    ``KVTransferStats``'s integer counters (``bytes_received``, ``num_loads``,
    ``num_failed_loads``, ...) and the durations of the pulls that landed. Plain values only:
    it crosses processes as msgpack. Owner: whichever thread built it (not shared).
    """

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        data = dict(data or {})
        super().__init__(
            data={
                "counters": {str(k): int(v) for k, v in (data.get("counters") or {}).items()},
                "load_s": [float(s) for s in data.get("load_s") or []],
            }
        )

    def reset(self) -> None:
        self.data = {"counters": {}, "load_s": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s increments and samples into this one (mutated); returns self."""
        if not isinstance(other, KVBridgeConnectorStats) or other is self:
            return self
        counters = self.data["counters"]
        for name, delta in other.data["counters"].items():
            counters[name] = counters.get(name, 0) + delta
        self.data["load_s"] = (self.data["load_s"] + other.data["load_s"])[-MAX_SAMPLES:]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval for vLLM's log line: pulls, failures, MiB moved, load times in ms, and
        the store tier's blocks offloaded and restored and its failed writes, when any."""
        counters, load_s = self.data["counters"], self.data["load_s"]
        out: dict[str, int | float] = {
            "pulls": counters.get("num_loads", 0),
            "failed pulls": counters.get("num_failed_loads", 0),
            "MiB pulled": round(counters.get("bytes_received", 0) / (1 << 20), 3),
            "MiB served": round(counters.get("bytes_sent", 0) / (1 << 20), 3),
        }
        if load_s:
            out["load ms p50"] = round(statistics.median(load_s) * 1e3, 3)
            out["load ms max"] = round(max(load_s) * 1e3, 3)
        for name in ("num_expired_leases", "num_rejected_params", "num_load_errors_blocks"):
            if counters.get(name):
                out[name] = counters[name]
        for label, name in _STORE_TIER_COUNTERS:  # an engine with store_url
            if counters.get(name):
                out[label] = counters[name]
        return out

    def is_empty(self) -> bool:
        return not (any(self.data["counters"].values()) or self.data["load_s"])


class StatsTap:
    """Per-step deltas of a scheduler half's ``KVTransferStats`` for vLLM.

    Owner: the engine thread (the scheduler half's). ``observe_load_s`` takes the pull
    durations of the worker reports the adapter passes on; ``take`` answers
    ``get_kv_connector_stats``: the counters' increments since the last ``take`` and those
    durations, or None when nothing changed.
    """

    def __init__(self, stats: KVTransferStats) -> None:
        self._stats = stats
        self._reported = stats.counter_values()
        self._load_s: list[float] = []

    def observe_load_s(self, samples: list[float]) -> None:
        self._load_s = (self._load_s + list(samples))[-MAX_SAMPLES:]

    def take(self) -> KVBridgeConnectorStats | None:
        now, reported = self._stats.counter_values(), self._reported
        deltas = {} if now == reported else {  # (the usual step: nothing changed, one compare)
            name: value - old
            for name, value, old in zip(COUNTER_NAMES, now, reported, strict=True) if value != old}
        self._reported = now
        load_s, self._load_s = self._load_s, []
        if not deltas and not load_s:
            return None
        return KVBridgeConnectorStats({"counters": deltas, "load_s": load_s})


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics of kvbridge, one child per engine: a counter
    ``vllm:kvbridge_<name>`` for every integer counter of ``KVTransferStats`` (for example
    ``vllm:kvbridge_bytes_received_total``, ``..._num_loads_total``,
    ``..._num_failed_loads_total``) and the histogram ``vllm:kvbridge_load_time_seconds`` of
    pull durations. Built in the frontend by vLLM's ``KVConnectorProm``; ``observe`` runs
    there on each step's ``KVBridgeConnectorStats.to_dict()``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in KVTransferStats().counters():
            metric = self._counter_cls(
                name=f"{METRIC_PREFIX}{name}",
                documentation=f"kvbridge connector: {name} (KVTransferStats)",
                labelnames=labelnames,
            )
            self._counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        histogram = self._histogram_cls(
            name=f"{METRIC_PREFIX}load_time_seconds",
            documentation="kvbridge connector: duration of each pull that landed (seconds)",
            buckets=list(LOAD_TIME_BUCKETS_S),
            labelnames=labelnames,
        )
        self._load_time = create_metric_per_engine(histogram, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KVBridgeConnectorStats(transfer_stats_data)
        for name, delta in stats.data["counters"].items():
            by_engine = self._counters.get(name)
            if by_engine is not None and delta > 0 and engine_idx in by_engine:
                by_engine[engine_idx].inc(delta)
        histogram = self._load_time.get(engine_idx)
        if histogram is not None:
            for seconds in stats.data["load_s"]:
                histogram.observe(seconds)

