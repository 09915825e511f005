"""D's KV load in real vLLM: kvbridge against vLLM's own connectors and against recomputing.

    $VENV/bin/python benchmarks/bench_vllm_pd.py [--prompts 5] [--rounds 3] [--cases ...]

Run it with the vLLM venv (``make test-vllm`` builds it; NixlConnector needs ``pip install
--no-deps nixl==1.5.1 nixl-cu12==1.5.1`` there). For each case a prefill engine P (vLLM's
multiprocess engine, which keeps stepping while it holds blocks) and a decode engine D (in
process) run as two processes at once; P prefills every prompt with ``do_remote_decode`` and
``max_tokens=1``, D then serves them one at a time with P's ticket, and the figure is D's
first-token latency (``RequestOutput.metrics.first_token_latency``), median over the prompts.
Every D answer is checked token for token against a plain engine's.

Cases (same prompts, same run; with ``--rounds N`` the whole list runs N times, case after
case, and each figure is the median over every round, so a host that drifts during the run
weighs on every case alike):
- ``kvbridge`` / ``nixl`` / ``example``: the tiny Llama with kvbridge's connector, vLLM's
  ``NixlConnector`` and vLLM's ``ExampleConnector`` (shared-storage files);
- ``kvbridge`` runs the defaults (``load_mode`` "auto": a handoff D reads one-sided from P's
  block board loads inside the step that computes it); ``kvbridge_async`` / ``kvbridge_sync``:
  every pull over later steps / inside the step (as ``ExampleConnector`` loads);
- ``kvbridge_asked``: kvbridge with P's block board off (``cma_board: false``): every pull
  waits for P's answer and runs over later steps, as before one-sided reads
  (``kvbridge.transport.cma_board``);
- ``kvbridge_ucx`` / ``kvbridge_ucx_switch`` and ``kvbridge_asked_switch``: every pull over
  UCX (``cma: false``), and the UCX and asked cases with the opt-in ``gil_switch_interval_s``
  (0.5 ms for the whole process): ``ucx_switch_over_ucx`` / ``asked_switch_over_asked`` say
  what that process-wide setting buys;
- ``kvbridge_small`` / ``recompute_small``: a Llama shaped like kvbridge's ``small`` model (six
  layers, hidden 384, 6 heads over 2 KV heads of 64), whose prefill costs as much per KV byte
  as the main job's, with kvbridge and with D computing the prompt itself;
- ``wrong_ticket`` / ``wrong_ticket_p``: kvbridge with vLLM's ``kv_load_failure_policy``
  "recompute"; D serves prompt 0 with its own ticket (D connects to P), then each prompt ``i``
  twice, both on an empty prefix cache (``reset_prefix_cache``): with the ticket P gave for
  prompt ``i % prompts + 1`` (another prompt's), and with no ticket at all (a plain recompute
  in the same engine). ``wrong_ticket`` hands the ticket as P made it (D refuses it by its
  ``remote_prompt_digest``, before any read); ``wrong_ticket_p`` without that digest (D's
  scheduler half finds another prompt's blocks on P's block board before planning the load,
  ``connector.ticket_board``; with ``--kvbridge-extra '{"cma_board": false}'`` P's hash check
  refuses the blocks and D's load ends at P's answer). The two run back to back,
  in alternating order; the figure is the median over prompts of the first token after the
  wrong ticket over the plain recompute's (needs ``--prompts`` >= 2);
- the CPU an idle kvbridge P engine uses (all its processes, over ``--idle-s`` seconds);
- ``P cores`` / ``p_holding_cores``: the CPU P's processes use while D serves the prompts, from
  P's tickets to D's last answer (a P that holds blocks for D keeps stepping: vLLM steps an
  engine while it holds finished requests' blocks, and its multiprocess engine spins between
  steps; on a small host that takes the cores D's forward and pulls need).

Prints a table and, last, one JSON object with the ratios and their targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import add_markdown_option, finish

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SMALL = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
             num_key_value_heads=2, head_dim=64, intermediate_size=1024)
# checkpoint name -> Llama shape; "small4": the four-layer variant issue 31's benchmark runs on
SHAPES = {"small": SMALL, "small4": {**SMALL, "num_hidden_layers": 4}}
TARGETS = {"kvbridge_over_nixl": 0.5, "kvbridge_over_example": 1.0,
           "kvbridge_sync_over_example": 1.0, "kvbridge_over_recompute_small": 0.2,
           "wrong_ticket_over_recompute": 1.2, "wrong_ticket_p_over_recompute": 1.2,
           "idle_cores": 0.05}
WRONG_TICKETS = {"kvbridge_wrong": True, "kvbridge_wrong_p": False}
"""The wrong-ticket cases' connectors: whether D gets the ticket's ``remote_prompt_digest``."""


def _model(kind: str) -> str:
    from kvbridge.connector.serve.demo import tiny_llama

    if kind == "tiny":
        return str(tiny_llama())
    cache = Path(os.environ.get("KVBRIDGE_CACHE", Path.home() / ".cache" / "kvbridge-vllm"))
    path = cache / "models" / f"{kind}-llama-bench"
    if not (path / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, initializer_range=0.5, tie_word_embeddings=False,
                             torch_dtype="float32", max_position_embeddings=8192, **SHAPES[kind])
        LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(path)
    return str(path)


def _transfer_config(connector: str, role: str, storage: str,
                     kvbridge_extra: dict | None = None) -> dict | None:
    if connector == "kvbridge" or connector in WRONG_TICKETS:
        policy = "recompute" if connector in WRONG_TICKETS else "fail"
        return {"kv_connector": "KVBridgeConnector",
                "kv_connector_module_path": "kvbridge.connector.vllm",
                "kv_role": role, "engine_id": role, "kv_load_failure_policy": policy,
                "kv_connector_extra_config": dict(kvbridge_extra or {})}
    if connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                "engine_id": role}
    if connector == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": storage}}
    return None


def _prompts(num: int, num_tokens: int) -> list[list[int]]:
    import random

    return [[random.Random(1000 + i).randrange(1, 512) for _ in range(num_tokens)]
            for i in range(num + 1)]  # prompt 0 warms D up


def child(args: argparse.Namespace) -> None:
    """One engine: ``p`` prefills and waits; ``d`` decodes with P's tickets (or recomputes)."""
    out = Path(args.out)
    from vllm import LLM, SamplingParams

    llm = LLM(model=_model(args.model), skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, kv_cache_memory_bytes=args.kv_bytes,
              max_model_len=args.tokens + 64, max_num_seqs=2, seed=0, disable_log_stats=False,
              kv_transfer_config=_transfer_config(args.connector, f"kv_{args.role}",
                                                  str(out / "storage"),
                                                  json.loads(args.kvbridge_extra)))
    prompts = _prompts(args.prompts, args.tokens)

    def greedy(max_tokens: int, params: dict | None = None) -> SamplingParams:
        extra = {"kv_transfer_params": params} if params is not None else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              extra_args=extra)

    if args.role == "producer":
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               greedy(1, {"do_remote_decode": True}))
        (out / "tickets.json").write_text(json.dumps([o.kv_transfer_params for o in outputs]))
        while not (out / "done").exists():
            time.sleep(0.05)
        return
    if args.connector == "none":
        tickets = [None] * len(prompts)
    else:
        while not (out / "tickets.json").exists():
            time.sleep(0.05)
        tickets = json.loads((out / "tickets.json").read_text())
    results = []

    def serve(prompt: list[int], ticket: dict | None) -> dict:
        (output,) = llm.generate([{"prompt_token_ids": prompt}],
                                 greedy(args.max_tokens, ticket))
        return {"token_ids": list(output.outputs[0].token_ids),
                "ttft_s": output.metrics.first_token_latency}

    if args.connector in WRONG_TICKETS:
        results.append(serve(prompts[0], tickets[0]))  # D connects to P
        for i in range(1, len(prompts)):
            ticket = dict(tickets[i % args.prompts + 1])
            if not WRONG_TICKETS[args.connector]:
                ticket.pop("remote_prompt_digest", None)
            served = {}
            for kind in ("wrong", "plain") if i % 2 else ("plain", "wrong"):  # order alternates
                llm.reset_prefix_cache()
                served[kind] = serve(prompts[i], ticket if kind == "wrong" else None)
            results.append({**served["wrong"], "recompute_ttft_s": served["plain"]["ttft_s"],
                            "recompute_token_ids": served["plain"]["token_ids"]})
    else:
        results = [serve(p, t) for p, t in zip(prompts, tickets, strict=True)]
    if args.connector == "kvbridge" or args.connector in WRONG_TICKETS:  # D in process
        stats = llm.llm_engine.engine_core.engine_core.scheduler.connector.stats.snapshot()
        results[0]["kvbridge_stats"] = stats
    # P stops on "done", which the parent writes after measuring P's idle CPU (writing it here
    # made that measure P's shutdown).
    (out / "results.json").write_text(json.dumps(results))


