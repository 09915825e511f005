"""``StatsTap``: vLLM's ``get_kv_connector_stats`` each step, the counters' increments only."""

from __future__ import annotations

from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.vllm.metrics import KVBridgeConnectorStats, StatsTap


def test_a_step_with_nothing_new_reports_none_and_each_increment_is_reported_once():
    stats = KVTransferStats()
    stats.add("num_index_lookups", 4)  # before the tap: not an increment of its steps
    tap = StatsTap(stats)
    assert tap.take() is None
    stats.add("num_index_lookups")
    stats.add("num_index_hits", 2)
    taken = tap.take()
    assert isinstance(taken, KVBridgeConnectorStats)
    assert taken.data == {"counters": {"num_index_lookups": 1, "num_index_hits": 2},
                          "load_s": []}
    assert tap.take() is None
    tap.observe_load_s([0.125])  # a pull's duration alone is news
    assert tap.take().data == {"counters": {}, "load_s": [0.125]}
    assert tap.take() is None
