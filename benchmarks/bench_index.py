"""Block-index lookup cost against one Redis PING round trip, measured in the same run.

Workload (issue 6): a 10k-token prompt at block size 16 = 625 block hashes. Four nodes are
registered; node B holds all 625 blocks, A the first 400, C the first 40, D none. Timed loops of
``--iters`` calls, PING and lookup loops interleaved ``--repeats`` times so both see the same load
on a shared machine; the ratio reported is the median of the per-round ratios:

- ``ping_us``: ``redis.Redis.ping()`` (one round trip, the baseline);
- ``lookup_us``: ``RedisBlockIndex.longest_prefix`` of the 625 hashes (one EVALSHA), for the
  holders of the deepest run (the default), and with ``all_holders=True`` (every holder's run);
- ``naive_us``: one GET per block until the first miss (625 round trips; the naive client loop).

Target (DESIGN.md, "Performance targets"): ``lookup_us / ping_us <= 2.0``. Starts its own
``redis-server`` on a free port. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import redis
from kvbridge.connector.block_index import IndexNamespace
from kvbridge.connector.redis_block_index import RedisBlockIndex
from kvbridge.kvmanager.kv_events import BlockStored

NUM_BLOCKS = 625  # 10,000 tokens / block size 16


def _start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    for _ in range(500):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.01)
    proc.kill()
    raise SystemExit(f"redis-server on port {port} did not answer PING")


def _loop_us(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-redis-") as workdir:
        proc, port = _start_redis(workdir)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            namespace = IndexNamespace(model_name="bench", block_size=16, hash_fn_name="sha256")
            index = RedisBlockIndex(namespace, url, socket_timeout_s=5.0)
            hashes = [hashlib.sha256(b"%d" % i).digest() for i in range(NUM_BLOCKS)]
            for node_id, num_held in (("A", 400), ("B", NUM_BLOCKS), ("C", 40), ("D", 0)):
                index.register_node(node_id, 1, ttl_s=600.0)
                event = BlockStored(
                    block_hashes=hashes[:num_held], parent_block_hash=None, token_ids=[],
                    block_size=16, lora_name=None, medium=None, group_id=0,
                    block_ids=list(range(1, num_held + 1)),
                )
                index.publish(node_id, 1, [event])
            hit = index.longest_prefix(hashes)
            if hit.num_blocks != NUM_BLOCKS or hit.holders[0].node_id != "B":
                raise SystemExit(f"unexpected lookup result {hit}")

            client = redis.Redis.from_url(url)
            client.mset({b"naive:" + h: b"1" for h in hashes})

            def naive_lookup() -> int:
                depth = 0
                for h in hashes:
                    if client.get(b"naive:" + h) is None:
                        break
                    depth += 1
                return depth

            rounds = []
            for _ in range(args.repeats):
                ping = _loop_us(client.ping, args.iters)
                lookup = _loop_us(lambda: index.longest_prefix(hashes), args.iters)
                lookup_all = _loop_us(
                    lambda: index.longest_prefix(hashes, all_holders=True), args.iters
                )
                rounds.append((ping, lookup, lookup_all))
            naive_us = min(_loop_us(naive_lookup, 3) for _ in range(3))
        finally:
            proc.kill()
            proc.wait()

    ping_us = statistics.median(r[0] for r in rounds)
    lookup_us = statistics.median(r[1] for r in rounds)
    lookup_all_us = statistics.median(r[2] for r in rounds)
    ratio = statistics.median(r[1] / r[0] for r in rounds)
    ratio_all = statistics.median(r[2] / r[0] for r in rounds)
    result = {
        "benchmark": "index_lookup",
        "num_blocks": NUM_BLOCKS,
        "num_nodes": 4,
        "ping_us": round(ping_us, 1),
        "lookup_us": round(lookup_us, 1),
        "lookup_all_holders_us": round(lookup_all_us, 1),
        "naive_get_loop_us": round(naive_us, 1),
        "lookup_over_ping": round(ratio, 3),
        "lookup_all_holders_over_ping": round(ratio_all, 3),
        "lookup_over_naive": round(lookup_us / naive_us, 4),
        "target_lookup_over_ping": 2.0,
        "meets_target": ratio <= 2.0,
    }
    print(f"{'measure (median)':<34}{'us':>10}{'/ PING':>10}")
    print(f"{'PING round trip':<34}{ping_us:>10.1f}{1.0:>10.2f}")
    print(f"{'longest_prefix(625)':<34}{lookup_us:>10.1f}{ratio:>10.2f}")
    print(f"{'longest_prefix(625, all_holders)':<34}{lookup_all_us:>10.1f}{ratio_all:>10.2f}")
    print(f"{'naive GET per block':<34}{naive_us:>10.1f}{naive_us / ping_us:>10.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
