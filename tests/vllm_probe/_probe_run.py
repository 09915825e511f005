"""Drive ProbeConnector through a stock vLLM and summarise what it saw (scaffolding).

    python tests/vllm_probe/_probe_run.py {inproc|mp} [--policy recompute|fail] [--fail-block N]
                                               [--out DIR]

inproc: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler and worker in this process);
mp:     ``distributed_executor_backend="mp"`` (frontend, EngineCore and Worker processes).

Round 1 prefills a 70-token prompt held by the connector (``probe_hold``) plus a short one; the
worker dumps the held request's blocks, which are compared with Hugging Face's K/V to pin
down the CPU backend's layout. Round 2 sends the same prompt with round 1's returned
``kv_transfer_params``: the connector loads the dumped blocks asynchronously (after two
``None`` answers), and D's greedy tokens are compared with round 1's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "vllm"))  # _model, the suite's tiny Llama
os.environ["PYTHONPATH"] = f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

PROMPT = list(range(20, 90))  # 70 tokens: 3 blocks of 32, the last partial
SHORT = [1, 7, 42, 99, 300, 5, 17, 250, 11, 3]
N_NEW = 8


def hf_kv(path: Path, ids: list[int]):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    layers = []
    for i in range(model.config.num_hidden_layers):
        if hasattr(cache, "layers"):
            k, v = cache.layers[i].keys, cache.layers[i].values
        else:
            k, v = cache[i]
        layers.append((k[0], v[0]))  # [kv_heads, seq, head_dim]
    return layers


def check_layout(dump: dict, hf_layers, n_tokens: int, block_size: int) -> dict:
    """Which reading of vLLM's per-layer block tensor reproduces HF's K and V."""
    import torch

    results = {}
    for name, blocks in dump["layers"].items():
        li = int(name.split("layers.")[1].split(".")[0])
        k_ref, v_ref = hf_layers[li]
        h, _, d = k_ref.shape
        nb = blocks.shape[0]
        flat = blocks.reshape(nb, h, -1)  # per (block, head) run of 2*block_size*head_dim
        cand = {}
        # A: per (block, head) [K: block_size x d][V: block_size x d] (view [nb,h,2bs,d], chunk)
        kv = flat.view(nb, h, 2 * block_size, d)
        cand["A: [B, H, (K|V) x N, C] = view(nb,h,2*bs,d).chunk(2,dim=2)"] = (
            kv[:, :, :block_size], kv[:, :, block_size:])
        # C: per (block, head) [K^T: d x block_size][V: block_size x d]
        kt = kv[:, :, :block_size].reshape(nb, h, d, block_size).transpose(2, 3)
        cand["C: per (block, head) K^T [C, N] then V [N, C]"] = (kt, kv[:, :, block_size:])
        # B: per (block, head, token) [K: d | V: d] (last dim 2*d split in halves)
        kv2 = flat.view(nb, h, block_size, 2 * d)
        cand["B: [B, H, N, (K|V) x C] = last dim split"] = (kv2[..., :d], kv2[..., d:])
        res = {}
        for label, (kc, vc) in cand.items():
            # [nb, h, bs, d] -> [h, nb*bs, d]
            k = kc.permute(1, 0, 2, 3).reshape(h, nb * block_size, d)[:, :n_tokens]
            v = vc.permute(1, 0, 2, 3).reshape(h, nb * block_size, d)[:, :n_tokens]
            res[label] = (torch.allclose(k, k_ref, atol=1e-4, rtol=1e-4)
                          and torch.allclose(v, v_ref, atol=1e-4, rtol=1e-4),
                          float((k - k_ref).abs().max()), float((v - v_ref).abs().max()))
        results[name] = res
    return results


def summarise(log_path: Path, main_pid: int) -> dict:
    recs = [json.loads(line) for line in log_path.read_text().splitlines()]
    procs: dict[int, str] = {}
    for r in recs:
        procs.setdefault(r["pid"], "main" if r["pid"] == main_pid else f"other-{r['role']}")
    where: dict[str, set] = defaultdict(set)
    for r in recs:
        where[r["method"]].add(f"{r['role']}@{procs[r['pid']]}:{r['thread']}")
    # Call order of the first step that prefilled something: scheduler calls from the
    # get_num_new_matched_tokens that preceded it to the update_connector_output after it.
    first = next(r for r in recs if r["method"] == "build_connector_meta"
                 and r["args"]["scheduler_output"]["new"])
    step = first["args"]["returns"]["ProbeMeta"]
    order, last = [], None
    for r in sorted(recs, key=lambda r: r["t"]):
        if r["role"] == "S" and r["method"] in ("get_num_new_matched_tokens",
                                                "update_state_after_alloc", "on_new_request") \
                and r["step"] == step - 1:
            pass
        elif r["step"] != step:
            continue
        m = f"{r['role']} {r['method']}"
        if r["method"] in ("wait_for_layer_load", "save_kv_layer"):
            m += f"({r['args']['layer_name'].split('layers.')[1].split('.')[0]})"
        if m != last:
            order.append(m)
        last = m
        if r["role"] == "S" and r["method"] == "update_connector_output":
            break
    return {"pids": {str(p): n for p, n in procs.items()}, "where": {k: sorted(v) for k, v in
            sorted(where.items())}, "prefill_step": step, "order": order}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["inproc", "mp"])
    ap.add_argument("--policy", default="recompute", choices=["recompute", "fail"])
    ap.add_argument("--fail-block", type=int, default=-1)
    ap.add_argument("--out", default="/tmp/probe_out")
    args = ap.parse_args()
    out = Path(args.out) / f"{args.mode}-{args.policy}-{args.fail_block}"
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "calls.jsonl"
    log_path.unlink(missing_ok=True)
    dump_dir = out / "dump"

    from kvbridge.connector.serve.demo import tiny_checkpoint as _model
    model_path = _model.tiny_llama()
    if args.mode == "inproc":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kw = dict(model=str(model_path), skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, kv_cache_memory_bytes=32 << 20,
              max_model_len=512, max_num_seqs=4, seed=0, enable_prefix_caching=False,
              disable_log_stats=False,
              kv_transfer_config={
                  "kv_connector": "ProbeConnector",
                  "kv_connector_module_path": "_probe_connector",
                  "kv_role": "kv_both",
                  "kv_load_failure_policy": args.policy,
                  "kv_connector_extra_config": {"log_path": str(log_path),
                                                "dump_dir": str(dump_dir)}})
    if args.mode == "mp":
        kw["distributed_executor_backend"] = "mp"
    t0 = time.monotonic()
    llm = LLM(**kw)
    t_start = time.monotonic() - t0

    def sp(params=None):
        return SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True,
                              extra_args={"kv_transfer_params": params} if params else None)

    t0 = time.monotonic()
    r1 = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": SHORT}],
                      [sp({"probe_hold": True}), sp()])
    t_r1 = time.monotonic() - t0
    ticket = r1[0].kv_transfer_params
    report = {"mode": args.mode, "engine_start_s": round(t_start, 1),
              "round1_s": round(t_r1, 2),
              "r1_request_ids": [r.request_id for r in r1],
              "ticket": ticket, "r1_tokens": list(r1[0].outputs[0].token_ids),
              "r1_metrics": repr(r1[0].metrics)}

    d_params = dict(ticket or {}, probe_none_polls=2)
    if args.fail_block >= 0:
        d_params["probe_fail_block"] = args.fail_block
    t0 = time.monotonic()
    r2 = llm.generate([{"prompt_token_ids": PROMPT}], [sp(d_params)])
    report["round2_s"] = round(time.monotonic() - t0, 2)
    report["r2_tokens"] = list(r2[0].outputs[0].token_ids)
    report["r2_finish_reason"] = r2[0].outputs[0].finish_reason
    report["r2_kv_transfer_params"] = r2[0].kv_transfer_params
    report["d_matches_p"] = report["r2_tokens"] == report["r1_tokens"]
    del llm

    import torch

    dump = torch.load(ticket["probe_load_from"])
    layout = check_layout(dump, hf_kv(model_path, PROMPT), len(PROMPT), 32)
    report["layout"] = {n: {k: v for k, v in res.items()} for n, res in layout.items()}
    report["dump_block_ids"] = dump["block_ids"]
    report["dump_shapes"] = {n: list(t.shape) for n, t in dump["layers"].items()}
    report["calls"] = summarise(log_path, os.getpid())
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
