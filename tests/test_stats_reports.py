"""``KVTransferStats``' per-step reports: what changed since the last one, read in one go."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from kvbridge.connector.metadata import KVBridgeWorkerMeta, StatsDelta
from kvbridge.connector.rank_reports import RankReports
from kvbridge.connector.stats import COUNTER_NAMES, KVTransferStats


def test_the_counters_are_every_integer_field_in_order():
    ints = [f.name for f in dataclasses.fields(KVTransferStats)
            if not f.name.startswith("_") and isinstance(getattr(KVTransferStats(), f.name), int)
            and not isinstance(getattr(KVTransferStats(), f.name), bool)]
    assert list(COUNTER_NAMES) == ints
    stats = KVTransferStats()
    stats.add("num_loads", 2)
    assert stats.counters() == {name: 2 if name == "num_loads" else 0 for name in ints}
    assert stats.counter_values() == tuple(stats.counters().values())


def test_take_report_gives_each_increment_once():
    stats = KVTransferStats()
    assert stats.take_report() == ({}, [], [])
    stats.add("num_loads", 3)
    stats.record_load(nbytes=10, num_blocks=1, transfer_s=0.5, queue_s=0.25)
    assert stats.take_report() == (
        {"num_loads": 4, "bytes_received": 10, "num_blocks_received": 1}, [0.5], [0.25])
    assert stats.take_report() == ({}, [], [])  # nothing since
    stats.add("bytes_sent", 7)
    assert stats.take_report() == ({"bytes_sent": 7}, [], [])


def test_a_report_adds_up_on_the_other_half_and_names_are_checked():
    worker, node = KVTransferStats(), KVTransferStats()
    worker.add("num_index_blocks_served", 5)
    node.apply_report(*worker.take_report())
    assert node.num_index_blocks_served == 5
    for bad in ("_lock", "transfer_s_sum", "no_such_counter"):
        with pytest.raises(ValueError, match="not a counter"):
            node.apply_report({bad: 1}, [], [])
        with pytest.raises(ValueError, match="not a counter"):
            node.add(bad)
    assert node.counters()["num_index_blocks_served"] == 5


def test_a_worker_report_naming_an_unknown_counter_counts_the_rest_and_says_so_once(caplog):
    # A worker of another kvbridge version may name a counter this scheduler half lacks: the
    # step's report must not raise inside vLLM's update_from_output.
    node = KVTransferStats()
    reports = RankReports(node)
    meta = KVBridgeWorkerMeta(stats=StatsDelta(
        counters={"bytes_sent": 10, "num_future_things": 3}, transfer_s=[0.5]))
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.rank_reports"):
        reports.apply_step([meta, meta])
    assert node.bytes_sent == 20 and reports.by_rank[0].bytes_sent == 20
    assert reports.by_rank[0].transfer_s_sum == 1.0
    assert [r.getMessage().count("num_future_things") for r in caplog.records] == [1]
