"""Replay a Mooncake-format request trace through four nodes' KV control planes (no model).

Issue 6, "Performance and real input". Each node is a ``kvbridge.kvmanager.KVCacheManager`` with
a finite pool (``--blocks-per-node``) and KV events on; every node's events feed one block index
(``--index-url``: ``memory`` or a ``redis://`` URL). The trace is replayed twice:

- ``index``: each request goes to the node holding its longest prefix according to the index,
  ties broken by load (running + waiting requests); a prefix that beats the least-loaded node's
  by fewer than ``--min-gain-blocks`` blocks counts as a tie (like the connector's minimum gain:
  otherwise a system prompt shared by every request pins all traffic to the first node);
- ``round_robin``: request i goes to node i mod 4.

Trace format (the Mooncake FAST'25 trace release, kvcache-ai/Mooncake, FAST25-release/traces,
e.g. its ``conversation_trace.jsonl``): one JSON object a line with ``timestamp`` (ms),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token block).
Each hash id becomes a fixed run of ``--block-size`` token ids from a PRNG seeded by the id, and
the prompt is cut to ``ceil(input_length * block_size / 512)`` tokens, so the trace's prefix
sharing is kept exactly at a 512 -> block-size scale.

Time is simulated: a request starts when its node can allocate its prompt (FIFO per node; a
request that does not fit waits for running ones to finish) and holds its blocks for
``prefill_s_per_token * uncached prompt tokens + decode_s_per_token * output_length`` (original
token counts), then frees them, so pools turn over.

Hit ratio = prompt blocks served from a node's prefix cache / all prompt blocks. The reference
is an unbounded cache over the same file: a request's leading hash ids seen in any earlier
request, capped like ``get_computed_blocks`` (at most ``(num_tokens - 1) // block_size`` full
blocks). Prints a table; the last line is one JSON object.

    python examples/replay_trace.py /path/to/conversation_trace.jsonl --limit 2000
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvbridge.connector.index import (
    BlockIndex,
    IndexNamespace,
    InMemoryBlockIndex,
    RedisBlockIndex,
    RedisClusterBlockIndex,
    new_incarnation,
)
from kvbridge.kvmanager import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
)

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids block length
VOCAB_SIZE = 32_000
NUM_NODES = 4
_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Parse a Mooncake-format trace; raises ValueError naming the bad line."""
    requests: list[TraceRequest] = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = TraceRequest(
                    float(obj["timestamp"]) / 1000.0,
                    int(obj["input_length"]),
                    int(obj["output_length"]),
                    tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a trace record ({exc})") from exc
            if req.input_length < 1 or not req.hash_ids:
                raise ValueError(f"{path}:{line_no}: empty prompt")
            requests.append(req)
    requests.sort(key=lambda r: r.arrival_s)  # stable: file order within one timestamp
    return requests


class TokenExpander:
    """hash id -> ``block_size`` token ids, deterministic (PRNG seeded by the id), memoised."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._id_to_tokens: dict[int, list[int]] = {}

    def num_tokens(self, req: TraceRequest) -> int:
        scaled = math.ceil(req.input_length * self.block_size / TRACE_BLOCK_TOKENS)
        return max(1, min(scaled, len(req.hash_ids) * self.block_size))

    def prompt(self, req: TraceRequest) -> list[int]:
        tokens: list[int] = []
        for hash_id in req.hash_ids:
            run = self._id_to_tokens.get(hash_id)
            if run is None:
                rng = random.Random(hash_id)
                run = [rng.randrange(VOCAB_SIZE) for _ in range(self.block_size)]
                self._id_to_tokens[hash_id] = run
            tokens.extend(run)
        return tokens[: self.num_tokens(req)]


def oracle_hit_blocks(requests: list[TraceRequest], expander: TokenExpander) -> list[int]:
    """Per request: prompt blocks an unbounded cache would serve (leading hash ids seen before,
    capped at ``(num_tokens - 1) // block_size`` as ``get_computed_blocks`` caps a hit)."""
    seen: set[int] = set()
    hits: list[int] = []
    for req in requests:
        k = 0
        while k < len(req.hash_ids) and req.hash_ids[k] in seen:
            k += 1
        hits.append(min(k, (expander.num_tokens(req) - 1) // expander.block_size))
        seen.update(req.hash_ids)
    return hits


@dataclass
class Node:
    node_id: str
    incarnation: int
    manager: KVCacheManager
    waiting: deque[tuple[int, Request]] = field(default_factory=deque)
    num_running: int = 0

    @property
    def load(self) -> int:
        return self.num_running + len(self.waiting)


@dataclass
class ReplayResult:
    policy: str
    hit_blocks: int = 0
    total_blocks: int = 0
    num_requests: int = 0
    num_dropped: int = 0  # larger than a whole pool
    total_wait_s: float = 0.0
    requests_per_node: list[int] = field(default_factory=lambda: [0] * NUM_NODES)

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


class Replay:
    """One replay of the trace under one routing policy."""

    def __init__(self, args: argparse.Namespace, index: BlockIndex, policy: str) -> None:
        self.args = args
        self.index = index
        self.policy = policy
        self.block_size: int = args.block_size
        spec = FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
        )
        config = KVCacheConfig(args.blocks_per_node + 1, [KVCacheGroupSpec(["layer.0"], spec)])
        self.nodes = []
        for i in range(NUM_NODES):
            node = Node(
                f"{policy}-node{i}",
                new_incarnation(),
                KVCacheManager(
                    config, args.max_model_len, enable_caching=True,
                    enable_kv_cache_events=True, hash_fn=args.hash_fn, log_stats=False,
                ),
            )
            index.register_node(node.node_id, node.incarnation, ttl_s=_TTL_S)
            self.nodes.append(node)
        self.hasher = self.nodes[0].manager.request_block_hasher
        self.result = ReplayResult(policy)
        self._done: list[tuple[float, int, int, Request]] = []  # (end_s, seq, node, request)
        self._arrival_s: dict[str, float] = {}
        self._trace: dict[str, TraceRequest] = {}
        self._seq = 0

    def _publish(self, node: Node) -> None:
        events = node.manager.take_events()
        if events:
            self.index.publish(node.node_id, node.incarnation, events)

    def _route(self, i: int, request: Request) -> int:
        if self.policy == "round_robin":
            return i % NUM_NODES
        hit = self.index.longest_prefix(request.block_hashes, all_holders=True)
        node_to_run = {h.node_id: h.num_blocks for h in hit.holders}
        runs = [node_to_run.get(node.node_id, 0) for node in self.nodes]
        least_loaded = min(range(NUM_NODES), key=lambda n: (self.nodes[n].load, n))
        if max(runs) - runs[least_loaded] < self.args.min_gain_blocks:
            return least_loaded
        # Longest prefix first, then lightest load, then node order.
        return min(range(NUM_NODES), key=lambda n: (-runs[n], self.nodes[n].load, n))

    def _admit(self, n: int, now_s: float) -> None:
        node = self.nodes[n]
        manager = node.manager
        while node.waiting:
            seq, request = node.waiting[0]
            blocks, num_hit_tokens = manager.get_computed_blocks(request)
            new_blocks = manager.allocate_slots(
                request, request.num_tokens - num_hit_tokens, num_hit_tokens, blocks
            )
            if new_blocks is None:
                if node.num_running == 0:  # larger than the whole pool: it can never run
                    node.waiting.popleft()
                    self.result.num_dropped += 1
                    continue
                break
            node.waiting.popleft()
            node.num_running += 1
            self.result.hit_blocks += num_hit_tokens // self.block_size
            trace = self._trace.pop(request.request_id)
            uncached = max(0, trace.input_length - num_hit_tokens * TRACE_BLOCK_TOKENS
                           // self.block_size)
            duration_s = (self.args.prefill_s_per_token * uncached
                           + self.args.decode_s_per_token * trace.output_length)
            self.result.total_wait_s += now_s - self._arrival_s.pop(request.request_id)
            heapq.heappush(self._done, (now_s + duration_s, seq, n, request))
        self._publish(node)

    def _finish_until(self, now_s: float) -> None:
        while self._done and self._done[0][0] <= now_s:
            end_s, _, n, request = heapq.heappop(self._done)
            node = self.nodes[n]
            node.manager.free(request)
            node.num_running -= 1
            self._admit(n, end_s)

    def run(self, requests: list[TraceRequest], expander: TokenExpander) -> ReplayResult:
        for i, trace in enumerate(requests):
            self._finish_until(trace.arrival_s)
            request = Request(str(i), expander.prompt(trace), block_hasher=self.hasher)
            self.result.num_requests += 1
            self.result.total_blocks += math.ceil(request.num_tokens / self.block_size)
            n = self._route(i, request)
            self.result.requests_per_node[n] += 1
            self._trace[request.request_id] = trace
            self._arrival_s[request.request_id] = trace.arrival_s
            self.nodes[n].waiting.append((i, request))
            self._admit(n, trace.arrival_s)
        self._finish_until(math.inf)
        for node in self.nodes:
            node.manager.check_integrity()
            if node.waiting or node.num_running:
                raise RuntimeError(
                    f"{node.node_id}: {len(node.waiting)} waiting, {node.num_running} running "
                    f"after the replay"
                )
        return self.result


def _open_index(url: str, namespace: IndexNamespace) -> BlockIndex:
    if url == "memory":
        return InMemoryBlockIndex(namespace)
    if url.startswith("redis-cluster://"):
        return RedisClusterBlockIndex(namespace, url, socket_timeout_s=2.0)
    return RedisBlockIndex(namespace, url, socket_timeout_s=2.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--blocks-per-node", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (512 -> N)")
    parser.add_argument("--min-gain-blocks", type=int, default=2,
                        help="prefix advantage over the least-loaded node worth routing for")
    parser.add_argument("--hash-fn", default="sha256_cbor")
    parser.add_argument("--index-url", default="memory", help="'memory', redis://host:port/db or redis-cluster://HOST:PORT[,...]")
    parser.add_argument("--prefill-s-per-token", type=float, default=1e-4)
    parser.add_argument("--decode-s-per-token", type=float, default=0.02)
    args = parser.parse_args(argv)
    if args.blocks_per_node < 1 or args.block_size < 1:
        parser.error("--blocks-per-node and --block-size must be positive")
    if not Path(args.trace).is_file():
        parser.error(f"trace file not found: {args.trace}")
    return args


def _rows(result: ReplayResult, oracle_ratio: float) -> Iterator[str]:
    fraction = result.hit_ratio / oracle_ratio if oracle_ratio else 0.0
    wait = result.total_wait_s / max(1, result.num_requests)
    yield (f"{result.policy:<14}{result.hit_ratio:>10.4f}{fraction:>12.3f}{wait:>12.3f}"
           f"{result.num_dropped:>9}   {result.requests_per_node}")


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    start = time.perf_counter()
    requests = read_trace(args.trace, args.limit)
    expander = TokenExpander(args.block_size)
    args.max_model_len = max(expander.num_tokens(r) for r in requests) + 1
    oracle_hits = oracle_hit_blocks(requests, expander)
    total_blocks = sum(math.ceil(expander.num_tokens(r) / args.block_size) for r in requests)
    oracle_ratio = sum(oracle_hits) / total_blocks
    namespace = IndexNamespace(
        model_name="replay", block_size=args.block_size, hash_fn_name=args.hash_fn
    )
    results = []
    for policy in ("index", "round_robin"):
        index = _open_index(args.index_url, namespace)
        results.append(Replay(args, index, policy).run(requests, expander))
        index.close()
    wall_s = time.perf_counter() - start

    print(f"trace {args.trace} : {len(requests)} requests, {total_blocks} prompt blocks "
          f"(block size {args.block_size}), {NUM_NODES} nodes x {args.blocks_per_node} blocks")
    print(f"unbounded-cache hit ratio (same file): {oracle_ratio:.4f}")
    print(f"{'policy':<14}{'hit ratio':>10}{'/ unbounded':>12}{'avg wait s':>12}"
          f"{'dropped':>9}   requests per node")
    for result in results:
        for row in _rows(result, oracle_ratio):
            print(row)
    summary: dict[str, object] = {
        "benchmark": "trace_replay",
        "trace": str(args.trace),
        "num_requests": len(requests),
        "num_nodes": NUM_NODES,
        "blocks_per_node": args.blocks_per_node,
        "block_size": args.block_size,
        "unbounded_hit_ratio": round(oracle_ratio, 4),
        "wall_s": round(wall_s, 2),
    }
    for result in results:
        summary[result.policy] = {
            "hit_ratio": round(result.hit_ratio, 4),
            "fraction_of_unbounded": round(result.hit_ratio / oracle_ratio, 4)
            if oracle_ratio else 0.0,
            "num_dropped": result.num_dropped,
            "avg_wait_s": round(result.total_wait_s / max(1, result.num_requests), 4),
            "requests_per_node": result.requests_per_node,
        }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
