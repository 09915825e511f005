"""One vLLM engine as a test node: a subprocess that serves JSON-line commands (the suite's node).

    python tests/vllm/_node.py '<json settings>'

Run with the vLLM venv's python by ``_harness.Node``; never imported by the tests. Settings:
``model`` (checkpoint dir), ``kv_transfer_config`` (a mapping, or null for a plain engine),
``mode`` (``"inproc"``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, scheduler and worker in this
process; ``"mp"``: vLLM's multiprocess engine, EngineCore and Worker processes) and ``llm``
(more ``vllm.LLM`` keyword arguments). The harness sets the mode's environment itself.

The protocol runs on the stdout this process was started with; before vLLM is imported, file
descriptor 1 is pointed at stderr, so everything vLLM (and its children) print goes to the log.
First line out: ``{"ready": true, "pid", "start_s", "mode"}`` (or ``{"ready": false, "error"}``).
Then, one JSON object per line in, one out:

- ``{"cmd": "generate", "requests": [{"prompt_token_ids", "max_tokens", "kv_transfer_params"}]}``
  -> ``{"ok": true, "outputs": [{"token_ids", "kv_transfer_params", "finish_reason",
  "first_token_latency", "num_cached_tokens"}], "wall_s"}``; greedy, ``ignore_eos``.
- ``{"cmd": "stats"}`` -> ``{"ok": true, "stats": <the scheduler-side connector's
  stats.snapshot()> | null, "rank_stats": {tp_rank: snapshot}}`` (each worker rank's own, a
  tensor-parallel engine's; in-process only: in mp mode the scheduler lives in EngineCore),
  ``"index_available"``: whether its index backend answered its last call, ``"index_resyncs"``:
  how many resyncs of its cached set landed (both null: no index).
- ``{"cmd": "metrics"}`` -> ``{"ok": true, "metrics": {name: value}}``: vLLM's own metrics as
  ``llm.get_metrics()`` reads them from this process's Prometheus registry (the frontend's, in
  both modes), counters named ``vllm:kvbridge_*``, ``vllm:external_prefix_cache_hits`` and
  ``vllm:prompt_tokens_cached_by_source:<source>`` (summed over their other labels), and the
  histogram ``vllm:kvbridge_load_time_seconds`` as ``..._count`` and ``..._sum``.
- ``{"cmd": "state"}`` -> ``{"ok": true, "state": {"requests", "free_blocks", "num_blocks",
  "kv_cache_groups"} | null}``: the scheduler's request count (held requests included), free
  KV blocks and its KV cache groups' spec kinds (``"FullAttentionSpec"``, ...; in-process
  only).
- ``{"cmd": "stop"}`` -> ``{"ok": true}``, then the engine is shut down and the process exits 0.

Any failure of a command answers ``{"ok": false, "error", "traceback"}`` and the node goes on.

Stepping (measured on vLLM 0.32.0): in-process nothing steps the engine between ``generate()``
calls, so a producer would hold its blocks (and never report ``finished_sending``), and a
consumer would not pass its finished requests to the worker half (no completion notice), until
the next ``generate()``. Between commands this loop therefore calls the public
``llm.llm_engine.step()`` every ``STEP_INTERVAL_S``; it returns at once when the scheduler has
no requests (``EngineCore.step`` checks ``scheduler.has_requests()``, which counts held
requests and finished ones not yet passed on), so an idle node costs next to nothing.
``llm_engine.has_unfinished_requests()`` is no guide: it asks the frontend's output
processor, which forgets a request once its output is out. In mp mode EngineCore's own busy
loop steps while it holds requests, and ``step()`` would block waiting for output, so the loop
only waits.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any

STEP_INTERVAL_S = 0.002


def _protocol_out():
    """A line-buffered writer on the original stdout; fd 1 becomes stderr from here on."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # dup'ed fds are not inherited by children
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


