"""Replay a Mooncake-format request trace through N nodes' KV control planes (no model).

Issues 6 and 14. Each of ``--nodes`` nodes (default 4) is a ``kvbridge.kvmanager.KVCacheManager``
with a finite pool (``--blocks-per-node``) and KV events on; every node's events feed one block
index (``--index-url``: ``memory`` or a ``redis://`` URL). The trace is replayed once per policy
(``--policies``, default all three):

- ``index``: each request goes to the node holding its longest prefix according to the index,
  ties broken by load (running + waiting requests); a prefix that beats the least-loaded node's
  by fewer than ``--min-gain-blocks`` blocks counts as a tie (like the connector's minimum gain:
  otherwise a system prompt shared by every request pins all traffic to the first node);
- ``round_robin``: request i goes to node i mod N;
- ``pull``: each request asks the index once, at arrival, for the deepest run of its prompt held
  anywhere (capped like ``get_computed_blocks``: never the last token's block) and goes to the
  least-loaded node (among equally loaded ones, one the answer names as a holder of that run,
  then node order: prefix affinity, which KV-aware routers such as Dynamo's weigh against load,
  here only breaks ties). The answer travels with the request: when the node admits it at
  arrival, that same answer names the holder to pull from; when the run beats the node's own
  prefix hit by at least ``--min-pull-blocks`` blocks the prefix is pulled from the holder
  (counted as a hit, its blocks taken as external computed tokens, so they become cached on the
  puller and are published to the index like after a real pull). A request that had to wait
  (admitted after other nodes may have published) asks again at admission, counted as
  ``num_relookups``. The holder's pool is checked for the blocks (a stale index entry would make
  a shorter pull; counted as ``num_stale_hits``) and, like a real holder serving a read through
  the index, its blocks are neither referenced nor touched. ``--store-blocks N`` adds a store
  tier (``replay_store.py``): a store node of N blocks to which each node writes the cached
  blocks it evicts (remembering its last ``--store-remember-blocks`` writes, default N / nodes,
  as held), listed in the index as tier ``store`` and pulled from like a node (a node
  holding as deep a run is preferred); ``index`` and ``round_robin`` never pull and ignore it.

Every ``longest_prefix`` call is timed: ``index`` and ``pull`` make one a request (none for a
one-block prompt under ``pull``) plus, under ``pull``, the re-lookups of requests that waited.
With a Redis index every fourth lookup is followed by a timed PING on a connection of its own,
the baseline (``lookup_vs_ping``) measured over the same minutes as the lookups, so the cost per
lookup compares across node counts on a busy machine.

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

    kvbridge-replay /path/to/conversation_trace.jsonl --limit 2000
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch
from kvbridge.connector.index import (
    BlockIndex,
    IndexNamespace,
    InMemoryBlockIndex,
    PrefixHit,
    RedisBlockIndex,
    RedisClusterBlockIndex,
    cluster_client,
    new_incarnation,
)
from kvbridge.kvmanager import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
)
from kvbridge.transport import BlockIdentity
from redis.cluster import RedisCluster

from ..cli import CommandParser
from .input import (
    TRACE_BLOCK_TOKENS,
    TokenExpander,
    TraceRequest,
    load_trace,
    oracle_hit_blocks,  # noqa: F401 - the replay's trace API, used from here by its tests
    read_trace,  # noqa: F401
)
from .report import ReplayResult, row, store_row, summary_of
from .store import ReplayStore

POLICIES = ("index", "round_robin", "pull")
_TTL_S = 3600.0
_PING_EVERY = 4  # lookups per baseline PING


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


class Replay:
    """One replay of the trace under one routing policy."""

    def __init__(
        self, args: argparse.Namespace, index: BlockIndex, policy: str,
        ping_client: redis.Redis | RedisCluster | None = None,
    ) -> None:
        self.args = args
        self.index = index
        self.ping_client = ping_client
        self.policy = policy
        self.block_size: int = args.block_size
        spec = FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
        )
        config = KVCacheConfig(args.blocks_per_node + 1, [KVCacheGroupSpec(["layer.0"], spec)])
        self.num_nodes: int = args.nodes
        self.nodes = []
        for i in range(self.num_nodes):
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
        self.node_id_to_index = {node.node_id: i for i, node in enumerate(self.nodes)}
        self.hasher = self.nodes[0].manager.request_block_hasher
        self.store: ReplayStore | None = None
        if policy == "pull" and args.store_blocks:
            self.store = ReplayStore(index, f"{policy}-store", num_store_blocks=args.store_blocks,
                                     block_size=self.block_size, ttl_s=_TTL_S,
                                     num_remembered=args.store_remember_blocks)
        self.result = ReplayResult(policy, self.num_nodes)
        if self.store is not None:
            self.result = ReplayResult(policy, self.num_nodes, store_label=self.store.node_id,
                                       num_store_blocks=args.store_blocks)
        self._done: list[tuple[float, int, int, Request]] = []  # (end_s, seq, node, request)
        self._arrival_s: dict[str, float] = {}
        self._trace: dict[str, TraceRequest] = {}
        # pull: the routing lookup's answer, valid until the admission right after routing.
        self._routed_hit: dict[str, PrefixHit] = {}
        self._seq = 0

    def _publish(self, node: Node) -> None:
        events = node.manager.take_events()
        if events:
            if self.store is not None:  # evicted blocks reach the store before the removals
                self.store.offload(node.node_id, node.manager.block_pool, events)
            self.index.publish(node.node_id, node.incarnation, events)

    def _lookup(self, block_hashes: list[bytes], *, all_holders: bool) -> PrefixHit:
        start = time.perf_counter()
        hit = self.index.longest_prefix(block_hashes, all_holders=all_holders)
        result = self.result
        result.lookup_s += time.perf_counter() - start
        result.num_lookups += 1
        result.num_lookup_hashes += len(block_hashes)
        if self.ping_client is not None and result.num_lookups % _PING_EVERY == 1:
            start = time.perf_counter()
            self.ping_client.ping()
            result.ping_s += time.perf_counter() - start
            result.num_pings += 1
        return hit

    def _route(self, i: int, request: Request) -> int:
        if self.policy == "round_robin":
            return i % self.num_nodes
        if self.policy == "pull":
            n, hit = self._least_loaded_with_affinity(request)
            if hit is not None:  # the pull's answer too, if admitted at once (_pull_plan)
                self._routed_hit[request.request_id] = hit
            return n
        nodes = range(self.num_nodes)
        least_loaded = min(nodes, key=lambda n: (self.nodes[n].load, n))
        hit = self._lookup(request.block_hashes, all_holders=True)
        node_to_run = {h.node_id: h.num_blocks for h in hit.holders}
        runs = [node_to_run.get(node.node_id, 0) for node in self.nodes]
        if max(runs) - runs[least_loaded] < self.args.min_gain_blocks:
            return least_loaded
        # Longest prefix first, then lightest load, then node order.
        return min(nodes, key=lambda n: (-runs[n], self.nodes[n].load, n))

    def _least_loaded_with_affinity(self, request: Request) -> tuple[int, PrefixHit | None]:
        """(node, the index's answer): the least-loaded node; among several equally loaded, one
        that holds the request's deepest prefix, then node order. The answer is the index's
        deepest-run lookup over the blocks ``get_computed_blocks`` could hit (a bounded answer,
        whatever the number of nodes), made for every request with such a block (None for a
        one-block prompt), since ``_pull_plan`` asks the same question. Without the tie-break a
        conversation's next turn lands on the first idle node and pulls its prefix there,
        leaving a second copy on the holder (a holder serving a pull does not touch its
        blocks) that takes capacity until it ages out."""
        least_load = min(node.load for node in self.nodes)
        candidates = [n for n, node in enumerate(self.nodes) if node.load == least_load]
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return candidates[0], None
        hit = self._lookup(request.block_hashes[:max_blocks], all_holders=False)
        deepest = {h.node_id for h in hit.holders}
        return min(candidates, key=lambda n: (self.nodes[n].node_id not in deepest, n)), hit

    def _pull_plan(self, n: int, request: Request, num_hit_tokens: int) -> tuple[int, int]:
        """(holder node, ``num_nodes`` for the store; blocks it serves) of the longest prefix
        held elsewhere that beats node ``n``'s own ``num_hit_tokens`` by ``--min-pull-blocks``;
        (-1, 0) when none does. Like the connector, never the last token's block. The
        routing lookup's answer when the request is admitted right after routing (the same
        query over the same index state); a new lookup, counted in ``num_relookups``, when it
        waited."""
        routed_hit = self._routed_hit.pop(request.request_id, None)
        num_local_blocks = num_hit_tokens // self.block_size
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks - num_local_blocks < self.args.min_pull_blocks:
            return -1, 0
        hashes = request.block_hashes[:max_blocks]
        hit = routed_hit
        if hit is None:
            hit = self._lookup(hashes, all_holders=False)
            self.result.num_relookups += 1
        if not hit.holders or hit.num_blocks - num_local_blocks < self.args.min_pull_blocks:
            return -1, 0
        holder = min(hit.holders, key=lambda h: h.tier == "store")  # a node before the store
        # What the holder really has: a pull of an evicted block would be a load error.
        if self.store is not None and holder.node_id == self.store.node_id:
            h, num_held = self.num_nodes, self.store.held_prefix(hashes, hit.num_blocks)
        else:
            h = self.node_id_to_index[holder.node_id]
            pool = self.nodes[h].manager.block_pool
            num_held = len(pool.get_cached_prefix(hashes, (0,), hit.num_blocks)[0])
        if num_held < hit.num_blocks:
            self.result.num_stale_hits += 1
        if num_held - num_local_blocks < self.args.min_pull_blocks:
            return -1, 0
        return h, num_held

    def _admit(self, n: int, now_s: float) -> None:
        node = self.nodes[n]
        manager = node.manager
        while node.waiting:
            seq, request = node.waiting[0]
            blocks, num_hit_tokens = manager.get_computed_blocks(request)
            holder, num_pulled_blocks = (
                self._pull_plan(n, request, num_hit_tokens) if self.policy == "pull" else (-1, 0)
            )
            # Pulled blocks are external computed tokens (allocated here, then cached and
            # published at once: the simulated pull lands within the step).
            num_external = max(0, num_pulled_blocks * self.block_size - num_hit_tokens)
            new_blocks = manager.allocate_slots(
                request, request.num_tokens - num_hit_tokens - num_external, num_hit_tokens,
                blocks, num_external_computed_tokens=num_external,
            )
            if new_blocks is None:
                if node.num_running == 0:  # larger than the whole pool: it can never run
                    node.waiting.popleft()
                    self.result.num_dropped += 1
                    continue
                break
            node.waiting.popleft()
            node.num_running += 1
            if num_external:
                self.result.num_pulls += 1
                self.result.num_pulled_blocks += num_external // self.block_size
                self.result.pulls_per_holder[holder] += 1
                if holder == self.num_nodes:  # the store serves the blocks past the local hit
                    self._read_store(request, num_hit_tokens, num_pulled_blocks)
            num_computed = num_hit_tokens + num_external
            self.result.hit_blocks += num_computed // self.block_size
            trace = self._trace.pop(request.request_id)
            uncached = max(0, trace.input_length - num_computed * TRACE_BLOCK_TOKENS
                           // self.block_size)
            duration_s = (self.args.prefill_s_per_token * uncached
                           + self.args.decode_s_per_token * trace.output_length)
            self.result.total_wait_s += now_s - self._arrival_s.pop(request.request_id)
            heapq.heappush(self._done, (now_s + duration_s, seq, n, request))
        self._publish(node)

    def _read_store(self, request: Request, num_hit_tokens: int, num_pulled_blocks: int) -> None:
        """A pull from the store reads the blocks past the puller's own hit (touching them)."""
        first = num_hit_tokens // self.block_size
        self.store.read(request.block_hashes[first:num_pulled_blocks])  # type: ignore[union-attr]
        self.result.num_store_pulls += 1
        self.result.num_store_pulled_blocks += num_pulled_blocks - first

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
            # Still waiting: other nodes publish before it is admitted, so it asks again then.
            self._routed_hit.pop(request.request_id, None)
        self._finish_until(math.inf)
        for node in self.nodes:
            node.manager.check_integrity()
            if node.waiting or node.num_running:
                raise RuntimeError(
                    f"{node.node_id}: {len(node.waiting)} waiting, {node.num_running} running "
                    f"after the replay"
                )
        if self.store is not None:
            self.store.check_integrity()
            self.store.report_to(self.result)
        return self.result


