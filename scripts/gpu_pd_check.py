"""The GPU half of ``scripts/gpu_check.sh``: P/D handoffs between two vLLM engines on CUDA.

Run by that script in its CUDA venv; it reuses the vLLM suite's test node (``tests/vllm``:
one ``vllm.LLM`` per process, JSON lines) with GPU settings: ``gpu_memory_utilization`` 0.3
per engine (two engines share one GPU), ``KVBRIDGE_GPU_DTYPE`` (default bfloat16). It prints
one line per check and exits 1 if any failed:

- P/D, one rank each: prompts of 31, 64 and 1,000 tokens; D's greedy tokens against a single
  engine's; D's first-token latency with the handoff against computing a fresh prompt of the
  same length itself ("load vs recompute");
- prefix reuse: a prompt whose 640-token prefix D already holds from an earlier handoff (D
  pulls only the rest);
- tensor parallel (with 2 GPUs or more): P TP=2 -> D TP=2, TP=1 -> TP=2, TP=2 -> TP=1. A
  pairing whose KV cache layout cannot move part of a block (FlashAttention's "NHD") is
  reported as such: D recomputed, the line says how many loads failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))

import _model  # noqa: E402
from _harness import (  # noqa: E402
    BLOCK,
    Node,
    kvbridge_config,
    prefill_requests,
    request,
    start_nodes,
    tokens,
)

GPU_LLM = {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": None,
           "dtype": os.environ.get("KVBRIDGE_GPU_DTYPE", "bfloat16")}
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
N_NEW = 8
SHARED = tokens(100, 20 * BLOCK)
PROMPTS = {
    "t31": tokens(2, 31), "t64": tokens(5, 64), "t1000": tokens(72, 1000),
    "fresh1000": tokens(90, 1000), "shared_a": SHARED + tokens(7, 7),
    "shared_b": SHARED + tokens(8, 45),
    **{f"tp{g}_{n}": tokens(200 + 10 * i + j, n)
       for i, g in enumerate("abc") for j, n in enumerate((31, 64, 1000))},
}
failures: list[str] = []


def node(name: str, model: Path, log_dir: Path, role: str | None, tp: int = 1) -> Node:
    config = None if role is None else kvbridge_config(role, f"{name}-engine", policy="recompute")
    return Node(name, model=model, log_dir=log_dir, kv_transfer_config=config,
                llm={**GPU_LLM, **(TP2 if tp == 2 else {})})


def check(label: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {label}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(label)


def handover(p: Node, d: Node, names: list[str], reference: dict, label: str) -> dict:
    tickets = [o["kv_transfer_params"] for o in p.generate(prefill_requests(
        [PROMPTS[n] for n in names]))]
    before = d.stats()
    outs = d.generate([request(PROMPTS[n], N_NEW, t) for n, t in zip(names, tickets, strict=True)])
    after = d.stats()
    loads = after["num_loads"] - before["num_loads"]
    failed = after["num_failed_loads"] - before["num_failed_loads"]
    for name, out in zip(names, outs, strict=True):
        check(f"{label} {name}: tokens equal a single engine's",
              out["token_ids"] == reference[name], f"{loads} loads, {failed} failed")
    return {n: o for n, o in zip(names, outs, strict=True)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, required=True)
    args = parser.parse_args()
    cache = Path(os.environ.get("KVBRIDGE_CACHE", Path.home() / ".cache" / "kvbridge-vllm"))
    model = _model.tiny_llama(cache / "models", tokenizer=True)
    log_dir = cache / "gpu-check-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {args.gpus} GPU(s), logs in {log_dir}", flush=True)

    ref = node("ref", model, log_dir, None).wait_ready()
    try:
        names = list(PROMPTS)
        outs = ref.generate([request(PROMPTS[n], N_NEW) for n in names])
        reference = {n: o["token_ids"] for n, o in zip(names, outs, strict=True)}
    finally:
        ref.stop()

    p, d = node("p", model, log_dir, "producer"), node("d", model, log_dir, "consumer")
    try:
        start_nodes(p, d)
        handover(p, d, ["t31", "t64"], reference, "P/D")
        outs = handover(p, d, ["t1000"], reference, "P/D")  # alone: its latency is its own
        handover(p, d, ["shared_a"], reference, "P/D")
        handover(p, d, ["shared_b"], reference, "prefix reuse (640 tokens already on D)")
        (fresh,) = d.generate([request(PROMPTS["fresh1000"], N_NEW)])
        load_s, recompute_s = outs["t1000"]["first_token_latency"], fresh["first_token_latency"]
        print(f"     D's first token, 1,000 tokens: with the handoff {load_s * 1e3:.1f} ms, "
              f"recomputed {recompute_s * 1e3:.1f} ms ({load_s / recompute_s:.2f})", flush=True)
    finally:
        d.stop()
        p.stop()

    if args.gpus < 2:
        print("skip tensor parallel: TP=2 engines need 2 GPUs, found 1", flush=True)
    else:
        for group, (p_tp, d_tp) in zip("abc", ((2, 2), (1, 2), (2, 1)), strict=True):
            p = node(f"p-tp{p_tp}", model, log_dir, "producer", p_tp)
            d = node(f"d-tp{d_tp}", model, log_dir, "consumer", d_tp)
            try:
                start_nodes(p, d)
                handover(p, d, [f"tp{group}_{n}" for n in (31, 64, 1000)], reference,
                         f"P TP={p_tp} -> D TP={d_tp}")
            finally:
                d.stop()
        p.stop()
    print(f"gpu_check: {'all checks passed' if not failures else f'{len(failures)} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