def _read_commands(q: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            q.put(line)
    q.put(None)  # stdin closed: the harness is gone


class _Engine:
    def __init__(self, settings: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        self._sampling = SamplingParams
        self.mode = settings.get("mode", "inproc")
        kwargs: dict[str, Any] = dict(
            model=settings["model"],
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            block_size=32,
            kv_cache_memory_bytes=64 << 20,
            max_model_len=2112,
            max_num_seqs=8,
            seed=0,
            disable_log_stats=False,  # RequestOutput.metrics (first_token_latency)
        )
        if settings.get("kv_transfer_config") is not None:
            kwargs["kv_transfer_config"] = settings["kv_transfer_config"]
        if self.mode == "mp":
            kwargs["distributed_executor_backend"] = "mp"
        kwargs.update(settings.get("llm") or {})
        self.llm = LLM(**kwargs)

    def _scheduler(self) -> Any:
        client = self.llm.llm_engine.engine_core
        if type(client).__name__ != "InprocClient":
            return None
        return client.engine_core.scheduler

    def step_idle(self) -> None:
        if self.mode == "inproc":
            self.llm.llm_engine.step()

    def generate(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        params = []
        for r in requests:
            extra = None
            if r.get("kv_transfer_params") is not None:
                extra = {"kv_transfer_params": dict(r["kv_transfer_params"])}
            params.append(self._sampling(temperature=0.0, max_tokens=int(r["max_tokens"]),
                                         ignore_eos=True, extra_args=extra))
        t0 = time.monotonic()
        outs = self.llm.generate([{"prompt_token_ids": list(r["prompt_token_ids"])}
                                  for r in requests], params, use_tqdm=False)
        wall = time.monotonic() - t0
        return {"outputs": [{
            "token_ids": list(o.outputs[0].token_ids),
            "kv_transfer_params": o.kv_transfer_params,
            "finish_reason": o.outputs[0].finish_reason,
            "first_token_latency": getattr(o.metrics, "first_token_latency", None),
            "num_cached_tokens": o.num_cached_tokens,
        } for o in outs], "wall_s": wall}

    def stats(self) -> dict[str, Any]:
        sched = self._scheduler()
        connector = getattr(sched, "connector", None)
        stats = getattr(connector, "stats", None)
        by_rank = getattr(connector, "rank_stats", None) or {}
        # (the scheduler half's; ``KVBridgeConnector`` keeps it as ``_scheduler``)
        index_client = getattr(getattr(connector, "_scheduler", None), "index_client", None)
        return {"stats": None if stats is None else stats.snapshot(),
                "rank_stats": {str(rank): s.snapshot() for rank, s in by_rank.items()},
                "index_available": (None if index_client is None
                                    else bool(index_client.index.available)),
                "index_resyncs": None if index_client is None else index_client.num_resyncs}

    def metrics(self) -> dict[str, Any]:
        from vllm.v1.metrics.reader import Counter, Histogram

        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            name = m.name
            if isinstance(m, Counter) and name == "vllm:prompt_tokens_cached_by_source":
                name = f"{name}:{m.labels.get('source')}"
            elif isinstance(m, Histogram) and name.startswith("vllm:kvbridge_"):
                out[f"{name}_count"] = out.get(f"{name}_count", 0) + m.count
                out[f"{name}_sum"] = out.get(f"{name}_sum", 0.0) + m.sum
                continue
            elif not (isinstance(m, Counter) and (name.startswith("vllm:kvbridge_")
                                                   or name == "vllm:external_prefix_cache_hits")):
                continue
            out[name] = out.get(name, 0) + m.value
        return {"metrics": out}

    def state(self) -> dict[str, Any]:
        sched = self._scheduler()
        if sched is None:
            return {"state": None}
        pool = sched.kv_cache_manager.block_pool
        groups = sched.kv_cache_config.kv_cache_groups
        return {"state": {"requests": len(sched.requests),
                          "free_blocks": pool.get_num_free_blocks(),
                          "num_blocks": pool.num_gpu_blocks,
                          "kv_cache_groups": [type(g.kv_cache_spec).__name__ for g in groups]}}

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def main(settings: dict[str, Any]) -> int:
    out = _protocol_out()

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj, default=repr) + "\n")

    t0 = time.monotonic()
    try:
        engine = _Engine(settings)
    except BaseException as e:
        say({"ready": False, "error": repr(e), "traceback": traceback.format_exc()})
        return 1
    say({"ready": True, "pid": os.getpid(), "start_s": round(time.monotonic() - t0, 2),
         "mode": engine.mode})
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=_read_commands, args=(commands,), daemon=True).start()
    timeout = STEP_INTERVAL_S if engine.mode == "inproc" else None
    while True:
        try:
            line = commands.get(timeout=timeout)
        except queue.Empty:
            engine.step_idle()
            continue
        if line is None:
            break
        try:
            cmd = json.loads(line)
            name = cmd.get("cmd")
            if name == "stop":
                say({"ok": True})
                break
            handler = {"generate": lambda c=cmd: engine.generate(c["requests"]),
                       "stats": engine.stats, "state": engine.state,
                       "metrics": engine.metrics}.get(name)
            if handler is None:
                raise ValueError(f"unknown command {name!r}")
            say({"ok": True, **handler()})
        except Exception as e:
            say({"ok": False, "error": repr(e), "traceback": traceback.format_exc()})
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
