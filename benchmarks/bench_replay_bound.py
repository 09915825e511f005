"""How much of the unbounded cache's hit ratio any cache of C blocks can reach on a trace.

Issue 14, part 4 asks ``kvbridge-replay``'s ``pull`` policy for 0.85 of the unbounded
cache on the Mooncake conversation trace with 4 nodes x 4,096 blocks. Pulling from any holder
makes the four pools act, at best, as one cache of 16,384 blocks (less: a pulled prefix is held
twice, and running requests pin theirs). This script asks whether 0.85 is reachable at all at
that size, whatever the placement and eviction, by replaying the trace's block-id streams (the
hash ids, which the replay expands into token blocks: ``kvbridge.connector.serve.replay``)
through one cache of ``C`` blocks in arrival order:

- ``lru``: least recently used eviction; a request touches its blocks last to first, so its
  first block is the most recently used (a vLLM request frees its blocks in reverse order, so
  the tail of a prefix is evicted before the head);
- ``belady``: Belady's offline-optimal rule (MIN): evict the cached block whose next use (the
  next request that contains it) is farthest in the future, ties the deeper block first;
- ``belady_any_block``: the same run counting every requested block found in the cache, not
  only a request's leading run up to the cap (a ceiling, see below);
- ``s3fifo``: the online, scan-resistant reference, S3-FIFO (Yang et al., "FIFO queues are all
  you need for cache eviction", SOSP 2023) as published: a small FIFO (10 % of ``C``) takes new
  blocks, a main FIFO the rest; each block has a frequency counter (0-3) bumped on a hit. A
  block leaving the small FIFO moves to the main FIFO if it was hit there, otherwise it is
  evicted and its id kept in a ghost FIFO (as many ids as the main FIFO holds blocks); a missed
  block whose id is in the ghost goes straight to the main FIFO. The main FIFO evicts from its
  tail, reinserting a block with a non-zero counter (decremented) instead: lazy promotion, no
  reordering on a hit. Requests touch their blocks last to first, as under ``lru``.
- ``reuse_bonus``: online; LRU on a shifted clock: a block's priority is its last use (the
  request's arrival, trace seconds) plus ``REUSE_BONUS_S`` (300 s) for each use after the
  first, counting at most ``REUSE_BONUS_MAX_USES`` (3) uses; lowest first, the deeper block
  first on ties. On the conversation trace a block used once comes back with probability 0.24,
  one used twice 0.42, three times 0.50: frequency is the one signal found worth having. It is
  the best of the simple online rules tried in scratch runs (bonuses of 60-600 s and 2-5 uses;
  also segmented LRU, and LHD, the hit-density policy of Beckmann et al., NSDI 2018, with
  classes by use count, last block of a request, turn, request length: 0.71-0.76 at 16,384).
  It flatters an online rule twice over: its two settings were chosen on the trace it is scored
  on, and it keeps a use count for every id ever seen (an unbounded history);
- ``oracle_admission``: offline; LRU that never keeps a block no later request holds. It knows
  whether a block comes back, not when, so the gap between ``lru`` and it is what predicting
  reuse is worth;

A request's hit is the leading run of its blocks found in the cache, capped like
``KVCacheManager.get_computed_blocks`` at ``(num_tokens - 1) // block_size`` blocks (the last
token's block is recomputed for its logits). After a request all its blocks are in the cache;
then blocks are evicted down to ``C`` (so an incoming block whose next use is the farthest goes
at once). With ``C`` above the number of distinct blocks both rules give exactly the unbounded
cache of ``replay_trace.py`` (``oracle_hit_blocks``: a request's leading hash ids seen in any
earlier request, same cap), the reference of every ratio printed.

Why ``belady_any_block`` is a ceiling for any policy of ``C`` blocks, including N pools that
pull from one another (their union holds at most ``C`` distinct blocks, each seen before): MIN
maximises the number of requested blocks found in a cache of ``C`` over all eviction choices
(Belady 1966, Mattson et al. 1970), and a policy's capped leading-run hits are a subset of its
block hits. ``belady`` itself is what MIN gives under the replay's hit rule. (The trace's ids are
prefix-chained, every id always has the same parent, so a block is needed no later than its
descendants and MIN, deeper blocks first on ties, keeps every cached block's prefix cached: its
block hits are leading runs, and the two differ only by the capped last blocks.)

Also printed, ``max_live_blocks``: the most blocks that are, between two requests, both seen
already and held by a later request. A cache of that many blocks that keeps exactly those serves
every hit of the unbounded cache, so MIN reaches it at any ``C`` from there on.

    python benchmarks/bench_replay_bound.py /path/to/conversation_trace.jsonl

Prints a table (hit ratio as a fraction of the unbounded cache per capacity); the last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from _report import add_markdown_option, finish
from kvbridge.connector.serve.replay import TokenExpander, TraceRequest, load_trace

DEFAULT_CAPACITIES = (4096, 16384, 65536)
REUSE_BONUS_S = 300.0
REUSE_BONUS_MAX_USES = 3
_NEVER = math.inf


class BlockRequest(NamedTuple):
    """One request's block ids in prompt order, the most blocks its hit may cover, and its
    arrival (trace seconds; only ``reuse_bonus`` reads it)."""

    block_ids: tuple[int, ...]
    max_hit_blocks: int
    arrival_s: float = 0.0


class CacheHits(NamedTuple):
    """Blocks served over the whole stream: ``leading`` under the replay's hit rule (leading
    run, capped), ``any_block`` every requested block found in the cache."""

    leading: int
    any_block: int


def block_requests(requests: Sequence[TraceRequest], expander: TokenExpander) -> list[BlockRequest]:
    """The trace's block-id streams with ``get_computed_blocks``'s cap at ``expander``'s block
    size: ``(num_tokens - 1) // block_size``, ``num_tokens`` as the replay cuts the prompt."""
    return [
        BlockRequest(
            r.hash_ids, (expander.num_tokens(r) - 1) // expander.block_size, r.arrival_s
        )
        for r in requests
    ]


