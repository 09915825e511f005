"""Prefix reuse across vLLM engines (issue 31): first token on a cross-instance hit through the
block index, against recompute, a local prefix-cache hit, LMCache and the store tier; the
scheduler's step time with the index on; a trace replay across three engines.

    $VENV/bin/python benchmarks/bench_vllm_prefix.py [--prompts 5] [--rounds 1] [--replay 200]

Run it with the vLLM venv (``tests/vllm/make_venv.sh`` prints its python). It starts its own
Redis server and vLLM engines, each a subprocess (the vLLM suite's ``tests/vllm/_node.py``,
in process, ``PYTHONHASHSEED=0``), on the four-layer ``small4`` Llama (hidden 384, 6 heads over
2 KV heads of 64, float32, 32-token blocks: prefill is costly here; ``--model tiny``: the suite's
tiny Llama). Rows:

- ``cross``: engines A and B (kvbridge, ``index_url``) and R (no connector, prefix caching off:
  every prompt recomputed). A serves ``--prompts`` prompts of ``--tokens`` tokens; B then gets
  each with a suffix of its own (``--suffix`` tokens) and pulls the prefix from A; R computes
  the same prompt (``recompute``); B gets the prefix again with another suffix (``local``: B's
  own prefix cache). Figures: medians of ``RequestOutput.metrics.first_token_latency`` over the
  prompts (one warm-up prompt first), ``cross_over_recompute`` and ``cross_over_local``. B's
  greedy tokens must equal R's, prompt for prompt: a mismatch is printed loudly and the run
  exits 1. ``--rounds N``: N sets of fresh prompts on the same engines, medians over all.
- ``lmcache``: the same prompts (the first round's) through LMCache 0.5.6's multiprocess
  connector (its server and two engines in the venv that ``--lmcache-python`` /
  ``KVBRIDGE_LMCACHE_PYTHON`` names; the engines in vLLM's multiprocess mode,
  ``_prefix_engines.spawned_engine`` says why), and before it ``cross_spawned``, so that
  ``cross_over_lmcache`` compares engines started alike (spawned kvbridge / spawned LMCache;
  ``cross_inproc_over_lmcache``: the ``cross`` row's in-process engines / LMCache's). Skipped,
  ``cross_spawned`` included, saying why, when no such venv imports ``lmcache`` (it is never
  installed here). Both need the ``cross`` row (its reference tokens).
- ``cross_spawned`` (never by default: run within ``lmcache``, or named alone): the ``cross``
  hit on two engines started as LMCache's are (``spawned_engine``, kvbridge's connector with
  ``index_url``, the vLLM venv's python): A serves the first round's prefixes, B gets each
  with its first suffix, then again with its second (``local_spawned``: B's own prefix
  cache, the floor no cross-instance hit beats, so ``lmcache_row_floor`` = ``local_spawned`` /
  ``lmcache`` is the best ``cross_over_lmcache`` any connector can reach on this host; LMCache's
  B does the same, ``lmcache_local``). A spawned engine has no connector ``stats``; B's pulls
  are counted from ``num_cached_tokens`` (a fresh B covers a prefix only with blocks pulled
  from A) and vLLM's ``prompt_tokens_cached_by_source`` counter (source ``p2p``, read in B's
  frontend).
- ``restore``: an engine with ``store_url`` and ``offload: "evict"`` serves the prompts, then
  others until they are evicted (copied to the store on their way out); B gets them with a
  suffix and restores from the store. Run only when the connector accepts ``store_url`` (an
  engine is started with it: its refusal is the reason printed otherwise).
- ``sched``: vLLM's own ``Scheduler.schedule()`` time on bursts of ``--sched-requests`` fresh
  prompts, index on (Redis without entries) / no connector, and / kvbridge's connector
  without an index, and / a connector that does nothing (vLLM's own cost of a connector:
  ``sched_null_over_off``; ``_prefix_sched.py``); beside it, the ``update_from_output`` after
  each working step, where the index's events are built and published
  (``update_index_over_off``, ``update_index_over_connector``: reported, no target).
- ``replay`` (``--replay N``, default off: the costly row): the first N requests of a
  Mooncake trace over three engines, round robin, small KV caches (``_prefix_replay.py``).

Prints a table per row and, last, one JSON object with the ratios and their targets;
``--markdown docs/benchmarks.md`` also writes it there (``_report.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _prefix_cases import Prompts, Tally, flush_index, request, serve, start_all, tokens
from _prefix_engines import (
    BLOCK,
    NodeError,
    engine,
    free_port,
    lmcache_connector,
    lmcache_python,
    spawned_engine,
    start_lmcache_server,
    start_redis,
    start_store,
    store_refusal,
)
from _prefix_replay import run_replay
from _prefix_sched import SIDES, run_sched_row, sched_child
from _report import add_markdown_option, finish
from bench_vllm_pd import _model

ROWS = ("cross", "lmcache", "restore", "sched")  # the default rows
# Three processes per spawned engine crowd these 2 cores and the Redis on them: a Redis call past
# the index's default 0.25 s socket timeout (seen at an engine's first publish) makes the engine
# leave the index alone for a second and lose that batch until its next step, which an engine
# idle by then never takes. A stall costs no figure here; a lost batch costs every pull.
PATIENT_INDEX = {"index_socket_timeout_s": 2.0}
SPAWNED = "cross_spawned"  # runs within lmcache, or when named (a test without LMCache)
LOCAL_SPAWNED = "local_spawned"  # B's own prefix cache, after cross_spawned's hits
P2P = "vllm:prompt_tokens_cached_by_source:p2p"  # tokens vLLM took from another engine
TARGETS = {"cross_over_recompute": 0.25, "cross_over_local": 2.0, "cross_over_lmcache": 0.5,
           "restore_over_recompute": 0.3, "sched_index_over_off": 1.05,
           "replay_hit_over_unbounded": 0.85}


def cross_rows(args, model: str, redis_url: str, logs: Path, tally: Tally,
               rounds: list[Prompts]) -> dict[str, Any]:
    """A, B and R (see the module docstring); fills ``tally`` with ``cross``, ``recompute``
    and ``local``, and keeps R's tokens as the reference of every later row."""
    index = {"index_url": redis_url, "load_timeout_s": 10.0, **PATIENT_INDEX}
    llm = {"kv_cache_memory_bytes": args.kv_bytes, "max_model_len": args.max_model_len}
    a = engine("prefix-a", model, logs, extra=index, llm=llm)
    b = engine("prefix-b", model, logs, extra=index, llm=llm)
    r = engine("prefix-r", model, logs, llm={**llm, "enable_prefix_caching": False})
    reference: dict[tuple[int, int, int], list[int]] = {}
    try:
        start_all(a, b, r)
        for k, prompts in enumerate(rounds):
            serve(a, prompts.prefixes)
            for i in range(len(prompts.prefixes)):
                for which, batch in ((1, prompts.first), (2, prompts.second)):
                    (ref,) = r.generate([request(batch[i], args.max_tokens)])
                    reference[k, i, which] = ref["token_ids"]
                    (out,) = b.generate([request(batch[i], args.max_tokens)])
                    tally.add("cross" if which == 1 else "local", i, out, ref["token_ids"])
                    if which == 1:
                        tally.add("recompute", i, ref, None)
        stats = b.stats()
    finally:
        for node in (a, b, r):
            node.stop()
    return {"reference": reference, "b_stats": stats}


