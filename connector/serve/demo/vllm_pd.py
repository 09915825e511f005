"""The main job on vLLM: two stock ``vllm serve`` processes, P and D, with the kvbridge
connector and kvbridge-proxy in front, serving real text; every answer checked token for
token against a single vLLM instance without a connector. ``make demo-vllm`` runs it in the
vLLM venv (tests/vllm*/make_venv.sh).

    kvbridge-demo-vllm [--conversations 7 --turns 3 --max-tokens 16]

What it does (everything in the work directory, printed at start; logs are kept on failure):

1. The tiny Llama checkpoint and its BPE tokenizer (trained on standard-library docstrings),
   written once into ``${KVBRIDGE_CACHE:-~/.cache/kvbridge-vllm}/models`` by the vLLM suite's
   ``tiny_checkpoint``; ``--model DIR`` uses another (it needs ``tokenizer.json``).
2. The reference: one ``vllm serve`` alone (no connector, no prefix caching) plays the
   conversations (``vllm_client``) one request at a time, greedy, ``ignore_eos``,
   ``max_tokens`` fixed; its answers are the expected tokens, and the prefill time vLLM reports
   for each request is "what recomputing that prompt costs". It is stopped before P and D start.
3. P (``kv_role`` kv_producer) and D (kv_consumer), each a ``vllm serve`` loading
   ``kvbridge.connector.vllm:KVBridgeConnector``, with ``PYTHONHASHSEED=0`` (block hashes must
   agree) and ``VLLM_CPU_OMP_THREADS_BIND=nobind``; then kvbridge-proxy in front of them.
4. The same conversations through the proxy, one request at a time (every fourth streamed);
   each answer (prompt ids and output ids, as ``return_token_ids`` gives them) is compared with
   the reference's. After each request P's and D's ``/metrics`` are read, so the figures vLLM
   keeps (queue, prefill, first-token time, external and local prefix-cache hits) split per
   request: P's prefill, D's wait for the KV (its queue time: the pull), D's first token.
5. P must end holding no blocks (every lease released by D's completion notices).
6. The report; its last line is one JSON object. Exit code 1 on any mismatch, error, a server
   that died, or a run where D pulled nothing; 2 for an unusable ``--model``.

``vllm serve`` is started as ``python -m vllm.entrypoints.openai.api_server`` (the same server):
the ``vllm`` command of vllm-cpu 0.32.0 dies at start, asking for the version of a ``vllm``
distribution (the installed one is ``vllm-cpu``). Everything it started is stopped at the end,
on failure and on Ctrl-C (SIGTERM, then SIGKILL to each server's process group).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ..cli import CommandParser, run_stopping_children
from .processes import ManagedProcess, ProcessGroup, StartupError, free_port
from .vllm_client import (
    Answer,
    MetricsDelta,
    build_conversations,
    complete,
    load_tokenizer,
    scrape,
)
from .vllm_report import (
    BLOCK_SIZE,
    KV_CACHE_USAGE,
    Turn,
    build_report,
    print_summary,
    request_rows,
)

__all__ = ["main", "parse_args", "run"]

_STOP_GRACE_S = 20.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="kvbridge-demo-vllm",
                           description="kvbridge P/D between two vllm serve, verified")
    parser.add_argument("--model", default=None, help="checkpoint dir with tokenizer.json "
                        "(default: the vLLM suite's tiny Llama, written once)")
    parser.add_argument("--conversations", type=int, default=7)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream-every", type=int, default=4,
                        help="every n-th request is streamed (0: none)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    parser.add_argument("--load-timeout-s", type=float, default=20.0)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server")
    parser.add_argument("--workdir", default=None, help="logs go here (default: a temp dir)")
    return parser.parse_args(argv)


def tiny_model_dir() -> Path:
    """The tiny Llama with its tokenizer (``tiny_llama``; written on first use, cached)."""
    from .tiny_checkpoint import tiny_llama

    return Path(tiny_llama(tokenizer=True))


def serve_command(model: Path, port: int, args: argparse.Namespace,
                  kv_config: dict[str, Any] | None) -> list[str]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
        "--max-model-len", "1024", "--max-num-seqs", "4", "--seed", "0",
        "--disable-uvicorn-access-log",
    ]
    if kv_config is None:
        return [*argv, "--no-enable-prefix-caching"]
    return [*argv, "--kv-transfer-config", json.dumps(kv_config)]


def kv_config(role: str, engine_id: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.connector.vllm",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "load_timeout_s": args.load_timeout_s,
            "lease_s": max(30.0, 3 * args.load_timeout_s),
        },
    }


def stop(children: list[ManagedProcess]) -> None:
    """SIGTERM every child, wait up to the grace period, then SIGKILL each one's process group
    (a vLLM server's EngineCore and Worker are in it)."""
    for child in children:
        if child.running:
            child.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.popen.pid, signal.SIGKILL)  # its leftovers, if any
        if child.popen.poll() is None:
            child.popen.wait(5.0)
    children.clear()


