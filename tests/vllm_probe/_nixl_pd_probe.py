"""vLLM's own NixlConnector P/D on this CPU: P and D as two processes, tiny model (a probe).

    python tests/vllm_probe/_nixl_pd_probe.py [--wrong-ticket]

Needs ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`` in the vLLM venv. The worker-side
connector is a process-wide global in vLLM, so P and D run as separate processes, each with its
own ``VLLM_NIXL_SIDE_CHANNEL_PORT``. The driver (this file, no vLLM import) starts P, which
computes the single-instance reference (a plain greedy run) and then prefills each prompt
with ``{"do_remote_decode": true}`` and ``max_tokens=1``; P's returned ``kv_transfer_params``
go to D, which decodes with them. D's tokens must equal the reference token for token.
``--wrong-ticket`` also hands D one prompt with another prompt's params (vLLM does not check).

Children talk to the driver in JSON lines on stdout prefixed with ``@@``; everything else is
vLLM's log, kept in OUT/{p,d}.log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
N_NEW = 12
PROMPTS = [list(range(20, 90)), [(7 * i + 3) % 500 for i in range(100)],
           [1, 7, 42, 99, 300, 5, 17, 250, 11, 3]]  # 70, 100 and 10 tokens


def _engine(role: str, port: int):
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    sys.path.insert(0, str(HERE))
    import _model
    from vllm import LLM

    return LLM(model=str(_model.tiny_llama()), skip_tokenizer_init=True, enforce_eager=True,
               dtype="float32", block_size=32, kv_cache_memory_bytes=32 << 20,
               max_model_len=512, max_num_seqs=4, seed=0,
               kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": role,
                                   "kv_buffer_device": "cpu",
                                   "engine_id": f"{role}-{port}"})


def _say(**kw) -> None:
    print("@@" + json.dumps(kw), flush=True)


def child_p(port: int, extra: bool) -> None:
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = _engine("kv_producer", port)
    start = time.monotonic() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    t0 = time.monotonic()
    ref = [list(r.outputs[0].token_ids) for r in
           llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)]
    t_ref = time.monotonic() - t0
    _say(kind="p_ready", start_s=round(start, 1), ref_s=round(t_ref, 2), ref=ref)
    sys.stdin.readline()  # the driver says go once D is up too
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                             extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    t0 = time.monotonic()
    # With --wrong-ticket, prompt 1 is prefilled twice so the wrong use has its own hold.
    todo = PROMPTS + ([PROMPTS[1]] if extra else [])
    outs = llm.generate([{"prompt_token_ids": p} for p in todo], prefill)
    _say(kind="p", prefill_s=round(time.monotonic() - t0, 2),
         first=[list(o.outputs[0].token_ids) for o in outs],
         tickets=[o.kv_transfer_params for o in outs],
         ttft=[getattr(o.metrics, "first_token_latency", None) for o in outs])
    sys.stdin.readline()  # stay up (holding the blocks) until the driver says so
    del llm


def child_d(port: int) -> None:
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = _engine("kv_consumer", port)
    _say(kind="d_ready", start_s=round(time.monotonic() - t0, 1))
    jobs = json.loads(sys.stdin.readline())  # [[prompt, params], ...]
    sps = [SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True,
                          extra_args={"kv_transfer_params": params}) for _, params in jobs]
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], sps)
    _say(kind="d", decode_s=round(time.monotonic() - t0, 2),
         tokens=[list(o.outputs[0].token_ids) for o in outs],
         finish=[o.outputs[0].finish_reason for o in outs],
         returned=[o.kv_transfer_params for o in outs],
         ttft=[getattr(o.metrics, "first_token_latency", None) for o in outs])
    sys.stdin.readline()
    del llm


def _read_msg(proc: subprocess.Popen, log) -> dict:
    for line in proc.stdout:
        if line.startswith("@@"):
            return json.loads(line[2:])
        log.write(line)
    raise RuntimeError(f"child exited rc={proc.wait()} without a result; see {log.name}")


def main() -> int:
    wrong = "--wrong-ticket" in sys.argv
    out = Path(os.environ.get("PROBE_OUT", "/tmp/nixl_pd_probe"))
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t_all = time.monotonic()

    def spawn(args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([py, __file__, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)

    def send(proc: subprocess.Popen, obj) -> None:
        proc.stdin.write(json.dumps(obj) + "\n")
        proc.stdin.flush()

    with open(out / "p.log", "w") as plog, open(out / "d.log", "w") as dlog:
        # One engine starts at a time (2 cores); D is up before P prefills, so D pulls
        # within P's lease (kv_lease_duration, 30 s by default).
        p = spawn(["--child-p", "5611"] + (["x"] if wrong else []))
        d = None
        try:
            p_ready = _read_msg(p, plog)
            d = spawn(["--child-d", "5621"])
            d_ready = _read_msg(d, dlog)
            t0 = time.monotonic()
            send(p, "go")
            pr = _read_msg(p, plog)
            jobs = [[pp, t] for pp, t in zip(PROMPTS, pr["tickets"], strict=False)]
            if wrong:  # prompt 0 again, with (the second) prompt 1's ticket
                jobs.append([PROMPTS[0], pr["tickets"][3]])
            send(d, jobs)
            dr = _read_msg(d, dlog)
            pd_wall = time.monotonic() - t0
            time.sleep(2)  # let P log D's completion notices
            for proc, log in ((d, dlog), (p, plog)):
                send(proc, "bye")
                for line in proc.stdout:
                    log.write(line)
                proc.wait(timeout=120)
        finally:
            for proc in (p, d):
                if proc is not None and proc.poll() is None:
                    proc.kill()
    pr.update(p_ready)
    dr.update(d_ready)
    ok = [dt == rt for dt, rt in zip(dr["tokens"], pr["ref"], strict=False)]
    report = {"p": pr, "d": dr, "prefill_to_decoded_s": round(pd_wall, 2),
              "total_s": round(time.monotonic() - t_all, 1), "match": ok}
    if wrong:
        report["wrong_ticket_tokens"] = dr["tokens"][-1]
        report["wrong_ticket_equals_ref"] = dr["tokens"][-1] == pr["ref"][0]
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if all(ok) else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child-p":
        child_p(int(sys.argv[2]), len(sys.argv) > 3)
    elif len(sys.argv) > 2 and sys.argv[1] == "--child-d":
        child_d(int(sys.argv[2]))
    else:
        sys.exit(main())