def spawned_cross(args, model: str, redis_url: str, logs: Path, tally: Tally,
                  prompts: Prompts, reference: dict) -> dict[str, int]:
    """``cross_spawned`` (module docstring) into ``tally``; how many of B's prompts covered
    their prefix with pulled blocks, and the ``p2p`` tokens vLLM counted on B."""
    flush_index(redis_url)  # the cross row's stopped engines published these same prefixes
    llm = {"kv_cache_memory_bytes": args.kv_bytes, "max_model_len": args.max_model_len}
    index = {"index_url": redis_url, "load_timeout_s": 10.0, **PATIENT_INDEX}
    a = spawned_engine("spawned-a", model, logs, extra=index, llm=llm)
    b = spawned_engine("spawned-b", model, logs, extra=index, llm=llm)
    pulled = 0
    try:
        start_all(a, b)
        serve(a, prompts.prefixes)
        p2p = -b.metrics().get(P2P, 0.0)
        for i, prompt in enumerate(prompts.first):
            (out,) = b.generate([request(prompt, args.max_tokens)])
            tally.add(SPAWNED, i, out, reference[0, i, 1])
            pulled += out["num_cached_tokens"] >= len(prompts.prefixes[i]) // BLOCK * BLOCK
        p2p += b.metrics().get(P2P, 0.0)
        serve_local_hits(b, LOCAL_SPAWNED, args, tally, prompts, reference)
    finally:
        for node in (a, b):
            node.stop()
    if pulled < len(prompts.first):
        print(f"!!! spawned B covered {pulled} of {len(prompts.first)} prefixes: the "
              f"{SPAWNED} figure is not a cross-instance hit", flush=True)
    return {"b_spawned_pulled_prompts": pulled, "b_spawned_p2p_tokens": int(p2p)}