def start_servers(group: ProcessGroup, specs: list[tuple[str, list[str], str]],
                  timeout_s: float) -> list[ManagedProcess]:
    started = [group.spawn(name, argv, url=url) for name, argv, url in specs]
    group.wait_healthy(started, timeout_s=timeout_s)
    return started


def reference_phase(group: ProcessGroup, model: Path, args: argparse.Namespace,
                    tokenizer: Any, timings: dict[str, float]) -> list[Turn]:
    """The expected answers from one ``vllm serve`` without a connector (stopped at the end)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    ref = start_servers(group, [("reference", serve_command(model, port, args, None), url)],
                        args.start_timeout_s)
    timings["reference_start_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    turns: list[Turn] = []
    try:
        with httpx.Client(timeout=120.0) as client:
            watch = MetricsDelta(client, url)
            conversations = build_conversations(tokenizer, args.conversations, args.turns)
            index = 0
            for t in range(args.turns):
                for conversation in conversations:
                    prompt = conversation.next_prompt()
                    assert prompt is not None
                    answer = complete(client, url, prompt, args.max_tokens, stream=False)
                    stream = args.stream_every > 0 and index % args.stream_every == 1
                    turns.append(Turn(conversation.conversation_id, t, stream, answer,
                                      watch.take()))
                    conversation.record(answer.prompt_token_ids, answer.token_ids)
                    index += 1
        timings["reference_run_s"] = time.perf_counter() - t0
    finally:
        stop(ref)
        group.children.clear()
    return turns


def _check(turn: Turn, got: Answer) -> str | None:
    """None when P/D's answer equals the reference's, else a one-line description."""
    exp = turn.expected
    if got.prompt_token_ids != exp.prompt_token_ids:
        return (f"conversation {turn.conversation} turn {turn.turn}: prompt differs "
                f"({len(got.prompt_token_ids)} vs {len(exp.prompt_token_ids)} tokens)")
    if got.token_ids != exp.token_ids:
        first = next((i for i, (a, b) in enumerate(zip(exp.token_ids, got.token_ids,
                                                       strict=False)) if a != b),
                     min(len(exp.token_ids), len(got.token_ids)))
        return (f"conversation {turn.conversation} turn {turn.turn}: output token {first}: "
                f"expected {exp.token_ids[first:first + 4]}, got {got.token_ids[first:first + 4]}")
    return None


def pd_phase(turns: list[Turn], urls: dict[str, str], args: argparse.Namespace,
             tokenizer: Any) -> tuple[list[str], dict[str, Any]]:
    """The workload through the proxy; fills each turn's ``got``, ``p``, ``d``. Returns the
    mismatch lines and the end-of-run checks."""
    mismatches: list[str] = []
    by_key = {(t.conversation, t.turn): t for t in turns}
    with httpx.Client(timeout=4 * args.load_timeout_s + 60) as client:
        p_watch = MetricsDelta(client, urls["prefill"])
        d_watch = MetricsDelta(client, urls["decode"])
        conversations = build_conversations(tokenizer, args.conversations, args.turns)
        for t in range(args.turns):
            for conversation in conversations:
                turn = by_key[(conversation.conversation_id, t)]
                prompt = conversation.next_prompt()
                try:
                    got = complete(client, urls["proxy"], prompt, args.max_tokens,
                                   stream=turn.stream)
                except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                    turn.error = f"{type(exc).__name__}: {exc}"[:300]
                    got = None
                turn.p, turn.d = p_watch.take(), d_watch.take()
                if got is None:  # the conversation goes on with the reference's answer
                    conversation.record(turn.expected.prompt_token_ids, turn.expected.token_ids)
                    continue
                turn.got = got
                if got.finish_reason != "length":
                    turn.error = f"finish_reason {got.finish_reason!r}"
                if (problem := _check(turn, got)) is not None:
                    mismatches.append(problem)
                conversation.record(got.prompt_token_ids, got.token_ids)
        # P's blocks are freed once D's completion notices arrive: wait for it.
        usage = None
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            usage = scrape(client, urls["prefill"]).get(KV_CACHE_USAGE)
            if not usage:
                break
            time.sleep(0.2)
        checks = {"p_kv_cache_usage_after": usage, "p_totals": p_watch.since_start(),
                  "d_totals": d_watch.since_start()}
    return mismatches, checks


def log_counts(logs: dict[str, Path]) -> dict[str, int]:
    """kvbridge's own warnings in the servers' logs (vLLM shows nothing of them elsewhere):
    D's failed pulls and P's leases that expired without a completion notice."""

    def lines(name: str) -> list[str]:
        try:
            return logs[name].read_text(errors="replace").splitlines()
        except (KeyError, OSError):
            return []

    failed = sum("pull of " in line and " failed: " in line for line in lines("decode"))
    expired = 0
    for line in lines("prefill"):
        head, found, _ = line.partition(" lease(s) expired without a completion notice")
        if found and head.split() and head.split()[-1].isdigit():
            expired += int(head.split()[-1])
    return {"failed_loads": failed, "expired_leases": expired}


def _block_bytes(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * BLOCK_SIZE * 4  # float32


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvbridge-vllm-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # For every server: equal block hashes (PYTHONHASHSEED), no core pinning, and one compute
    # thread each, the same for the reference and for P and D (two engines on two cores; the
    # same thread count also keeps the float reductions, hence greedy tokens, alike).
    os.environ.update(PYTHONHASHSEED="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                      OMP_NUM_THREADS=str(args.threads))
    group = ProcessGroup(workdir)
    ok = False
    try:
        model = Path(args.model) if args.model else tiny_model_dir()
        if not (model / "tokenizer.json").is_file():
            print(f"ERROR: --model {model}: no tokenizer.json there", file=sys.stderr)
            return 2
        tokenizer = load_tokenizer(model)
        print(f"model {model}; logs in {workdir}", flush=True)
        timings: dict[str, float] = {}
        turns = reference_phase(group, model, args, tokenizer, timings)
        print(f"reference: up in {timings['reference_start_s']:.0f} s, {len(turns)} requests "
              f"in {timings['reference_run_s']:.1f} s", flush=True)
        ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        t0 = time.perf_counter()
        servers = start_servers(group, [
            (name, serve_command(model, ports[name], args,
                                 kv_config(role, f"{name}-0", args)), urls[name])
            for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        ], args.start_timeout_s)
        proxy = [group.spawn("proxy", [sys.executable, "-m", "kvbridge.connector.serve.proxy",
                                       "--prefill", urls["prefill"], "--decode", urls["decode"],
                                       "--port", str(ports["proxy"])], url=urls["proxy"])]
        group.wait_healthy(proxy, timeout_s=60.0)
        timings["pd_start_s"] = time.perf_counter() - t0
        print(f"P, D and proxy up in {timings['pd_start_s']:.0f} s: " + ", ".join(
            f"{c.name} {c.url} (pid {c.popen.pid})" for c in [*servers, *proxy]), flush=True)
        t0 = time.perf_counter()
        mismatches, checks = pd_phase(turns, urls, args, tokenizer)
        timings["pd_run_s"] = time.perf_counter() - t0
        died = [c.name for c in group.children if not c.running]
        logs = {c.name: c.log_path for c in group.children}
        stop(group.children)
        checks.update(log_counts(logs))
        timings["total_s"] = time.perf_counter() - t_start
        report = build_report(turns, len(mismatches), checks, timings, _block_bytes(model))
        (workdir / "metrics_totals.json").write_text(json.dumps(
            {"prefill": checks["p_totals"], "decode": checks["d_totals"]}, indent=1))
        (workdir / "requests.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in request_rows(turns)))
        errors = [f"{t.conversation}/{t.turn}: {t.error}" for t in turns if t.error]
        errors += [f"{name} exited before the end" for name in died]
        if report["failed_loads"]:
            errors.append(f"D's pulls failed {report['failed_loads']} time(s) (see decode.log)")
        if report["kv_tokens_pulled"] == 0:
            errors.append("D pulled no KV at all (every request was recomputed)")
        if report["p_kv_cache_usage_after"]:
            errors.append(f"P still holds KV blocks after the run "
                          f"(kv_cache_usage {report['p_kv_cache_usage_after']})")
        report["errors"] = len(errors)
        for line in [*mismatches, *errors][:10]:
            print(f"{'MISMATCH' if line in mismatches else 'ERROR'}: {line}", file=sys.stderr)
        print_summary(report)
        print(json.dumps(report, sort_keys=True))
        ok = not mismatches and not errors
        return 0 if ok else 1
    except StartupError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        print(json.dumps({"errors": 1, "mismatches": None, "startup_error": str(exc)[:300]}))
        return 1
    finally:
        stop(group.children)
        if ok and own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    return run_stopping_children(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