def _spawn(args: argparse.Namespace, role: str, connector: str, model: str, out: Path,
           env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", "--role", role, "--connector", connector,
           "--model", model, "--out", str(out), "--prompts", str(args.prompts),
           "--tokens", str(args.tokens), "--max-tokens", str(args.max_tokens),
           "--kv-bytes", str(args.kv_bytes), "--kvbridge-extra", args.kvbridge_extra]
    log = open(out / f"{role}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``pid`` and each of its descendants, by pid."""
    import psutil

    proc = psutil.Process(pid)
    seconds: dict[int, float] = {}
    for p in [proc, *proc.children(recursive=True)]:
        try:
            times = p.cpu_times()
            seconds[p.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return seconds


def _idle_cores(pid: int, idle_s: float) -> float:
    """Cores a process tree used over ``idle_s`` seconds (processes alive at both ends)."""
    before = _cpu_seconds(pid)
    time.sleep(idle_s)
    after = _cpu_seconds(pid)
    return sum(after[p] - before[p] for p in before.keys() & after.keys()) / idle_s


def run_case(args: argparse.Namespace, name: str, connector: str, model: str,
             extra: dict) -> dict:
    """One P/D pair (or D alone for ``none``); returns D's results and, for kvbridge on the
    tiny model, P's idle CPU. ``extra`` is merged into kvbridge's extra config."""
    out = Path(tempfile.mkdtemp(prefix=f"bench-vllm-{name}-"))
    # The tests' tiny Llama declares 1,024 positions; RoPE extends past them (random weights).
    base = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    procs = []
    idle_cores = holding_cores = None
    args = argparse.Namespace(**{**vars(args), "kvbridge_extra": json.dumps(
        {**json.loads(args.kvbridge_extra), **extra})})
    try:
        if connector != "none":
            procs.append(_spawn(args, "producer", connector, model, out,
                                {**base, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"}))
        procs.append(_spawn(args, "consumer", connector, model, out,
                            {**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                             "VLLM_NIXL_SIDE_CHANNEL_PORT": "5621"}))
        deadline = time.monotonic() + args.case_timeout_s
        holding_from: tuple[float, dict[int, float]] | None = None
        while not (out / "results.json").exists():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"case {name} failed; logs in {out}")
            if holding_from is None and connector != "none" and (out / "tickets.json").exists():
                holding_from = (time.monotonic(), _cpu_seconds(procs[0].pid))
            time.sleep(0.05)
        if holding_from is not None:  # P held the prompts' blocks while D served them
            started, before = holding_from
            after = _cpu_seconds(procs[0].pid)
            holding_cores = sum(after[p] - before[p] for p in before.keys() & after.keys()) / (
                time.monotonic() - started)
        if name == "kvbridge" and args.idle_s > 0:
            time.sleep(1.0)  # the last lease released, P idle
            idle_cores = _idle_cores(procs[0].pid, args.idle_s)
        results = json.loads((out / "results.json").read_text())
        stats = results[0].get("kvbridge_stats")
        if stats is not None:
            print(f"{name}: D pulled {stats['num_loads']} time(s), {stats['num_failed_loads']} "
                  f"failed, transfer p50 {stats['transfer_s_p50']}, "
                  f"same-host bytes {stats['bytes_received_same_host']}, one-sided "
                  f"{stats['num_one_sided_loads']} (fell back {stats['num_board_fallbacks']}), "
                  f"in the step {stats['num_sync_loads']}",
                  flush=True)
        return {"results": results, "idle_cores": idle_cores, "holding_cores": holding_cores,
                "stats": stats}
    finally:
        (out / "done").write_text("1")
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


CASES = {  # name -> (connector, model, kvbridge extra config of the case)
    "reference": ("none", "tiny", {}),
    "kvbridge": ("kvbridge", "tiny", {}),
    "kvbridge_async": ("kvbridge", "tiny", {"load_mode": "async"}),
    "kvbridge_sync": ("kvbridge", "tiny", {"load_mode": "sync"}),
    "kvbridge_asked": ("kvbridge", "tiny", {"cma_board": False}),
    # every pull over UCX through the connector loop, with Python's GIL switch interval and
    # with the opt-in gil_switch_interval_s (is the process-wide setting worth offering?)
    "kvbridge_ucx": ("kvbridge", "tiny", {"cma": False}),
    "kvbridge_ucx_switch": ("kvbridge", "tiny", {"cma": False, "gil_switch_interval_s": 0.0005}),
    "kvbridge_asked_switch": ("kvbridge", "tiny", {"cma_board": False,
                                                   "gil_switch_interval_s": 0.0005}),
    "nixl": ("nixl", "tiny", {}),
    "example": ("example", "tiny", {}),
    "recompute_small": ("none", "small", {}),
    "kvbridge_small": ("kvbridge", "small", {}),
    "wrong_ticket": ("kvbridge_wrong", "tiny", {}),
    "wrong_ticket_p": ("kvbridge_wrong_p", "tiny", {}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the list of cases this many times, interleaved")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-bytes", type=int, default=256 << 20)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--case-timeout-s", type=float, default=300.0)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--kvbridge-extra", default="{}",
                        help="JSON merged into kvbridge's kv_connector_extra_config (P and D), "
                        'e.g. \'{"idle_pull_wait_s": 0}\' for the step-polling baseline')
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--connector", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    add_markdown_option(parser)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in args.cases}
    for round_no in range(args.rounds):
        for name in args.cases:
            connector, model, extra = CASES[name]
            started = time.monotonic()
            runs[name].append(run_case(args, name, connector, model, extra))
            print(f"{name:16s} round {round_no + 1} done in {time.monotonic() - started:5.1f} s",
                  flush=True)
    expected = {m: runs[r][0]["results"] for r, m in (("reference", "tiny"),
                                                      ("recompute_small", "small")) if r in runs}
    mismatches = 0
    medians: dict[str, float] = {}
    paired: dict[str, float] = {}  # the wrong-ticket cases' median ratio, prompt by prompt
    holding_cores: dict[str, float] = {}
    print(f"\n{'case':16s} {'D TTFT p50 ms':>14s} {'min':>8s} {'max':>8s} {'P cores':>8s}  tokens")
    for name, case_runs in runs.items():
        # prompt 0 of each round warmed D up
        ttfts = [r["ttft_s"] for run in case_runs for r in run["results"][1:]]
        medians[name] = statistics.median(ttfts)
        ref = expected.get(CASES[name][1])
        equal = ref is not None and all(
            a["token_ids"] == b["token_ids"]
            for run in case_runs for a, b in zip(run["results"], ref, strict=True))
        mismatches += 0 if equal or ref is None else 1
        verdict = "n/a" if ref is None else ("equal" if equal else "DIFFER")
        holding = [run["holding_cores"] for run in case_runs if run["holding_cores"] is not None]
        if holding:
            holding_cores[name] = round(statistics.median(holding), 2)
        print(f"{name:16s} {medians[name] * 1e3:14.1f} {min(ttfts) * 1e3:8.1f} "
              f"{max(ttfts) * 1e3:8.1f} {holding_cores.get(name, float('nan')):8.2f}  {verdict}")
        if CASES[name][0] in WRONG_TICKETS:  # its plain recomputes, same engine, same prompts
            rows = [r for run in case_runs for r in run["results"][1:]]
            plain = [r["recompute_ttft_s"] for r in rows]
            medians[f"{name}_recompute"] = statistics.median(plain)
            # each prompt's pair ran back to back: their ratio cancels the host's drift
            paired[f"{name}_over_recompute"] = round(statistics.median(
                r["ttft_s"] / r["recompute_ttft_s"] for r in rows), 3)
            same = all(r["token_ids"] == r["recompute_token_ids"] for r in rows)
            mismatches += 0 if same else 1
            print(f"{'  (recompute)':16s} {statistics.median(plain) * 1e3:14.1f} "
                  f"{min(plain) * 1e3:8.1f} {max(plain) * 1e3:8.1f} {'':8s}  "
                  f"{'equal' if same else 'DIFFER'}")
    report: dict = {"benchmark": "vllm_pd", "prompts": args.prompts, "rounds": args.rounds,
                    "tokens": args.tokens,
                    "kvbridge_extra": json.loads(args.kvbridge_extra),
                    "ttft_p50_s": medians, "p_holding_cores": holding_cores,
                    "mismatches": mismatches, "targets": TARGETS}
    for key, (a, b) in {"kvbridge_over_nixl": ("kvbridge", "nixl"),
                        "kvbridge_over_example": ("kvbridge", "example"),
                        "kvbridge_sync_over_example": ("kvbridge_sync", "example"),
                        "kvbridge_asked_over_example": ("kvbridge_asked", "example"),
                        "kvbridge_async_over_example": ("kvbridge_async", "example"),
                        "ucx_switch_over_ucx": ("kvbridge_ucx_switch", "kvbridge_ucx"),
                        "asked_switch_over_asked": ("kvbridge_asked_switch", "kvbridge_asked"),
                        "kvbridge_over_recompute_small": ("kvbridge_small",
                                                          "recompute_small")}.items():
        if a in medians and b in medians:
            report[key] = round(medians[a] / medians[b], 3)
    report.update(paired)
    idle = [run["idle_cores"] for run in runs.get("kvbridge", []) if run["idle_cores"] is not None]
    if idle:
        report["idle_cores"] = round(statistics.median(idle), 3)
    finish(report, name="vllm_pd", title="vLLM P/D: D's first token, kvbridge / vLLM's connectors",
           markdown=args.markdown)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