def serve_local_hits(b, case: str, args, tally: Tally, prompts: Prompts,
                     reference: dict) -> None:
    """B (spawned, its cross-instance hits served) gets each prefix again with the second
    suffix: a hit in B's own prefix cache, the floor of a cross-instance hit on engines
    started alike (no transfer beats it), into ``tally`` as ``case``."""
    for i, prompt in enumerate(prompts.second):
        (out,) = b.generate([request(prompt, args.max_tokens)])
        tally.add(case, i, out, reference[0, i, 2])


def lmcache_row(args, model: str, redis_url: str, logs: Path, tally: Tally, prompts: Prompts,
                reference: dict | None) -> tuple[str, dict[str, int] | None]:
    """``cross_spawned``, then the cross-instance hit through LMCache's multiprocess server;
    ("", ``spawned_cross``'s counts) or (why not run, None)."""
    python, why = lmcache_python(args.lmcache_python)
    if python is None:
        return why, None
    if reference is None:
        return "not run: needs the cross row (its reference tokens)", None
    spawned = spawned_cross(args, model, redis_url, logs, tally, prompts, reference)
    port = free_port()
    server = start_lmcache_server(python, port, logs)
    llm = {"kv_cache_memory_bytes": args.kv_bytes, "max_model_len": args.max_model_len}
    a = spawned_engine("lmcache-a", model, logs, connector=lmcache_connector(port), llm=llm,
                       python=python)
    b = spawned_engine("lmcache-b", model, logs, connector=lmcache_connector(port), llm=llm,
                       python=python)
    try:
        start_all(a, b)
        serve(a, prompts.prefixes)
        for i, prompt in enumerate(prompts.first):
            (out,) = b.generate([request(prompt, args.max_tokens)])
            tally.add("lmcache", i, out, reference[0, i, 1])
        serve_local_hits(b, "lmcache_local", args, tally, prompts, reference)
    finally:
        for node in (a, b):
            node.stop()
        server.stop()
    return "", spawned


