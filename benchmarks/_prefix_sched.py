"""bench_vllm_prefix's scheduler row: vLLM's own ``Scheduler.schedule()`` time on a burst of
requests nobody holds, with kvbridge's block index on (``index_url`` to a Redis without
entries), with no connector at all (``off``), with kvbridge's connector without an index
(``connector``: what the connector costs a step before any lookup), and with a connector that
does nothing (``null``, ``_null_connector.py``: what vLLM's own connector calls cost a step,
the floor of any connector; ``sched_null_over_off``).

Each side is one child process running a ``vllm.LLM`` in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler is reachable at
``llm.llm_engine.engine_core.engine_core.scheduler``); the child wraps that scheduler's
``schedule`` with a timer, warms up with one burst, then submits ``--sched-bursts`` bursts of
``--sched-requests`` fresh prompts at once (one ``generate`` call each, real forwards between
the steps, one output token each). Per burst:

- ``step_s``: the mean ``schedule()`` time of the steps that scheduled tokens (each followed by
  a forward): what the index adds to a working step (``sched_index_over_off``, the target);
- ``first_step_s``: the step the burst arrived in; with the index on, the one that starts every
  request's lookup inside ``get_num_new_matched_tokens`` (answered on the index client's thread);
  ``first_step_meta_s`` is the part of it in the connector's ``build_connector_meta``, where a
  step that schedules nothing while lookups are out waits for the first answer on purpose
  (``idle_lookup_wait_s``: the engine has nothing else to do);
- ``wait_steps`` / ``wait_s``: steps that scheduled nothing while lookups were out (vLLM's idle
  engine loop asks again at once: no forward runs, so they cost only this loop's time);
- ``wall_s``: the burst's ``generate`` call, from submission to the last output;
- ``update_s``: the mean ``update_from_output`` time after the working steps (the rest of the
  engine thread's step outside the forward, where the connector takes the step's prefix-cache
  changes, builds their events and hands them to the index's thread:
  ``update_index_over_off``, reported beside the target, which counts ``schedule()`` alone).
  Each update is credited to the ``schedule()`` before it: vLLM's CPU platform turns async
  scheduling off (``platforms/cpu.py``), so that is the step whose output it processes (with
  async scheduling on, as on a GPU, it would be the step after).

``--sched-breakdown`` also times, per working step, the calls a connector adds inside
``schedule()`` and the pool's ``cache_full_blocks`` (vLLM's own work, with the index on also
kvbridge's journal of the prefix cache: ``pool_follower.py``), as ``us_<call>``, and counts
them, as ``n_<call>``: where the index's and the connector's part of the step goes. Each timer
adds its own cost to the step, so a run with it is not the row's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["SIDES", "run_sched_row", "sched_child"]

SIDES = ("off", "null", "connector", "index")  # run in this order


def sched_child(args: argparse.Namespace) -> None:
    """The child: ``args.side`` is ``"index"`` (kvbridge, ``index_url``), ``"connector"``
    (kvbridge, no index), ``"null"`` (``_null_connector``) or ``"off"``."""
    from vllm import LLM, SamplingParams

    transfer = None
    if args.side == "null":
        transfer = {"kv_connector": "NullConnector", "kv_connector_module_path":
                    "_null_connector", "kv_role": "kv_both"}
    elif args.side != "off":
        extra = {"index_url": args.redis_url} if args.side == "index" else {}
        transfer = {"kv_connector": "KVBridgeConnector",
                    "kv_connector_module_path": "kvbridge.connector.vllm",
                    "kv_role": "kv_both", "engine_id": f"sched-{args.side}",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": extra}
    llm = LLM(model=args.model_path, skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, kv_cache_memory_bytes=args.kv_bytes,
              max_model_len=args.sched_tokens + 32, max_num_seqs=args.sched_requests,
              seed=0, kv_transfer_config=transfer)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    # [seconds, tokens scheduled, seconds in the connector's build_connector_meta, seconds in
    # the update_from_output that follows] per schedule()
    times: list[list[Any]] = []
    schedule = scheduler.schedule
    meta_s = [0.0]  # build_connector_meta's time in the current schedule()

    steps_parts: list[dict[str, float]] = []  # per schedule(), with --sched-breakdown

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        meta_s[0] = 0.0
        parts.clear()
        start = time.perf_counter()
        out = schedule(*args, **kwargs)
        times.append([time.perf_counter() - start, out.total_num_scheduled_tokens, meta_s[0],
                      0.0])
        steps_parts.append(dict(parts))
        return out

    def add_update_s(seconds: float) -> None:  # to the schedule() it follows
        if times:
            times[-1][3] += seconds

    def add_meta_s(seconds: float) -> None:
        meta_s[0] += seconds

    scheduler.schedule = timed_schedule
    scheduler.update_from_output = _timed(scheduler.update_from_output, add_update_s)
    connector = scheduler.connector
    if connector is not None:  # vLLM calls it once per schedule(), at its end
        connector.build_connector_meta = _timed(connector.build_connector_meta, add_meta_s)
    parts: dict[str, float] = {}  # --sched-breakdown: seconds per call name in this schedule()
    if args.sched_breakdown:
        _time_parts(scheduler, parts)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    bursts = []
    for burst in range(args.sched_bursts + 1):  # burst 0 warms the engine up
        rng = random.Random(f"{args.side}-{burst}")  # fresh prompts: nobody holds them
        prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(args.sched_tokens)]}
                   for _ in range(args.sched_requests)]
        times.clear()
        steps_parts.clear()
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        working = [t for t, n, _, _ in times if n > 0]
        waiting = [t for t, n, _, _ in times[1:] if n == 0]
        burst_row = {"step_s": statistics.mean(working), "steps": len(working),
                     "update_s": statistics.mean(u for _, n, _, u in times if n > 0),
                     "first_step_s": times[0][0], "first_step_meta_s": times[0][2],
                     "wait_steps": len(waiting), "wait_s": sum(waiting), "wall_s": wall}
        working_parts = [p for (_, n, _, _), p in zip(times, steps_parts, strict=True) if n > 0]
        for name in sorted({name for p in working_parts for name in p}):
            calls = name.startswith("n_")  # calls per step, else seconds per step
            burst_row[name if calls else f"us_{name}"] = (1 if calls else 1e6) * \
                statistics.mean(p.get(name, 0.0) for p in working_parts)
        bursts.append(burst_row)
    stats = None
    if args.side in ("index", "connector"):
        stats = scheduler.connector.stats.snapshot()
    Path(args.out).write_text(json.dumps({"bursts": bursts[1:], "stats": stats}))


def _timed(call: Any, add_s: Any) -> Any:
    """``call``, handing the seconds each call took to ``add_s``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            add_s(time.perf_counter() - start)

    return timed


