"""bench_vllm_prefix's processes: vLLM engines (the vLLM suite's ``Node``, one subprocess each,
from ``tests/vllm/_harness.py``), a Redis server (``tests/_redis_fixture.py``), a kvbridge store
node and LMCache's multiprocess server, each started the way the suite and issue 31 start them.

Every engine gets ``PYTHONHASHSEED=0``, 32-token blocks and float32, and the benchmark's
environment (``PYTHONPATH`` included: ``Node`` passes ``os.environ`` on). ``engine`` starts it in
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its scheduler-side connector's ``stats`` are
readable); ``spawned_engine`` in vLLM's multiprocess mode, as LMCache's engines must start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
for _path in (TESTS, TESTS / "vllm"):  # appended: the installed vllm package stays first
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from _harness import BLOCK, Node, NodeError, free_port, kvbridge_config  # noqa: E402
from _redis_fixture import RedisServer  # noqa: E402

__all__ = ["BLOCK", "Node", "NodeError", "Proc", "block_bytes", "engine", "lmcache_connector",
           "lmcache_python",
           "spawned_engine", "start_lmcache_server", "start_redis", "start_store",
           "store_refusal"]

LONG_ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}  # the tiny Llama declares 4,096 positions


def block_bytes(model_path: str) -> int:
    """Bytes one 32-token block of every layer takes (float32 K and V)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * BLOCK * 4


def engine(name: str, model_path: str, log_dir: Path, *, extra: dict[str, Any] | None = None,
           llm: dict[str, Any] | None = None, connector: dict[str, Any] | None = None,
           python: str | None = None) -> Node:
    """A started (not yet ready) engine: kvbridge's connector as users configure it for prefix
    reuse (``kv_both``, ``extra`` its ``kv_connector_extra_config``), or ``connector`` (another
    ``kv_transfer_config``), or none when both are None."""
    transfer = connector
    if extra is not None:
        transfer = kvbridge_config("both", name, **extra)
    return Node(name, model=model_path, log_dir=log_dir, kv_transfer_config=transfer,
                llm=llm, env=LONG_ENV, python=python)


def spawned_engine(name: str, model_path: str, log_dir: Path, *,
                   connector: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                   llm: dict[str, Any] | None = None, python: str | None = None) -> Node:
    """A started (not yet ready) engine with ``connector`` (a ``kv_transfer_config``), or
    kvbridge's connector as ``engine`` configures it from ``extra``, in vLLM's multiprocess
    mode, as ``vllm serve`` runs: an EngineCore subprocess (spawned: vLLM's CPU platform forces
    ``spawn``) holds the scheduler, and a worker process of its own the model (the
    ``distributed_executor_backend: "uni"`` asked for here is turned into ``"mp"`` by vLLM
    0.32's CPU platform whenever V1 multiprocessing is on). The three processes hand each step
    over through vLLM's spinning shared-memory queues, so on a host of few cores these engines'
    timings vary far more than in-process ones. Raises ValueError unless exactly one of
    ``connector`` and ``extra`` is given.

    For a connector whose module imports ``numba`` (LMCache 0.5.6's ``LMCacheMPConnector``:
    its ``token_hasher``), which ``engine`` cannot start (measured with vLLM 0.32.0). vLLM
    imports the connector's module while it builds its config; on a CPU without Triton the
    worker's ``register_triton_kernel_overrides`` then scans every loaded module and fails on
    llvmlite's ``llvmlite.binding.ffi.lib`` (``AttributeError: '_lib_fn_wrapper' object has
    no attribute 'get'``). Spawned, EngineCore registers its overrides before it imports the
    connector. The frontend's ``first_token_latency`` also counts the hand-offs between the
    processes, which an in-process engine has not. No connector ``stats`` (in process
    only). kvbridge's engines start this way too where they are compared with LMCache's.
    """
    if (connector is None) == (extra is None):
        raise ValueError("spawned_engine needs exactly one of connector and extra")
    if extra is not None:
        connector = kvbridge_config("both", name, **extra)
    return Node(name, model=model_path, log_dir=log_dir, kv_transfer_config=connector,
                mode="mp", llm={**(llm or {}), "distributed_executor_backend": "uni"},
                env=LONG_ENV, python=python)


def start_redis(workdir: Path) -> RedisServer:
    """A Redis server on a free port (``_cluster.server_binary``'s binary)."""
    from _cluster import server_binary

    server = RedisServer(server_binary(), workdir, free_port())
    server.start()
    return server


class Proc:
    """A helper process in its own session, with its log; ``stop()`` ends its whole group."""

    def __init__(self, cmd: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     start_new_session=True)

    def first_json_line(self, timeout_s: float) -> dict[str, Any]:
        """The first stdout line that is a JSON object (a server's "serving" line)."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"{self.proc.args[:3]} did not announce itself; log {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def store_refusal(error: str) -> str:
    """The line of an engine's start failure that says why (the connector's refusal)."""
    for line in error.splitlines():
        if "store_url" in line or "offload" in line:
            return line.strip()[:300]
    return error.strip().splitlines()[0][:300] if error.strip() else "engine did not start"


def start_store(redis_url: str, write_port: int, capacity_bytes: int, log_dir: Path,
                timeout_s: float = 60.0) -> Proc:
    """``kvbridge-store`` for engines configured with ``store_url: 127.0.0.1:<write_port>``,
    started as a user starts it: no model or profile (it learns the writers' geometry), and with
    ``--max-shelves 1``, so that the one geometry of the benchmark's engines gets all of
    ``capacity_bytes``."""
    store = Proc([sys.executable, "-m", "kvbridge.connector.serve.store_server",
                  "--index-url", redis_url, "--capacity-bytes", str(capacity_bytes),
                  "--write-port", str(write_port), "--max-shelves", "1"], log_dir / "store.log")
    try:
        store.first_json_line(timeout_s)
    except BaseException:
        store.stop()
        raise
    return store


def lmcache_python(flag: str | None) -> tuple[str | None, str]:
    """(python of a venv where ``import lmcache`` works, "") or (None, why not)."""
    python = flag or os.environ.get("KVBRIDGE_LMCACHE_PYTHON")
    if not python:
        return None, ("no LMCache venv named (--lmcache-python or KVBRIDGE_LMCACHE_PYTHON; "
                      "its own venv: pip install lmcache==0.5.6 pulls CUDA wheels and "
                      "downgrades numpy/protobuf)")
    try:
        done = subprocess.run([python, "-c", "import lmcache, vllm"], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python}: {exc!r}"
    if done.returncode != 0:
        return None, f"{python}: import lmcache, vllm failed: {done.stderr.strip()[-200:]}"
    return python, ""


def start_lmcache_server(python: str, port: int, log_dir: Path) -> Proc:
    """LMCache 0.5.6's multiprocess server with issue 31's settings (no L2); ready once its
    port accepts connections."""
    import socket

    server = Proc([python, "-m", "lmcache.v1.multiprocess.server", "--port", str(port),
                   "--chunk-size", "256", "--l1-size-gb", "1", "--eviction-policy", "LRU",
                   "--hash-algorithm", "blake3", "--supported-transfer-mode", "auto"],
                  log_dir / "lmcache-server.log")
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"LMCache server exited; log {server.log_path}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"LMCache server not listening on {port}; log {server.log_path}")


def lmcache_connector(port: int) -> dict[str, Any]:
    """``kv_transfer_config`` of an engine on LMCache's multiprocess server (issue 31); start
    the engine with ``spawned_engine``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost",
                                          "lmcache.mp.port": port}}
