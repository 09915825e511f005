"""The main job with two decode nodes (``kvbridge-demo --nodes 2``, connector/serve/demo/nodes.py):
real processes (Redis, P, two D), a request that shares a prefix with one served on the other
decode node pulls that prefix from it through the index, and the report counts pulls per
holder."""

from __future__ import annotations

import json
from pathlib import Path

from kvbridge.connector.serve.demo import pd_pair
from kvbridge.connector.serve.demo.nodes import SpreadRouter


def _write_trace(path: Path) -> None:
    """Four Mooncake lines (512 trace tokens per hash id -> one 16-token block each). With one
    request at a time the router alternates decode-0, decode-1, decode-0, decode-1:

    - 0 (decode-0): blocks 1..6;  1 (decode-1): blocks 20..22, nothing shared;
    - 2 (decode-0): blocks 1..6 + 7: decode-0 holds the prefix itself (no hop);
    - 3 (decode-1): blocks 1..6 + 8: the deepest holders of 1..6 are P and decode-0, so
      decode-1 first pulls them through the index (from decode-0: it sorts before ``prefill``),
      then the rest from P.
    """
    lines = [[1, 2, 3, 4, 5, 6], [20, 21, 22], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]]
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 4,
                    "hash_ids": ids}) + "\n"
        for i, ids in enumerate(lines)
    ))


def test_two_decode_nodes_pull_a_shared_prefix_from_each_other(capsys, tmp_path):
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    argv = ["--no-progress", "--model", "tiny", "--nodes", "2", "--trace", str(trace),
            "--limit", "4", "--concurrency", "1", "--max-tokens", "4",
            "--workdir", str(tmp_path / "work")]
    code = pd_pair.run(pd_pair.parse_args(argv))
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    assert code == 0, out[-12:]
    assert (report["completed"], report["errors"], report["mismatches"]) == (4, 0, 0)
    assert report["failed_loads"] == 0
    assert report["requests_by_decode_node"] == {"decode-0": 2, "decode-1": 2}
    # Request 3's hop: 6 blocks restored on decode-1 without computing them.
    assert (report["prefix_hops"], report["prefix_hop_errors"]) == (1, 0)
    assert report["prefix_hop_tokens"] == report["prefix_hop_cached_tokens"] == 6 * 16
    by_holder = report["pulls_by_holder"]
    assert set(by_holder) >= {"prefill", "decode-0", "decode-1"}
    assert by_holder["decode-1"]["decode-0"] == {"pulls": 1, "blocks": 6, "index_pulls": 1}
    assert report["decode_pulls_from_decode"] == 1
    # Every request's handover pulled from P (request 2's only what decode-0 lacked).
    assert report["decode_pulls_from_prefill"] == 4
    assert all(c["index_pulls"] == 0 for d in ("decode-0", "decode-1")
               for h, c in by_holder[d].items() if h == "prefill")


def test_least_loaded_decode_node_and_no_hop_without_an_index():
    router = SpreadRouter({"http://d0": "decode-0", "http://d1": "decode-1"}, locator=None,
                          block_size=16)
    router._in_flight["http://d0"] = 2  # d0 busy: d1 wins whatever the turn
    assert [router.choose_decode() for _ in range(3)] == ["http://d1"] * 3
    router._in_flight["http://d1"] = 2  # a tie: in turn
    assert {router.choose_decode() for _ in range(2)} == {"http://d0", "http://d1"}
    assert router.prefix_to_pull(list(range(100)), "http://d0") == 0  # no index, no hop
