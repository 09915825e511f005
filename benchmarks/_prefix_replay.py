"""bench_vllm_prefix's trace replay: the first ``--replay`` requests of a Mooncake trace over
three vLLM engines with round-robin routing (a router that knows nothing), one request at a
time, KV caches of ``--replay-blocks`` blocks each (eviction happens).

Prompts are made as ``kvbridge-replay`` makes them (``kvbridge.connector.serve.replay``'s
``load_trace``: each hash id a fixed run of 32 token ids from a PRNG seeded by the id, the prompt
cut to ``input_length`` scaled 512 -> 32), each id folded into the model's 512-token vocabulary
(``1 + id % 511``: equal runs stay equal, so the trace's prefix sharing is kept). Each request
asks for ``--replay-max-tokens`` tokens.

Variants, each on three fresh engines: ``kvbridge`` (``index_url``; ``min_remote_hit_tokens``
the connector's default inside vLLM, as a user runs it, or ``--replay-min-remote-hit-tokens``:
32 is one block, a 512-token block of the trace), ``kvbridge_store`` (also ``store_url`` and
``offload: "evict"`` to one store node; only when the connector accepts them) and ``none`` (no
connector: local prefix caches only, and the reference tokens).

The ``kvbridge_store`` variant's store holds ``--replay-store-bytes`` (a capacity tier several
times the engines' caches; the summary gives it in blocks against the trace's distinct full
blocks: the first 200 requests reuse prefixes up to 161 requests later, long after every
engine's own cache has evicted them, so only a store that reaches that far can serve them).

Figures: prompt tokens served from any cache (``num_cached_tokens``: the engine's own and
pulled) over what unbounded caches would serve (``load_trace``'s ``oracle_hit_blocks``: every
leading block seen in an earlier prompt, never the last token's block); mean first-token
latency against the ``none`` variant; per engine the cached tokens by vLLM's hit source
(``vllm:prompt_tokens_cached_by_source``: ``device`` local, ``p2p`` another engine,
``external_unspecified`` the store).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from _prefix_engines import BLOCK, NodeError, engine, free_port, start_store
from kvbridge.connector.serve.replay import load_trace

__all__ = ["run_replay"]

SOURCE = "vllm:prompt_tokens_cached_by_source:"
NUM_ENGINES = 3


def _variant(name: str, extra: dict[str, Any] | None, model: str, llm: dict[str, Any],
             prompts: list[list[int]], max_tokens: int, redis_url: str, logs: Path,
             store_bytes: int) -> dict[str, Any]:
    store = None
    write_port = free_port()
    if extra is not None and name == "kvbridge_store":
        extra = {**extra, "store_url": f"127.0.0.1:{write_port}", "offload": "evict"}
        # Up before the engines, as deployed: each engine's hello at its start opens the
        # store's shelf then, not while the replay's first requests run.
        store = start_store(redis_url, write_port, store_bytes, logs)
    nodes = []
    try:
        nodes += [engine(f"replay-{name}-{n}", model, logs, extra=extra, llm=llm)
                  for n in range(NUM_ENGINES)]
        for node in nodes:
            node.wait_ready()
        for n, node in enumerate(nodes):  # the first forward of an engine is slow
            node.generate([{"prompt_token_ids": [3 + n] * 40, "max_tokens": 1,
                            "kv_transfer_params": None}])
        before = [node.metrics() for node in nodes]
        outs = []
        for i, prompt in enumerate(prompts):
            (out,) = nodes[i % NUM_ENGINES].generate([{"prompt_token_ids": prompt,
                                                        "max_tokens": max_tokens,
                                                        "kv_transfer_params": None}])
            outs.append(out)
        after = [node.metrics() for node in nodes]
        stats = [node.stats() for node in nodes]
    finally:
        for node in nodes:
            node.stop()
        if store is not None:
            store.stop()
    by_source = [{key.removeprefix(SOURCE): int(a[key] - b.get(key, 0))
                  for key in a if key.startswith(SOURCE) and a[key] - b.get(key, 0)}
                 for a, b in zip(after, before, strict=True)]
    return {"outs": outs, "by_source": by_source, "stats": stats}


def _distinct_full_blocks(prompts: list[list[int]]) -> int:
    """How many different full blocks (a block and every token before it) the prompts hold."""
    chains = set()
    for prompt in prompts:
        chain: int | None = None
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            chain = hash((chain, tuple(prompt[start:start + BLOCK])))
            chains.add(chain)
    return len(chains)


def run_replay(args: argparse.Namespace, model: str, redis_url: str, logs: Path
               ) -> dict[str, Any] | str:
    """The replay row's figures (see the module docstring)."""
    trace = load_trace(Path(args.trace), args.replay, BLOCK)
    prompts = [[1 + t % 511 for t in trace.expander.prompt(r)] for r in trace.requests]
    max_model_len = -(-(max(map(len, prompts)) + args.replay_max_tokens) // BLOCK) * BLOCK
    num_blocks = max(args.replay_blocks, max_model_len // BLOCK + 2)
    llm = {"kv_cache_memory_bytes": num_blocks * args.block_bytes,
           "max_model_len": max_model_len, "max_num_seqs": 2}
    extra: dict[str, Any] = {"index_url": redis_url, "load_timeout_s": 10.0}
    if args.replay_min_remote_hit_tokens is not None:  # else the connector's default
        extra["min_remote_hit_tokens"] = args.replay_min_remote_hit_tokens
    unbounded = sum(trace.oracle_hit_blocks) * BLOCK
    prompt_tokens = sum(map(len, prompts))
    distinct_blocks = _distinct_full_blocks(prompts)
    store_blocks = args.replay_store_bytes // args.block_bytes
    print(f"\nreplay: {len(prompts)} requests, {prompt_tokens} prompt tokens, unbounded caches "
          f"would serve {unbounded}; {NUM_ENGINES} engines of {num_blocks} blocks; the store "
          f"holds {store_blocks} blocks of the {distinct_blocks} distinct full blocks",
          flush=True)
    runs: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    if not args.store_available:
        notes["kvbridge_store"] = args.store_note
    for name, cfg in (("none", None), ("kvbridge", extra), ("kvbridge_store", extra)):
        if name in notes:
            continue
        try:
            runs[name] = _variant(name, cfg, model, llm, prompts, args.replay_max_tokens,
                                  redis_url, logs, args.replay_store_bytes)
        except (NodeError, RuntimeError) as exc:
            if name != "kvbridge_store":
                raise
            notes[name] = f"not run: {str(exc).splitlines()[0][:300]}"
            print(f"replay {name}: {notes[name]}", flush=True)
    reference = [o["token_ids"] for o in runs["none"]["outs"]]
    mismatched: list[int] = []
    summary: dict[str, Any] = {"requests": len(prompts), "prompt_tokens": prompt_tokens,
                               "unbounded_cached_tokens": unbounded,
                               "blocks_per_engine": num_blocks,
                               "distinct_blocks": distinct_blocks, "store_blocks": store_blocks,
                               "min_remote_hit_tokens": extra.get("min_remote_hit_tokens",
                                                                  "default")}
    base_ttft = statistics.mean(o["first_token_latency"] for o in runs["none"]["outs"])
    print(f"{'variant':16s} {'cached/unbounded':>17s} {'mean TTFT ms':>13s} {'vs none':>8s}  "
          "cached tokens by source, per engine")
    for name, run in runs.items():
        cached = sum(o["num_cached_tokens"] for o in run["outs"])
        ttft = statistics.mean(o["first_token_latency"] for o in run["outs"])
        wrong = [i for i, o in enumerate(run["outs"]) if o["token_ids"] != reference[i]]
        if wrong:
            mismatched += wrong
            print(f"!!! TOKEN MISMATCH: replay {name}, requests {wrong[:20]} differ from the "
                  "no-connector run", flush=True)
        summary[name] = {"cached_tokens": cached,
                         "hit_over_unbounded": round(cached / unbounded, 3) if unbounded else None,
                         "mean_ttft_s": round(ttft, 4),
                         "ttft_over_no_connector": round(ttft / base_ttft, 3),
                         "by_source": run["by_source"]}
        if name != "none":  # per engine: lookups started, pulls they started, pulls failed
            summary[name]["index"] = [
                [st["num_index_lookups"], st["num_index_hits"], st["num_failed_loads"]]
                for st in run["stats"]]
        print(f"{name:16s} {summary[name]['hit_over_unbounded']!s:>17s} {ttft * 1e3:13.1f} "
              f"{ttft / base_ttft:8.3f}  {run['by_source']}")
    summary.update(notes)
    best = summary.get("kvbridge_store") if "kvbridge_store" in runs else summary["kvbridge"]
    summary["hit_over_unbounded"] = best["hit_over_unbounded"]
    summary["ttft_over_no_connector"] = best["ttft_over_no_connector"]
    summary["figures_from"] = "kvbridge_store" if "kvbridge_store" in runs else "kvbridge"
    summary["mismatched"] = sorted(set(mismatched))
    return summary