def _time_parts(scheduler: Any, parts: dict[str, float]) -> None:
    """Wrap the connector's per-request calls inside ``schedule()`` and the block pool's
    ``cache_full_blocks`` with timers adding to ``parts`` (``--sched-breakdown``): seconds
    under the call's name, calls under ``n_`` and the name."""
    targets = [(scheduler.kv_cache_manager.block_pool, "cache_full_blocks")]
    if scheduler.connector is not None:
        targets += [(scheduler.connector, name) for name in (
            "get_num_new_matched_tokens", "update_state_after_alloc",
            "get_external_cache_hit_sources", "build_connector_meta")]
    for owner, name in targets:
        call = getattr(owner, name)

        def timed(*args: Any, _call: Any = call, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                parts[_name] = parts.get(_name, 0.0) + time.perf_counter() - start
                parts["n_" + _name] = parts.get("n_" + _name, 0) + 1

        setattr(owner, name, timed)


def _spawn(args: argparse.Namespace, side: str, model_path: str, redis_url: str,
           out: Path, script: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, script, "--child", "sched", "--side", side, "--model-path",
           model_path, "--redis-url", redis_url, "--out", str(out / f"sched-{side}.json"),
           "--sched-tokens", str(args.sched_tokens), "--sched-requests",
           str(args.sched_requests), "--sched-bursts", str(args.sched_bursts),
           "--kv-bytes", str(args.sched_kv_bytes)]
    if args.sched_breakdown:
        cmd.append("--sched-breakdown")
    log = open(out / f"sched-{side}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _run_side(args: argparse.Namespace, side: str, model_path: str, redis_url: str,
              out: Path, script: str) -> dict[str, Any]:
    """One child's ``{"bursts": [...], "stats": ...}``; raises RuntimeError when it fails."""
    proc = _spawn(args, side, model_path, redis_url, out, script)
    try:
        rc = proc.wait(timeout=args.case_timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"scheduler row ({side}) timed out; log in {out}") from None
    if rc != 0:
        raise RuntimeError(f"scheduler row ({side}) failed (rc {rc}); log in "
                           f"{out / f'sched-{side}.log'}")
    return json.loads((out / f"sched-{side}.json").read_text())


def run_sched_row(args: argparse.Namespace, model_path: str, redis_url: str, out: Path,
                  script: str) -> dict[str, Any]:
    """The four sides, one after the other (never at once: they would share the cores), in
    ``SIDES`` order and then in reverse, ``--sched-repeats`` times in all (each run a fresh
    child: the order's drift falls on every side alike); returns ``{"index": {...},
    "connector": {...}, "null": {...}, "off": {...}}`` (each side's medians over all its
    bursts, ``step_s_by_repeat`` the working step's median in each run) and the ratios
    ``sched_index_over_off`` (the target), ``sched_index_over_connector``,
    ``sched_null_over_off``, ``sched_index_over_null``, ``first_step_index_over_off``,
    ``wall_index_over_off``, ``update_index_over_off`` and ``update_index_over_connector``."""
    bursts: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    by_repeat: dict[str, list[float]] = {side: [] for side in SIDES}
    lookups: dict[str, list[int]] = {side: [0, 0] for side in SIDES}
    for repeat in range(args.sched_repeats):
        for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
            result = _run_side(args, side, model_path, redis_url, out, script)
            bursts[side] += result["bursts"]
            by_repeat[side].append(statistics.median(b["step_s"] for b in result["bursts"]))
            if result["stats"] is not None:
                lookups[side][0] += result["stats"].get("num_index_lookups", 0)
                lookups[side][1] += result["stats"].get("num_index_hits", 0)
    row: dict[str, Any] = {}
    for side in SIDES:
        keys = dict.fromkeys(key for b in bursts[side] for key in b)  # us_* may be absent
        row[side] = {key: statistics.median(b.get(key, 0.0) for b in bursts[side])
                     for key in keys}
        row[side]["step_s_by_repeat"] = by_repeat[side]
        if side in ("index", "connector"):
            row[side]["index_lookups"], row[side]["index_hits"] = lookups[side]
    row["sched_index_over_off"] = round(row["index"]["step_s"] / row["off"]["step_s"], 3)
    row["first_step_index_over_off"] = round(
        row["index"]["first_step_s"] / row["off"]["first_step_s"], 3)
    row["sched_index_over_connector"] = round(
        row["index"]["step_s"] / row["connector"]["step_s"], 3)
    row["sched_null_over_off"] = round(row["null"]["step_s"] / row["off"]["step_s"], 3)
    row["sched_index_over_null"] = round(row["index"]["step_s"] / row["null"]["step_s"], 3)
    row["wall_index_over_off"] = round(row["index"]["wall_s"] / row["off"]["wall_s"], 3)
    row["update_index_over_off"] = round(row["index"]["update_s"] / row["off"]["update_s"], 3)
    row["update_index_over_connector"] = round(
        row["index"]["update_s"] / row["connector"]["update_s"], 3)
    return row
