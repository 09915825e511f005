"""benchmarks/bench_replay_bound.py: LRU, S3-FIFO, the reuse bonus, oracle admission and Belady's
MIN on hand-made block streams whose answers are worked out below (issue 14, part 4)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_replay_bound.py"


def _load_bench() -> ModuleType:
    sys.path.insert(0, str(_BENCH.parent))  # its sibling _report, as when run as a script
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


def _scan(first_id: int, num_requests: int) -> list:
    """``num_requests`` one-shot requests of two new blocks each (ids from ``first_id``)."""
    return [bench.BlockRequest((first_id + 2 * k, first_id + 2 * k + 1), 1)
            for k in range(num_requests)]


def test_s3fifo_keeps_a_block_hit_twice_through_a_scan_that_flushes_lru() -> None:
    # 10 blocks: a small FIFO of 1, a main FIFO of 9. [1, 2] then [1, 3]: block 1 is hit once
    # while in the small FIFO. Five one-shot requests (10 new blocks) follow, then [1, 4].
    # LRU: 3 + 10 blocks push 2, 3 and then 1 out: only [1, 3]'s hit. S3-FIFO: leaving the
    # small FIFO, 1 (hit there) moves to the main FIFO while 2, 3 and the scan's blocks (never
    # hit) are evicted from the small one, which always holds its share of 1 again, so the main
    # FIFO never evicts: [1, 4] hits too.
    stream = [bench.BlockRequest((1, 2), 1), bench.BlockRequest((1, 3), 1), *_scan(10, 5),
              bench.BlockRequest((1, 4), 1)]
    assert bench.lru_hits(stream, 10) == (1, 1)
    assert bench.s3fifo_hits(stream, 10) == (2, 2)


def test_s3fifo_sends_a_ghost_hit_to_the_main_fifo() -> None:
    # [1, 2], five one-shot requests: 1 leaves the small FIFO never hit, so it is evicted and
    # its id goes to the ghost FIFO. [1, 3] misses it (LRU too), but the ghost sends it to the
    # main FIFO, where the next five one-shot requests do not reach it: [1, 4] hits. Inserted
    # into the small FIFO instead, it would be evicted by the scan as before; LRU loses it.
    stream = [bench.BlockRequest((1, 2), 1), *_scan(10, 5), bench.BlockRequest((1, 3), 1),
              *_scan(30, 5), bench.BlockRequest((1, 4), 1)]
    assert bench.lru_hits(stream, 10) == (0, 0)
    assert bench.s3fifo_hits(stream, 10) == (1, 1)


def test_the_cap_and_the_leading_run() -> None:
    # r1 repeats r0 whole: with a cap of 2 (of 3 blocks) it hits 2; block 9 found after a
    # missing block 8 is a block hit but not part of the leading run.
    stream = [bench.BlockRequest((1, 2, 3), 2), bench.BlockRequest((1, 2, 3), 2),
              bench.BlockRequest((8, 9), 1), bench.BlockRequest((7, 9), 1)]
    assert bench.belady_hits(stream, 100) == (2, 3 + 1)
    assert bench.lru_hits(stream, 100) == (2, 3 + 1)


def test_reuse_bonus_keeps_a_block_used_twice_through_newer_one_shot_blocks() -> None:
    # Capacity 2, bonus 300 s. r1 reuses 1 at 10 s (priority 10 + 300). r2's two new blocks
    # (priority 20) push out 3 and then r2's own deeper block 5, not 1; r3 hits 1. LRU drops
    # 1 at r2 (touched at 10 s, older than r2's blocks) and misses at r3.
    stream = [bench.BlockRequest(ids, 1, t) for ids, t in
              (((1, 2), 0.0), ((1, 3), 10.0), ((4, 5), 20.0), ((1, 6), 30.0))]
    assert bench.reuse_bonus_hits(stream, 2, bonus_s=300.0) == (2, 2)
    assert bench.lru_hits(stream, 2) == (1, 1)
    # With no bonus it is LRU by arrival time.
    assert bench.reuse_bonus_hits(stream, 2, bonus_s=0.0) == (1, 1)


def test_oracle_admission_keeps_only_blocks_that_come_back() -> None:
    # Two blocks: the one-shot tails 2, 4, 5, 6, 7 are never cached, so roots 1 and 3 stay and
    # every hit of the unbounded cache is served (LRU: none, the tails push the roots out).
    assert bench.oracle_admission_hits(_STREAM, 2) == (3, 3)
    assert bench.lru_hits(_STREAM, 2) == (0, 0)
    # One block: 3 (r1) pushes 1 out, 1 (r2, a miss) pushes 3 out: only r4 hits.
    assert bench.oracle_admission_hits(_STREAM, 1) == (1, 1)


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
    # S3-FIFO at 2 blocks (small 1, main 1, ghost 1): r1 evicts 2 and 1 from the small FIFO
    # (the ghost keeps 1); r2 misses 1 but the ghost puts it in the main FIFO, r3 does the same
    # for 3 (main: 1, 3), and r4 finds 1 there: 1 hit of 3. At 1 block nothing survives.
    assert [rows[c]["s3fifo"] for c in (1, 2, 1000)] == [0.0, round(1 / 3, 4), 1.0]
    assert [rows[c]["oracle_admission"] for c in (1, 2, 1000)] == [round(1 / 3, 4), 1.0, 1.0]
    # Reuse bonus at 2 blocks (r_i arrives at i s): r1's blocks push out 1 and 2 (older, used
    # once); r2 misses 1, and its second use gives it priority 302, so r3's new blocks push out
    # 5 and 6 (priorities 2 and 3) instead; r4 hits 1: 1 of 3 (r3 missed 3).
    assert [rows[c]["reuse_bonus"] for c in (1, 2, 1000)] == [0.0, round(1 / 3, 4), 1.0]