def _leading_run(cached: dict[int, object] | OrderedDict[int, None], req: BlockRequest) -> int:
    k = 0
    while k < req.max_hit_blocks and k < len(req.block_ids) and req.block_ids[k] in cached:
        k += 1
    return k


def lru_hits(stream: Sequence[BlockRequest], capacity: int) -> CacheHits:
    """One LRU cache of ``capacity`` blocks; a request touches its blocks last to first."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    leading = any_block = 0
    for req in stream:
        leading += _leading_run(cache, req)
        any_block += sum(1 for b in req.block_ids if b in cache)
        for b in reversed(req.block_ids):
            cache[b] = None
            cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return CacheHits(leading, any_block)


def s3fifo_hits(stream: Sequence[BlockRequest], capacity: int) -> CacheHits:
    """One S3-FIFO cache of ``capacity`` blocks (module docstring): a small FIFO of
    ``max(1, round(capacity / 10))`` blocks, a main FIFO of the rest and a ghost FIFO of as
    many ids as the main FIFO's share. Evicting: from the small FIFO while it holds at least
    its share (or the main FIFO is empty), else from the main FIFO."""
    small_capacity = max(1, round(capacity / 10))
    main_capacity = capacity - small_capacity
    small: OrderedDict[int, None] = OrderedDict()  # oldest first, as each FIFO below
    main: OrderedDict[int, None] = OrderedDict()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}  # cached block -> its counter

    def evict_main() -> None:
        while main:
            b = next(iter(main))
            if freq[b]:  # lazy promotion: reinserted at the head, one count spent
                freq[b] -= 1
                main.move_to_end(b)
            else:
                del main[b], freq[b]
                return

    def evict_small() -> None:
        while small:
            b, _ = small.popitem(last=False)
            if freq[b]:  # hit while in the small FIFO: kept, in the main FIFO
                freq[b] = 0
                main[b] = None
                if len(main) > main_capacity:
                    evict_main()
            else:  # quick demotion: gone, its id remembered
                del freq[b]
                ghost[b] = None
                while len(ghost) > main_capacity:
                    ghost.popitem(last=False)
                return
        evict_main()  # every small block moved to main: one of main's goes instead

    leading = any_block = 0
    for req in stream:
        leading += _leading_run(freq, req)
        any_block += sum(1 for b in req.block_ids if b in freq)
        for b in reversed(req.block_ids):
            if b in freq:
                freq[b] = min(freq[b] + 1, 3)
            elif b in ghost:
                del ghost[b]
                freq[b] = 0
                main[b] = None
            else:
                freq[b] = 0
                small[b] = None
        while len(freq) > capacity:
            if len(small) >= small_capacity or not main:
                evict_small()
            else:
                evict_main()
    return CacheHits(leading, any_block)


def reuse_bonus_hits(
    stream: Sequence[BlockRequest], capacity: int, *, bonus_s: float = REUSE_BONUS_S,
    max_uses: int = REUSE_BONUS_MAX_USES,
) -> CacheHits:
    """One cache of ``capacity`` blocks evicting the lowest ``last use (arrival_s) + bonus_s *
    (min(uses, max_uses) - 1)`` first, the deeper block first on ties: LRU in which a block
    used k times counts as used ``bonus_s * (k - 1)`` seconds later (online; the best of the
    simple online rules tried on the conversation trace, module docstring)."""
    cache: dict[int, tuple[float, int]] = {}  # block id -> (priority, its heap entry's seq)
    uses: dict[int, int] = {}  # every id seen, cached or not
    heap: list[tuple[float, int, int, int]] = []  # (priority, -position, seq, id)
    leading = any_block = seq = 0
    for req in stream:
        leading += _leading_run(cache, req)
        any_block += sum(1 for b in req.block_ids if b in cache)
        for j, b in enumerate(req.block_ids):
            uses[b] = uses.get(b, 0) + 1
            priority = req.arrival_s + bonus_s * (min(uses[b], max_uses) - 1)
            seq += 1
            cache[b] = (priority, seq)
            heapq.heappush(heap, (priority, -j, seq, b))
        while len(cache) > capacity:
            _, _, entry_seq, b = heapq.heappop(heap)
            if cache.get(b, (0.0, -1))[1] == entry_seq:  # else stale: the block was used since
                del cache[b]
        if len(heap) > 4 * max(capacity, 1024):
            heap = [e for e in heap if cache.get(e[3], (0.0, -1))[1] == e[2]]
            heapq.heapify(heap)
    return CacheHits(leading, any_block)


def oracle_admission_hits(stream: Sequence[BlockRequest], capacity: int) -> CacheHits:
    """LRU that never keeps a block no later request holds (offline: it knows *whether* a
    block comes back, not when). The gap between LRU and this is what predicting reuse is
    worth."""
    next_use = _next_uses(stream)
    cache: OrderedDict[int, None] = OrderedDict()
    leading = any_block = 0
    for r, req in enumerate(stream):
        leading += _leading_run(cache, req)
        any_block += sum(1 for b in req.block_ids if b in cache)
        for j in range(len(req.block_ids) - 1, -1, -1):
            b = req.block_ids[j]
            if next_use[r][j] == _NEVER:
                cache.pop(b, None)
            else:
                cache[b] = None
                cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return CacheHits(leading, any_block)


def _next_uses(stream: Sequence[BlockRequest]) -> list[list[float]]:
    """``next_use[r][j]``: the index of the next request after ``r`` that holds block
    ``stream[r].block_ids[j]`` (``inf``: none)."""
    id_to_next: dict[int, float] = {}
    next_use: list[list[float]] = [[] for _ in stream]
    for r in range(len(stream) - 1, -1, -1):
        ids = stream[r].block_ids
        next_use[r] = [id_to_next.get(b, _NEVER) for b in ids]
        for b in ids:
            id_to_next[b] = r
    return next_use


def belady_hits(stream: Sequence[BlockRequest], capacity: int) -> CacheHits:
    """One cache of ``capacity`` blocks under Belady's MIN (farthest next use evicted first,
    the deeper block first on ties); the request's own blocks are candidates too."""
    next_use = _next_uses(stream)
    cache: dict[int, float] = {}  # block id -> its next use
    # (-next use, -position, id): the heap's smallest is the farthest next use, then the
    # deepest; an entry whose next use no longer matches ``cache`` is stale and skipped.
    heap: list[tuple[float, int, int]] = []
    leading = any_block = 0
    for r, req in enumerate(stream):
        leading += _leading_run(cache, req)
        any_block += sum(1 for b in req.block_ids if b in cache)
        for j, b in enumerate(req.block_ids):
            cache[b] = next_use[r][j]
            heapq.heappush(heap, (-next_use[r][j], -j, b))
        while len(cache) > capacity:
            neg_next, _, b = heapq.heappop(heap)
            if cache.get(b) == -neg_next:
                del cache[b]
        if len(heap) > 4 * max(capacity, 1024):  # drop stale entries now and then
            heap = [e for e in heap if cache.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    return CacheHits(leading, any_block)


def max_live_blocks(stream: Sequence[BlockRequest]) -> int:
    """The largest number of blocks that, just after some request, were seen at or before it
    and are held by a later request."""
    first_seen: dict[int, int] = {}
    last_seen: dict[int, int] = {}
    for r, req in enumerate(stream):
        for b in req.block_ids:
            first_seen.setdefault(b, r)
            last_seen[b] = r
    delta = [0] * (len(stream) + 1)  # live from just after first_seen to just before last_seen
    for b, first in first_seen.items():
        if last_seen[b] > first:
            delta[first] += 1
            delta[last_seen[b]] -= 1
    live = most = 0
    for d in delta:
        live += d
        most = max(most, live)
    return most


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--limit", type=int, default=None, help="the first N requests")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (512 -> N)")
    parser.add_argument("--capacities", default=",".join(map(str, DEFAULT_CAPACITIES)),
                        help="comma-separated cache sizes in blocks")
    add_markdown_option(parser)
    args = parser.parse_args(argv)
    args.capacities = [int(c) for c in args.capacities.split(",") if c.strip()]
    if not args.capacities or min(args.capacities) < 1 or args.block_size < 1:
        parser.error("--capacities and --block-size must be positive")
    if not args.trace.is_file():
        parser.error(f"trace file not found: {args.trace}")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    start = time.perf_counter()
    requests, expander, oracle_hits, total_blocks = load_trace(
        args.trace, args.limit, args.block_size)
    stream = block_requests(requests, expander)
    oracle = sum(oracle_hits)
    print(f"trace {args.trace}: {len(requests)} requests, {total_blocks} prompt blocks, "
          f"{len({b for req in stream for b in req.block_ids})} distinct block ids "
          f"(block size {args.block_size})")
    num_live = max_live_blocks(stream)
    print(f"unbounded cache: {oracle} hit blocks, hit ratio {oracle / total_blocks:.4f}; "
          f"at most {num_live} blocks seen and needed again at once (max_live_blocks)")
    print(f"{'capacity':>9}{'lru':>8}{'s3fifo':>8}{'reuse_bonus':>13}{'oracle_admission':>18}"
          f"{'belady':>8}{'belady_any_block':>18}   (/ unbounded)")
    rows = []
    for capacity in args.capacities:
        lru = lru_hits(stream, capacity)
        s3fifo = s3fifo_hits(stream, capacity)
        bonus = reuse_bonus_hits(stream, capacity)
        admission = oracle_admission_hits(stream, capacity)
        belady = belady_hits(stream, capacity)
        rows.append({
            "capacity_blocks": capacity,
            "lru": round(lru.leading / oracle, 4) if oracle else 0.0,
            "s3fifo": round(s3fifo.leading / oracle, 4) if oracle else 0.0,
            "reuse_bonus": round(bonus.leading / oracle, 4) if oracle else 0.0,
            "oracle_admission": round(admission.leading / oracle, 4) if oracle else 0.0,
            "belady": round(belady.leading / oracle, 4) if oracle else 0.0,
            "belady_any_block": round(belady.any_block / oracle, 4) if oracle else 0.0,
            "lru_hit_ratio": round(lru.leading / total_blocks, 4),
            "s3fifo_hit_ratio": round(s3fifo.leading / total_blocks, 4),
            "belady_hit_ratio": round(belady.leading / total_blocks, 4),
        })
        r = rows[-1]
        print(f"{capacity:>9}{r['lru']:>8.3f}{r['s3fifo']:>8.3f}{r['reuse_bonus']:>13.3f}"
              f"{r['oracle_admission']:>18.3f}{r['belady']:>8.3f}{r['belady_any_block']:>18.3f}")
    summary: dict[str, object] = {
        "benchmark": "replay_bound",
        "trace": str(args.trace),
        "num_requests": len(requests),
        "block_size": args.block_size,
        "unbounded_hit_ratio": round(oracle / total_blocks, 4) if total_blocks else 0.0,
        "max_live_blocks": num_live,
        "capacities": rows,
        "wall_s": round(time.perf_counter() - start, 2),
    }
    finish(summary, name="replay_bound", title="Trace replay: the bound of any C-block cache",
           markdown=args.markdown)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