def restore_row(args, model: str, redis_url: str, logs: Path, tally: Tally,
                prompts: Prompts) -> tuple[str, dict | None]:
    """Restore from the store tier (module docstring); ("", B's stats) or (why not, None)."""
    write_port = free_port()
    per_prompt = -(-args.max_model_len // 32)
    small = {"kv_cache_memory_bytes": args.block_bytes * 2 * per_prompt,
             "max_model_len": args.max_model_len}
    s = engine("store-s", model, logs, llm=small,
               extra={"index_url": redis_url, "store_url": f"127.0.0.1:{write_port}",
                      "offload": "evict", "load_timeout_s": 10.0})
    try:
        s.wait_ready()
    except NodeError as exc:
        s.kill()
        return f"not run: {store_refusal(str(exc))}", None
    store = None
    llm = {"kv_cache_memory_bytes": args.kv_bytes, "max_model_len": args.max_model_len}
    b = engine("store-b", model, logs, extra={"index_url": redis_url, "load_timeout_s": 10.0},
               llm=llm)
    r = engine("store-r", model, logs, llm={**llm, "enable_prefix_caching": False})
    try:
        store = start_store(redis_url, write_port, args.store_bytes, logs)
        start_all(b, r)
        for prefix in prompts.prefixes:  # one at a time: the earlier ones go cold
            serve(s, [prefix])
        for i in range(4):  # fillers: every prefix evicted (offloaded first)
            serve(s, [tokens(f"filler-{i}", args.max_model_len - 64)])
        for i, prompt in enumerate(prompts.first):
            (ref,) = r.generate([request(prompt, args.max_tokens)])
            (out,) = b.generate([request(prompt, args.max_tokens)])
            tally.add("restore", i, out, ref["token_ids"])
            tally.add("restore_recompute", i, ref, None)
        offloaded = {k: v for k, v in s.stats().items() if "offload" in k}
        return "", {**b.stats(), **offloaded}
    except (NodeError, RuntimeError) as exc:
        return f"not run: {str(exc).splitlines()[0][:300]}", None
    finally:
        for node in (s, b, r):
            node.stop()
        if store is not None:
            store.stop()


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def ratios(ttft: dict[str, float]) -> dict[str, float | None]:
    """The report's first-token ratios from the medians ``ttft`` (case -> seconds), None where
    a case did not run. ``cross_over_lmcache`` is like for like: kvbridge's and LMCache's
    engines both spawned (module docstring, ``lmcache``)."""
    return {
        "cross_over_recompute": _ratio(ttft.get("cross"), ttft.get("recompute")),
        "cross_over_local": _ratio(ttft.get("cross"), ttft.get("local")),
        "cross_over_lmcache": _ratio(ttft.get(SPAWNED), ttft.get("lmcache")),
        # The best cross_over_lmcache any connector reaches here: its engine's own local hit.
        "lmcache_row_floor": _ratio(ttft.get(LOCAL_SPAWNED), ttft.get("lmcache")),
        "cross_spawned_over_local_spawned": _ratio(ttft.get(SPAWNED), ttft.get(LOCAL_SPAWNED)),
        "lmcache_over_lmcache_local": _ratio(ttft.get("lmcache"), ttft.get("lmcache_local")),
        "cross_inproc_over_lmcache": _ratio(ttft.get("cross"), ttft.get("lmcache")),
        "lmcache_over_recompute": _ratio(ttft.get("lmcache"), ttft.get("recompute")),
        "restore_over_recompute": _ratio(ttft.get("restore"), ttft.get("restore_recompute")),
    }


def _print_ttft(tally: Tally) -> None:
    print(f"\n{'case':18s} {'TTFT p50 ms':>12s} {'min':>8s} {'max':>8s} {'cached p50':>11s}")
    for case, values in tally.ttft.items():
        print(f"{case:18s} {statistics.median(values) * 1e3:12.1f} {min(values) * 1e3:8.1f} "
              f"{max(values) * 1e3:8.1f} {statistics.median(tally.cached[case]):11.0f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("small4", "small", "tiny"), default="small4")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="sets of fresh prompts")
    parser.add_argument("--tokens", type=int, default=2048, help="prefix length")
    parser.add_argument("--suffix", type=int, default=64, help="B's suffix length")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-bytes", type=int, default=256 << 20)
    parser.add_argument("--store-bytes", type=int, default=256 << 20)
    parser.add_argument("--replay-store-bytes", type=int, default=1 << 30,
                        help="the replay's store: a capacity tier several times the engines' "
                             "caches (the default holds every block of the first 200 requests)")
    parser.add_argument("--lmcache-python", default=None,
                        help="python of a venv with lmcache 0.5.6 and vLLM "
                        "(default $KVBRIDGE_LMCACHE_PYTHON)")
    parser.add_argument("--sched-requests", type=int, default=64)
    parser.add_argument("--sched-tokens", type=int, default=512)
    # small4: 6 bursts and the warm-up fill 7,616 of the 8,192 blocks 1 GiB holds (no eviction)
    parser.add_argument("--sched-bursts", type=int, default=6)
    parser.add_argument("--sched-kv-bytes", type=int, default=1 << 30)
    parser.add_argument("--sched-repeats", type=int, default=4,
                        help="runs of every side, alternating the order (medians over all)")
    parser.add_argument("--sched-breakdown", action="store_true",
                        help="also time each connector call inside schedule() (us_* per "
                             "working step; the timers add to the step: not the row's figure)")
    parser.add_argument("--replay", type=int, default=0, metavar="N",
                        help="replay the trace's first N requests (0: skip the row)")
    parser.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    parser.add_argument("--replay-blocks", type=int, default=512,
                        help="KV cache blocks per replay engine (raised to fit one prompt)")
    parser.add_argument("--replay-max-tokens", type=int, default=2)
    parser.add_argument("--replay-min-remote-hit-tokens", type=int, default=None,
                        help="the replay engines' min_remote_hit_tokens (default: the "
                             "connector's own default inside vLLM)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, 2 prompts of 512 tokens, bursts of 8: a minute")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=(*ROWS, SPAWNED),
                        help=f"rows to run (lmcache and {SPAWNED} need cross; replay needs "
                             "--replay N)")
    parser.add_argument("--case-timeout-s", type=float, default=600.0)
    parser.add_argument("--child", choices=("sched",), help=argparse.SUPPRESS)
    for name in ("--side", "--model-path", "--redis-url", "--out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    add_markdown_option(parser)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.prompts, args.tokens, args.rounds = "tiny", 2, 512, 1
        args.sched_requests, args.sched_tokens, args.sched_bursts = 8, 320, 1
        args.sched_repeats = 1
        args.kv_bytes, args.store_bytes = 64 << 20, 64 << 20
        args.replay_store_bytes = 64 << 20
    args.max_model_len = -(-(args.tokens + args.suffix + args.max_tokens) // 32) * 32 + 32
    return args


def main() -> int:
    args = parse_args()
    if args.child == "sched":
        sched_child(args)
        return 0
    from _prefix_engines import block_bytes

    model = _model(args.model)
    args.block_bytes = block_bytes(model)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-prefix-"))
    print(f"logs in {work}", flush=True)
    redis = start_redis(work)
    tally = Tally()
    report: dict[str, Any] = {"benchmark": "vllm_prefix", "model": args.model,
                              "prompts": args.prompts, "rounds": args.rounds,
                              "tokens": args.tokens, "suffix": args.suffix}
    try:
        _run_rows(args, model, redis.url, work, tally, report)
    finally:
        redis.stop()
    report["mismatches"] = len(tally.mismatches)
    report["targets"] = TARGETS
    if tally.mismatches:
        print(f"!!! {len(tally.mismatches)} TOKEN MISMATCH(ES): {tally.mismatches}", flush=True)
    finish(report, name="vllm_prefix",
           title="vLLM prefix reuse: first token on a cross-instance hit, scheduler, replay",
           markdown=args.markdown)
    return 1 if tally.mismatches else 0


def _run_rows(args, model: str, redis_url: str, work: Path, tally: Tally,
              report: dict[str, Any]) -> None:
    """Every row ``--rows`` names, in order; their figures into ``report``."""
    rounds = [Prompts(f"r{k}", args.prompts, args.tokens, args.suffix)
              for k in range(args.rounds)]
    reference = None
    if "cross" in args.rows:
        cross = cross_rows(args, model, redis_url, work, tally, rounds)
        reference = cross["reference"]
        report["b_index_hits"] = hits = cross["b_stats"]["num_index_hits"]
        report["b_remote_hit_tokens"] = cross["b_stats"]["remote_hit_tokens"]
        report["b_index_lookups"] = cross["b_stats"]["num_index_lookups"]
        for key in ("queue_s_p50", "transfer_s_p50"):  # arrival -> pull start; the pull
            report[f"b_{key}"] = cross["b_stats"][key]
        if hits < args.rounds * (args.prompts + 1):
            print(f"!!! B pulled {hits} of {args.rounds * (args.prompts + 1)} prefixes: the "
                  "cross figure is not a cross-instance hit", flush=True)
    why, spawned = "not run: --rows", None
    if "lmcache" in args.rows:
        why, spawned = lmcache_row(args, model, redis_url, work, tally, rounds[0], reference)
    report["lmcache"] = why or "run"
    if spawned is None and SPAWNED in args.rows:
        if reference is None:
            report[SPAWNED] = "not run: needs the cross row (its reference tokens)"
        else:
            spawned = spawned_cross(args, model, redis_url, work, tally, rounds[0], reference)
    if spawned is not None:
        report[SPAWNED] = "run"
        report.update(spawned)
    report.setdefault(SPAWNED, f"not run: runs within the lmcache row ({report['lmcache']})")
    args.store_available, args.store_note = False, "not run: --rows"
    if "restore" in args.rows:
        why, stats = restore_row(args, model, redis_url, work, tally,
                                 Prompts("store", args.prompts, args.tokens, args.suffix))
        args.store_available, args.store_note = not why, why
        if stats is not None:
            report["restore_stats"] = {k: v for k, v in stats.items()
                                       if "restore" in k or "store_hit" in k or "offload" in k}
    report["restore"] = args.store_note or "run"
    _print_ttft(tally)
    for row in ("lmcache", SPAWNED, "restore"):
        if report[row] != "run":
            print(f"{row}: {report[row]}")
    ttft = {case: tally.median(case) for case in tally.ttft}
    report["ttft_p50_s"] = ttft
    report.update(ratios(ttft))
    if "sched" in args.rows:
        flush_index(redis_url)  # the index holds no entries: every lookup misses
        sched = run_sched_row(args, model, redis_url, work, __file__)
        print(f"\nsched, bursts of {args.sched_requests} (medians over bursts):\n"
              f"{'side':9s} {'working step ms':>15s} {'steps':>6s} {'first step ms':>14s} "
              f"{'of it meta ms':>13s} {'wait steps':>10s} {'wait ms':>8s} "
              f"{'burst wall ms':>14s} {'update ms':>11s}")
        for side in reversed(SIDES):
            row = sched[side]
            print(f"{side:9s} {row['step_s'] * 1e3:15.3f} {row['steps']:6.0f} "
                  f"{row['first_step_s'] * 1e3:14.3f} {row['first_step_meta_s'] * 1e3:13.3f} "
                  f"{row['wait_steps']:10.0f} {row['wait_s'] * 1e3:8.2f} "
                  f"{row['wall_s'] * 1e3:14.1f} {row['update_s'] * 1e3:11.3f}", flush=True)
        for side in reversed(SIDES):  # --sched-breakdown
            parts = {k[3:]: v for k, v in sched[side].items() if k.startswith("us_")}
            if parts:
                print(f"{side:9s} us per working step: " + ", ".join(
                    f"{name} {us:.1f}" for name, us in parts.items()), flush=True)
        report["sched"] = {side: sched[side] for side in SIDES}
        for key in ("sched_index_over_off", "sched_index_over_connector", "sched_null_over_off",
                    "sched_index_over_null", "first_step_index_over_off",
                    "wall_index_over_off", "update_index_over_off",
                    "update_index_over_connector"):
            report[key] = sched[key]
    if args.replay:
        flush_index(redis_url)
    replay = run_replay(args, model, redis_url, work) if args.replay else None
    report["replay"] = replay if replay is not None else "not run: --replay 0"
    if replay is not None:
        report["replay_hit_over_unbounded"] = replay["hit_over_unbounded"]
        report["replay_ttft_over_no_connector"] = replay["ttft_over_no_connector"]
        tally.mismatches += [f"replay request {i}" for i in replay["mismatched"]]


if __name__ == "__main__":
    sys.exit(main())