def _open_index(url: str, namespace: IndexNamespace) -> BlockIndex:
    if url == "memory":
        return InMemoryBlockIndex(namespace)
    if url.startswith("redis-cluster://"):
        return RedisClusterBlockIndex(namespace, url, socket_timeout_s=2.0)
    return RedisBlockIndex(namespace, url, socket_timeout_s=2.0)


def _ping_client(url: str) -> redis.Redis | RedisCluster | None:
    """A client whose PING is the lookups' baseline: the server, or one node of a cluster."""
    if url.startswith("redis-cluster://"):
        return cluster_client(url, socket_timeout_s=2.0, connect_timeout_s=2.0)
    return None if url == "memory" else redis.Redis.from_url(url)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="kvbridge-replay", description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--blocks-per-node", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (512 -> N)")
    parser.add_argument("--min-gain-blocks", type=int, default=2,
                        help="index: prefix advantage over the least-loaded node worth routing for")
    parser.add_argument("--min-pull-blocks", type=int, default=1,
                        help="pull: blocks a remote prefix must beat the local hit by "
                             "(the connector's min_remote_hit_blocks)")
    parser.add_argument("--store-blocks", type=int, default=0,
                        help="pull: a store tier of N blocks that nodes write evicted blocks to "
                             "(0: none; index and round_robin ignore it)")
    parser.add_argument("--store-remember-blocks", type=int, default=None,
                        help="with --store-blocks: each node's writes remembered as held, not "
                             "written again (offload_remember_blocks; default: store / nodes)")
    parser.add_argument("--hash-fn", default="sha256_cbor")
    parser.add_argument("--index-url", default="memory", help="'memory', redis://host:port/db or redis-cluster://HOST:PORT[,...]")
    parser.add_argument("--prefill-s-per-token", type=float, default=1e-4)
    parser.add_argument("--decode-s-per-token", type=float, default=0.02)
    args = parser.parse_args(argv)
    if min(args.blocks_per_node, args.block_size, args.nodes, args.min_pull_blocks) < 1:
        parser.error("--blocks-per-node, --block-size, --nodes and --min-pull-blocks must be "
                     "positive")
    remember = args.store_remember_blocks
    if args.store_blocks < 0 or (remember is not None and remember < 1):
        parser.error("--store-blocks must be >= 0, --store-remember-blocks >= 1")
    if remember is None:
        args.store_remember_blocks = max(1, args.store_blocks // args.nodes)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown or not args.policies:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    if not Path(args.trace).is_file():
        parser.error(f"trace file not found: {args.trace}")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    start = time.perf_counter()
    requests, expander, oracle_hits, total_blocks = load_trace(
        args.trace, args.limit, args.block_size)
    args.max_model_len = max(expander.num_tokens(r) for r in requests) + 1
    oracle_ratio = sum(oracle_hits) / total_blocks
    run_tag = new_incarnation()  # a namespace per run and policy: no other run's entries
    ping_client = _ping_client(args.index_url)
    results = []
    namespaces: dict[str, dict[str, object]] = {}
    for policy in args.policies:
        namespace = IndexNamespace(identity=BlockIdentity(  # kv_cache_dtype: Replay's spec's
            model_name=f"replay-{run_tag}-{policy}", kv_cache_dtype="float16",
            block_size=args.block_size, hash_fn_name=args.hash_fn))
        namespaces[policy] = dict(namespace.identity.as_items())
        index = _open_index(args.index_url, namespace)
        results.append(Replay(args, index, policy, ping_client).run(requests, expander))
        index.close()
    if ping_client is not None:
        ping_client.close()
    wall_s = time.perf_counter() - start

    print(f"trace {args.trace} : {len(requests)} requests, {total_blocks} prompt blocks "
          f"(block size {args.block_size}), {args.nodes} nodes x {args.blocks_per_node} blocks")
    print(f"unbounded-cache hit ratio (same file): {oracle_ratio:.4f}")
    print(f"{'policy':<12}{'hit ratio':>10}{'/ unbounded':>12}{'pulled/req':>12}"
          f"{'lookups/req':>13}{'lookup us':>11}{'/ PING':>8}{'avg wait':>10}{'dropped':>8}"
          f"   requests per node")
    for result in results:
        print(row(result, oracle_ratio) + store_row(result))
    summary: dict[str, object] = {
        "benchmark": "trace_replay",
        "trace": str(args.trace),
        "num_requests": len(requests),
        "num_nodes": args.nodes,
        "blocks_per_node": args.blocks_per_node,
        **({"store_blocks": args.store_blocks} if args.store_blocks else {}),
        "block_size": args.block_size,
        "index_url": args.index_url.partition("://")[0] or "memory",
        "index_namespaces": namespaces,  # each policy's BlockIdentity fields in the index
        "unbounded_hit_ratio": round(oracle_ratio, 4),
        "wall_s": round(wall_s, 2),
    }
    for result in results:
        summary[result.policy] = summary_of(result, oracle_ratio)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
