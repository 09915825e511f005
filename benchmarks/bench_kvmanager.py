"""Benchmark of the kvmanager hot paths against vLLM 0.33.0's own code, in one run.

A benchmark, not a test (run: ``make bench`` or ``python benchmarks/bench_kvmanager.py``).
Measures, on a pool of 100,000 blocks with prefix caching on:

* allocate+free of 10, 100 and 1,000 blocks (``get_new_blocks`` then ``free_blocks``), in blocks
  per second, for our ``BlockPool``, for vLLM 0.33.0's ``vllm.v1.core.block_pool.BlockPool`` and
  for a ``collections.deque`` popleft/append floor of the same counts;
* a prefix-hit lookup (``get_computed_blocks``) for a 2,000-block prompt whose blocks are cached;
* request block hashing in ns per token at block size 16 (a 64 Ki-token prompt), for each of our
  hash functions and for vLLM's request block hasher with its default ``prefix_caching_hash_algo``
  (``"sha256"``: sha256 over pickle, ``vllm.utils.hashing.sha256``) and with ``"sha256_cbor"``.

Every figure is the median of ``--repeats`` repetitions; within a repetition the contenders run
one after another in a rotating order, so drift on a shared machine hits all of them alike.

Where vLLM comes from: it is never installed and never copied into this repository;
``_vllm_wheel`` downloads its wheel into a cache folder outside the repository and imports its
block pool and hashing modules from there (``--fetch-vllm``, ``--vllm-dir``). Without the vLLM
code (no network, no wheel) the vLLM figures are null and the JSON says why.

Prints a table, then ONE JSON line, last.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _report import add_markdown_option, finish
from _vllm_wheel import DEFAULT_CACHE_DIR, VLLM_VERSION, resolve_vllm
from kvbridge.kvmanager import (
    BlockPool,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    get_request_block_hasher,
)

NUM_POOL_BLOCKS = 100_000
BLOCK_SIZE = 16
ALLOC_SIZES = (10, 100, 1_000)
ALLOC_BLOCKS_PER_REPEAT = 200_000  # blocks allocated and freed per timed repetition
HIT_PROMPT_BLOCKS = 2_000
HASH_TOKENS = 64 * 1024
HASH_PROMPTS_PER_REPEAT = 4
DEFAULT_REPEATS = 7


# -- timing ---------------------------------------------------------------------------------------
def _median_rates(runners: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Median items/second of each runner (which returns the items it did) over ``repeats``
    repetitions; one warm-up call each first; the order rotates every repetition."""
    for run in runners.values():
        run()
    names = list(runners)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            items = runners[name]()
            rates[name].append(items / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


# -- measurements ---------------------------------------------------------------------------------
def bench_alloc_free(
    num_blocks: int, repeats: int, vllm: dict[str, Any] | None
) -> dict[str, float]:
    """Median blocks/s of allocate+free of ``num_blocks`` for our pool, vLLM's and a deque."""
    cycles = max(1, ALLOC_BLOCKS_PER_REPEAT // num_blocks)

    def pool_runner(pool: Any) -> Callable[[], int]:
        def run() -> int:
            get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
            for _ in range(cycles):
                free_blocks(get_new_blocks(num_blocks))
            return cycles * num_blocks
        return run

    queue = deque(range(1, NUM_POOL_BLOCKS))

    def deque_cycles() -> int:
        popleft, append = queue.popleft, queue.append
        for _ in range(cycles):
            taken = [popleft() for _ in range(num_blocks)]
            for block_id in taken:
                append(block_id)
        return cycles * num_blocks

    runners = {"pool": pool_runner(BlockPool(NUM_POOL_BLOCKS, enable_caching=True)),
               "deque": deque_cycles}
    if vllm is not None:
        runners["vllm"] = pool_runner(vllm["block_pool"].BlockPool(
            NUM_POOL_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE))
    return _median_rates(runners, repeats)


def bench_cache_evict(
    num_blocks: int, repeats: int, vllm: dict[str, Any] | None
) -> dict[str, float]:
    """Median blocks/s of allocate + ``cache_full_blocks`` + free of ``num_blocks``, where every
    allocated block still carries a hash from an earlier round and is evicted first.

    Prompts are distinct and rotate, more blocks than the pool between two uses of one prompt,
    so each key has one block and each allocation evicts (hashing is done beforehand).
    """
    num_prompts = NUM_POOL_BLOCKS // num_blocks + 1
    cycles = max(1, ALLOC_BLOCKS_PER_REPEAT // num_blocks)
    num_tokens = num_blocks * BLOCK_SIZE
    prompts = [[p * num_tokens + i for i in range(num_tokens)] for p in range(num_prompts)]
    pool = BlockPool(NUM_POOL_BLOCKS, enable_caching=True)
    hasher = get_request_block_hasher(BLOCK_SIZE)
    ours = [Request(f"r{p}", tokens, block_hasher=hasher) for p, tokens in enumerate(prompts)]
    position = {"pool": 0, "vllm": 0}

    def pool_cycles() -> int:
        i = position["pool"]
        for _ in range(cycles):
            request = ours[i % num_prompts]
            blocks = pool.get_new_blocks(num_blocks)
            pool.cache_full_blocks(request, blocks, request.block_hashes, 0, num_blocks,
                                   BLOCK_SIZE, 0)
            pool.free_blocks(blocks)
            i += 1
        position["pool"] = i
        return cycles * num_blocks

    runners = {"pool": pool_cycles}
    if vllm is not None:
        utils, hashing = vllm["kv_cache_utils"], vllm["hashing"]
        utils.init_none_hash(hashing.sha256)
        vllm_pool = vllm["block_pool"].BlockPool(NUM_POOL_BLOCKS, enable_caching=True,
                                                 hash_block_size=BLOCK_SIZE)
        vllm_hasher = utils.get_request_block_hasher(BLOCK_SIZE, hashing.sha256)
        params = vllm["SamplingParams"](max_tokens=1)
        theirs = [vllm["request"].Request(f"r{p}", tokens, params, None,
                                          block_hasher=vllm_hasher)
                  for p, tokens in enumerate(prompts)]

        def vllm_cycles() -> int:
            i = position["vllm"]
            for _ in range(cycles):
                blocks = vllm_pool.get_new_blocks(num_blocks)
                vllm_pool.cache_full_blocks(theirs[i % num_prompts], blocks, 0, num_blocks,
                                            BLOCK_SIZE, 0)
                vllm_pool.free_blocks(blocks)
                i += 1
            position["vllm"] = i
            return cycles * num_blocks

        runners["vllm"] = vllm_cycles
    # Fill every block with a hash first, so the timed rounds all evict.
    for run in runners.values():
        for _ in range(NUM_POOL_BLOCKS // (cycles * num_blocks) + 1):
            run()
    if len(pool.cached_block_hash_to_block) != NUM_POOL_BLOCKS - 1:
        raise RuntimeError(f"{len(pool.cached_block_hash_to_block)} cached blocks after the "
                           f"fill, expected {NUM_POOL_BLOCKS - 1}")
    if vllm is not None and len(vllm_pool.cached_block_hash_to_block) != NUM_POOL_BLOCKS - 1:
        raise RuntimeError(f"vLLM: {len(vllm_pool.cached_block_hash_to_block)} cached blocks "
                           f"after the fill, expected {NUM_POOL_BLOCKS - 1}")
    return _median_rates(runners, repeats)


def bench_prefix_hit(repeats: int) -> float:
    """Median seconds per ``get_computed_blocks`` of a 2,000-block prompt, all blocks cached."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128,
                             dtype=torch.bfloat16)
    config = KVCacheConfig(NUM_POOL_BLOCKS, [KVCacheGroupSpec(["layer"], spec)])
    num_tokens = HIT_PROMPT_BLOCKS * BLOCK_SIZE + 1
    manager = KVCacheManager(config, num_tokens + 16, log_stats=False)
    tokens = list(range(num_tokens))
    owner = Request("owner", tokens, block_hasher=manager.request_block_hasher)
    if manager.allocate_slots(owner, num_tokens) is None:
        raise RuntimeError("benchmark pool too small for the prompt")
    manager.free(owner)
    probe = Request("probe", tokens, block_hasher=manager.request_block_hasher)
    hit = manager.get_computed_blocks(probe)[1]
    if hit != HIT_PROMPT_BLOCKS * BLOCK_SIZE:
        raise RuntimeError(f"expected a full hit, got {hit} tokens")

    def lookups() -> int:
        for _ in range(20):
            manager.get_computed_blocks(probe)
        return 20

    return 1.0 / _median_rates({"hit": lookups}, repeats)["hit"]


def bench_hashing(repeats: int, vllm: dict[str, Any] | None) -> dict[str, float]:
    """Median ns per token of the request block hasher over a 64 Ki-token prompt (block size 16):
    the hasher alone, called on a request with no hashes yet, for both sides."""
    tokens = [(i * 7919) % 150_000 for i in range(HASH_TOKENS)]  # a 150k vocabulary's ids
    runners: dict[str, Callable[[], int]] = {}

    def runner(hasher: Callable[[Any], list[bytes]], request: Any) -> Callable[[], int]:
        expected = HASH_TOKENS // BLOCK_SIZE

        def run() -> int:
            for _ in range(HASH_PROMPTS_PER_REPEAT):
                if len(hasher(request)) != expected:
                    raise RuntimeError("hasher skipped blocks")
            return HASH_PROMPTS_PER_REPEAT * HASH_TOKENS
        return run

    ours = Request("h", tokens)
    for name in ("sha256_cbor", "sha256", "xxhash_cbor"):
        runners[name] = runner(get_request_block_hasher(BLOCK_SIZE, name), ours)
    if vllm is not None:
        utils, hashing = vllm["kv_cache_utils"], vllm["hashing"]
        theirs = vllm["request"].Request("h", list(tokens), vllm["SamplingParams"](max_tokens=1),
                                          None)
        # vLLM's engine core seeds NONE_HASH with the configured function (default "sha256")
        # before it builds the request block hasher; only the first block's parent reads it.
        utils.init_none_hash(hashing.sha256)
        for algo in ("sha256", "sha256_cbor"):
            fn = hashing.get_hash_fn_by_name(algo)
            hasher = utils.get_request_block_hasher(BLOCK_SIZE, fn)
            # The real path ran: block 0 is fn((NONE_HASH, tuple(its tokens), None)).
            if hasher(theirs)[0] != fn((utils.NONE_HASH, tuple(tokens[:BLOCK_SIZE]), None)):
                raise RuntimeError(f"vLLM's {algo} block hasher did not hash as expected")
            runners[f"vllm_{algo}"] = runner(hasher, theirs)
    rates = _median_rates(runners, repeats)
    return {name: 1e9 / rate for name, rate in rates.items()}


# -- driver ---------------------------------------------------------------------------------------
def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else num / den


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vllm-dir", help="folder holding the vllm package (an extracted wheel "
                        "or a source tree), or a vllm .whl to extract into the cache folder")
    parser.add_argument("--fetch-vllm", action="store_true", help=f"pip download vllm=="
                        f"{VLLM_VERSION} --no-deps into the cache folder if not there yet")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help=f"where the wheel is kept and extracted (default {DEFAULT_CACHE_DIR})")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="repetitions per figure; medians are reported")
    add_markdown_option(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    vllm, vllm_info = resolve_vllm(args.vllm_dir, args.fetch_vllm, args.cache_dir)

    alloc: dict[str, dict[str, float | None]] = {}
    for n in ALLOC_SIZES:
        rates = bench_alloc_free(n, args.repeats, vllm)
        alloc[str(n)] = {
            "pool_blocks_per_s": rates["pool"],
            "vllm_blocks_per_s": rates.get("vllm"),
            "deque_blocks_per_s": rates["deque"],
            "ratio_pool_to_vllm": _ratio(rates["pool"], rates.get("vllm")),
            "ratio_pool_to_deque": rates["pool"] / rates["deque"],
        }
    evict: dict[str, dict[str, float | None]] = {}
    for n in ALLOC_SIZES:
        rates = bench_cache_evict(n, args.repeats, vllm)
        evict[str(n)] = {
            "pool_blocks_per_s": rates["pool"],
            "vllm_blocks_per_s": rates.get("vllm"),
            "ratio_pool_to_vllm": _ratio(rates["pool"], rates.get("vllm")),
        }
    hit_s = bench_prefix_hit(args.repeats)
    hashing = bench_hashing(args.repeats, vllm)
    ratio_hash = _ratio(hashing["sha256_cbor"], hashing.get("vllm_sha256"))
    ratio_hash_cbor = _ratio(hashing["sha256_cbor"], hashing.get("vllm_sha256_cbor"))

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"kvmanager benchmark: pool {NUM_POOL_BLOCKS:,} blocks, block size {BLOCK_SIZE}, "
          f"Python {platform.python_version()}, medians of {args.repeats}")
    if vllm is None:
        print(f"vLLM baseline: none ({vllm_info['reason']})")
    else:
        stubbed_roots = sorted({name.split(".")[0] for name in vllm_info["stubbed_modules"]})
        print(f"vLLM baseline: {vllm_info['version']} from {vllm_info['path']} "
              f""
              f"(stand-ins: {', '.join(stubbed_roots) or 'none'})")
    print(f"{'allocate+free':<16}{'pool blocks/s':>15}{'vLLM blocks/s':>15}"
          f"{'deque blocks/s':>16}{'/vLLM':>8}{'/deque':>8}")
    for n, row in alloc.items():
        print(f"{n + ' blocks':<16}{row['pool_blocks_per_s']:>15,.0f}"
              f"{fmt(row['vllm_blocks_per_s'], ',.0f'):>15}{row['deque_blocks_per_s']:>16,.0f}"
              f"{fmt(row['ratio_pool_to_vllm'], '.2f'):>8}{row['ratio_pool_to_deque']:>8.2f}")
    print(f"{'alloc+cache+free':<16}{'(evicting)':>15}")
    for n, row in evict.items():
        print(f"{n + ' blocks':<16}{row['pool_blocks_per_s']:>15,.0f}"
              f"{fmt(row['vllm_blocks_per_s'], ',.0f'):>15}{'':>16}"
              f"{fmt(row['ratio_pool_to_vllm'], '.2f'):>8}")
    print(f"{'prefix hit, 2,000 blocks':<28}{hit_s * 1e3:>10.3f} ms"
          f"{hit_s / HIT_PROMPT_BLOCKS * 1e9:>10.0f} ns/block")
    for name, ns in hashing.items():
        print(f"{'hash ' + name:<28}{ns:>10.1f} ns/token")
    print(f"{'default hash / vLLM sha256':<28}{fmt(ratio_hash, '.2f'):>10}")

    result = {
        "benchmark": "kvmanager",
        "num_pool_blocks": NUM_POOL_BLOCKS,
        "block_size": BLOCK_SIZE,
        "repeats": args.repeats,
        "alloc_free": alloc,
        "ratio_pool_to_vllm_alloc_free": {n: r["ratio_pool_to_vllm"] for n, r in alloc.items()},
        "ratio_pool_to_deque_alloc_free": {n: r["ratio_pool_to_deque"] for n, r in alloc.items()},
        "alloc_cache_free_evicting": evict,
        "ratio_pool_to_vllm_alloc_cache_free_evicting": {
            n: r["ratio_pool_to_vllm"] for n, r in evict.items()
        },
        "prefix_hit_2000_blocks_ms": hit_s * 1e3,
        "prefix_hit_ns_per_block": hit_s / HIT_PROMPT_BLOCKS * 1e9,
        "hash_ns_per_token": hashing,
        "ratio_default_hash_to_vllm_sha256": ratio_hash,
        "ratio_default_hash_to_vllm_sha256_cbor": ratio_hash_cbor,
        "vllm_baseline": None if vllm is None else vllm_info,
        "vllm_baseline_reason": vllm_info.get("reason"),
        "elapsed_s": time.perf_counter() - started,
    }
    finish(result, name="kvmanager", title="Block pool and hashing / vLLM's own code",
           markdown=args.markdown)


if __name__ == "__main__":
    main()
