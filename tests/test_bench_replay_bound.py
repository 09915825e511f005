"""benchmarks/bench_replay_bound.py: LRU and Belady's MIN on hand-made block streams whose
answers are worked out below (issue 14, part 4)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_replay_bound.py"


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvbridge_bench_replay_bound", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()

# Two conversations, A (root 1) and C (root 3), interleaved with one-shot tails:
# r0 [1, 2], r1 [3, 4], r2 [1, 5], r3 [3, 6], r4 [1, 7]; each may hit its first block only
# (two blocks, the last recomputed). The unbounded cache hits r2, r3 and r4: 3 blocks.
_IDS = [[1, 2], [3, 4], [1, 5], [3, 6], [1, 7]]
_STREAM = [bench.BlockRequest(tuple(ids), 1) for ids in _IDS]


def test_belady_keeps_the_roots_that_come_back() -> None:
    # 2 blocks: after each request MIN evicts the one-shot tails (next use: never) and keeps
    # roots 1 and 3, so every reuse hits: 3, the unbounded cache's figure.
    assert bench.belady_hits(_STREAM, 2) == (3, 3)
    # 1 block: after r1 it keeps 1 (next use r2) over 3 (r3); after r2 it keeps 1 (r4) again,
    # so r3 misses: r2 and r4 hit.
    assert bench.belady_hits(_STREAM, 1) == (2, 2)


def test_max_live_blocks_is_where_belady_reaches_the_unbounded_cache() -> None:
    # Between r1 and r3 both roots are seen and needed again (1 until r4, 3 until r3): 2, the
    # smallest cache in which MIN hits everything (above: 1 block misses r3).
    assert bench.max_live_blocks(_STREAM) == 2
    assert bench.max_live_blocks(_STREAM[:1]) == 0


def test_lru_loses_each_root_to_the_tails_in_between() -> None:
    # 2 blocks: each request's two blocks push out the previous request's, so nothing is there
    # when its root comes back.
    assert bench.lru_hits(_STREAM, 2) == (0, 0)
    # 4 blocks: a root survives the two requests before its reuse: 3 hits.
    assert bench.lru_hits(_STREAM, 4) == (3, 3)


def test_the_cap_and_the_leading_run() -> None:
    # r1 repeats r0 whole: with a cap of 2 (of 3 blocks) it hits 2; block 9 found after a
    # missing block 8 is a block hit but not part of the leading run.
    stream = [bench.BlockRequest((1, 2, 3), 2), bench.BlockRequest((1, 2, 3), 2),
              bench.BlockRequest((8, 9), 1), bench.BlockRequest((7, 9), 1)]
    assert bench.belady_hits(stream, 100) == (2, 3 + 1)
    assert bench.lru_hits(stream, 100) == (2, 3 + 1)


def test_main_reports_fractions_of_the_unbounded_cache(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 1,
                    "hash_ids": ids}) + "\n"
        for i, ids in enumerate(_IDS)
    ))
    summary = bench.main([str(trace), "--capacities", "1,2,1000"])
    # 3 hits of 10 prompt blocks unbounded; 1,000 blocks never evict: both rules reach it.
    assert summary["unbounded_hit_ratio"] == 0.3
    assert summary["max_live_blocks"] == 2
    rows = {r["capacity_blocks"]: r for r in summary["capacities"]}
    assert [rows[c]["belady"] for c in (1, 2, 1000)] == [round(2 / 3, 4), 1.0, 1.0]
    assert [rows[c]["lru"] for c in (1, 2, 1000)] == [0.0, 0.0, 1.0]
