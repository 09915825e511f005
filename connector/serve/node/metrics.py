"""The node's statistics: one JSON snapshot (``GET /v1/stats``) and its Prometheus form
(``GET /metrics``).

Sources, all read at scrape time (no sampling thread):

- ``EngineLoop.counters`` (connector/serve/node/loop.py): requests, tokens, local APC hits (from
  ``KVCacheManager.make_prefix_cache_stats``), tokens served from a cache at admission, per-request
  KV load times, and the scheduler's ``make_stats()`` (queues, preemptions, KV usage).
- The connector's ``KVTransferStats.snapshot()`` (connector/stats.py), when the node has a
  connector that exposes ``stats``: bytes moved, pull durations, failed loads, expired leases.
- Pulls per holder engine id (``KVTransferStats.pulls_by_holder``: pulls, blocks, and how many
  of them the index found), under ``pulls_by_holder``.
- The block index's ``IndexStats`` (``KVBridgeConnector.index_stats``: lookups, hits, Redis
  trouble) when the node has an index.

Hit rates are fractions of prompt tokens: ``local`` = local APC hit tokens / prompt tokens looked
up; ``remote`` = tokens the connector planned to pull from another node's device or host blocks
after an index lookup (``remote_hit_tokens``; a P/D handover is not an index hit and is counted
by ``pd_cached_tokens``); ``store`` = the same from the store tier (``store_hit_tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from kvbridge.connector import KVBridgeConnector
from kvbridge.kvmanager import Engine
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["NodeMetricsCollector", "connector_of", "node_stats"]

_PREFIX = "kvbridge_"


def connector_of(engine: Engine) -> KVBridgeConnector | None:
    """The scheduler-side connector when it is kvbridge's (None otherwise)."""
    connector = engine.scheduler.connector
    return connector if isinstance(connector, KVBridgeConnector) else None


def node_stats(loop: Any, *, role: str, engine_id: str) -> dict[str, Any]:
    """One JSON-ready dict of everything this node knows about itself.

    Args:
        loop: the node's ``EngineLoop``.
        role, engine_id: labels of the node.
    """
    counters = loop.counters.snapshot()
    connector = connector_of(loop.engine)
    transfer: dict[str, Any] = {}
    index: dict[str, Any] = {}
    pulls_by_holder: dict[str, dict[str, int]] = {}
    if connector is not None:
        transfer = dict(connector.stats.snapshot())
        pulls_by_holder = connector.stats.pulls_by_holder()
        index_stats = connector.index_stats
        if index_stats is not None:
            index = {
                k: v for k, v in dataclasses.asdict(index_stats).items() if isinstance(v, int)
            }
    queries = max(counters["local_query_tokens"], 1)
    prompt_tokens = max(counters["prompt_tokens"], 1)
    remote_tokens = int(transfer.get("remote_hit_tokens", 0) or 0)
    store_tokens = int(transfer.get("store_hit_tokens", 0) or 0)
    return {
        "role": role,
        "engine_id": engine_id,
        "block_size": loop.engine.config.block_size,
        "counters": counters,
        "transfer": transfer,
        "index": index,
        "pulls_by_holder": pulls_by_holder,
        "hit_rate": {
            "local": counters["local_hit_tokens"] / queries,
            "remote": remote_tokens / prompt_tokens,
            "store": store_tokens / prompt_tokens,
        },
    }


class NodeMetricsCollector(Collector):
    """A Prometheus collector over :func:`node_stats` (register it on a ``CollectorRegistry``)."""

    def __init__(self, loop: Any, *, role: str, engine_id: str) -> None:
        self._loop = loop
        self._labels = {"role": role, "engine_id": engine_id}

    def describe(self) -> list:
        return []  # collected lazily; avoids a scrape at registration

    def collect(self) -> Iterator[Any]:
        stats = node_stats(self._loop, **self._labels)
        names, values = list(self._labels), list(self._labels.values())
        c, t = stats["counters"], stats["transfer"]

        def counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
            family = CounterMetricFamily(_PREFIX + name, doc, labels=names)
            family.add_metric(values, float(value or 0))
            return family

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(_PREFIX + name, doc, labels=names)
            family.add_metric(values, float(value or 0))
            return family

        yield counter("requests_finished", "Requests finished normally", c["requests_finished"])
        yield counter("requests_failed", "Requests finished with an error", c["requests_failed"])
        yield counter("requests_aborted", "Requests aborted", c["requests_aborted"])
        yield counter("requests_rejected", "Requests refused at the door", c["requests_rejected"])
        yield counter("prompt_tokens", "Prompt tokens of finished requests", c["prompt_tokens"])
        yield counter("generation_tokens", "Generated tokens", c["generation_tokens"])
        yield counter("preemptions", "Requests preempted", c.get("num_preemptions"))
        yield gauge("kv_cache_usage_ratio", "Fraction of KV blocks in use", c.get("kv_cache_usage"))
        yield gauge("num_requests_running", "Running requests", c.get("num_running_reqs"))
        yield gauge("num_requests_waiting", "Waiting requests", c.get("num_waiting_reqs"))
        yield gauge("num_requests_held", "Finished requests holding blocks", c.get("num_held_reqs"))
        for tier, rate in stats["hit_rate"].items():
            yield gauge(f"prefix_hit_rate_{tier}", f"Prefix hit rate ({tier})", rate)
        yield counter("kv_bytes_received", "KV bytes pulled", t.get("bytes_received"))
        yield counter(
            "kv_bytes_received_same_host",
            "KV bytes pulled by a same-host copy (not over UCX)",
            t.get("bytes_received_same_host"),
        )
        yield counter("kv_bytes_sent", "KV bytes served to pullers", t.get("bytes_sent"))
        yield counter("kv_loads", "KV pulls that landed", t.get("num_loads"))
        yield counter("kv_failed_loads", "KV pulls that failed", t.get("num_failed_loads"))
        yield counter("kv_expired_leases", "Leases expired", t.get("num_expired_leases"))
        yield counter("kv_rejected_params", "Bad kv_transfer_params", t.get("num_rejected_params"))
        yield counter("kv_transfer_seconds", "Sum of pull durations", t.get("transfer_s_sum"))
        yield gauge("kv_transfer_seconds_p50", "Pull duration p50", t.get("transfer_s_p50"))
        yield gauge("kv_transfer_seconds_p99", "Pull duration p99", t.get("transfer_s_p99"))
        yield gauge("kv_receive_gb_per_second", "Pull bandwidth", t.get("receive_gb_per_s"))
        for key, value in stats["index"].items():
            yield counter(f"index_{key}", f"Block index {key}", value)


def make_registry(loop: Any, *, role: str, engine_id: str) -> CollectorRegistry:
    """A fresh registry holding only this node's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeMetricsCollector(loop, role=role, engine_id=engine_id))
    return registry
