"""The test side of the vLLM suite: ``Node`` (one engine subprocess), connector configs, prompts.

Imports nothing of vLLM: the tests drive ``_node.py`` subprocesses, each running one
``vllm.LLM`` with the venv's python (``sys.executable`` here, since ``make test-vllm`` runs
pytest with it). vLLM's worker-side connector is a process-wide global, so P and D are separate
processes by construction. Every node gets ``PYTHONHASHSEED=0`` (vLLM's block hashes, which
kvbridge's pull check compares, must be equal on P and D), ``VLLM_CPU_OMP_THREADS_BIND=nobind``,
its executor mode's environment and ``KVBRIDGE_STALL_DUMP_S`` (``loop_thread``: a connector
loop starved for ``STALL_DUMP_S`` dumps every thread's stack into the log). Each node runs in its
own session (process group), so ``kill()`` and ``pause()`` reach vLLM's EngineCore and Worker
children too; its log (everything vLLM prints) is a file whose tail goes into every failure
message.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NODE = HERE / "_node.py"
from kvbridge.connector.loop_thread import STALL_DUMP_ENV  # noqa: E402

# A port below the ephemeral range, for a node that must listen on a known port: a P restarted
# on it finds it free (connector/serve/demo/processes.py).
from kvbridge.connector.serve.demo.processes import free_port  # noqa: E402, F401 (re-exported to the tests)

BLOCK = 32  # the suite's vLLM block_size (the CPU attention backend needs a multiple of 32)
# vLLM's KV cache groups of the hybrid model (tiny_checkpoint.HYBRID), in its order
HYBRID_GROUP_KINDS = ["SlidingWindowSpec", "FullAttentionSpec"]
START_TIMEOUT_S = 240.0  # engines start in 10-60 s on 2 cores; two at once, slower
INDEX_UP_S = 30.0  # an index's first answer after a start (Node.wait_ready)
STALL_DUMP_S = 3.0  # a connector loop that cannot run this long dumps every thread's stack


class NodeError(RuntimeError):
    """A node died, timed out or answered ``ok: false``; the message ends with its log tail."""


class Node:
    """One ``vllm.LLM`` in a subprocess, served over JSON lines (see ``_node.py``).

    Args:
        name: for logs and messages.
        model: checkpoint directory.
        log_dir: where ``<name>.log`` goes.
        kv_transfer_config: vLLM's ``kv_transfer_config`` mapping, or None (no connector).
        mode: ``"inproc"`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or ``"mp"``.
        llm: more ``vllm.LLM`` keyword arguments.
        env: more environment variables.
        python: the interpreter that runs ``_node.py`` (default this one's: the vLLM venv's);
            another venv's for a connector installed only there.
    """

    def __init__(self, name: str, *, model: str | os.PathLike, log_dir: Path,
                 kv_transfer_config: dict[str, Any] | None = None, mode: str = "inproc",
                 llm: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 python: str | None = None) -> None:
        if mode not in ("inproc", "mp"):
            raise ValueError(f"mode must be 'inproc' or 'mp', got {mode!r}")
        self.name, self.mode = name, mode
        self.log_path = Path(log_dir) / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.ready: dict[str, Any] = {}
        self._paused = False
        settings = {"model": str(model), "kv_transfer_config": kv_transfer_config,
                    "mode": mode, "llm": llm or {}}
        full_env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    STALL_DUMP_ENV: str(STALL_DUMP_S), **(env or {})}
        if mode == "inproc":
            full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self._proc = subprocess.Popen(
            [python or sys.executable, str(NODE), json.dumps(settings)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, env=full_env, text=True,
            start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def _fail(self, what: str) -> NodeError:
        return NodeError(f"node {self.name} (pid {self.pid}): {what}\n--- {self.log_path} "
                         f"(tail) ---\n{self.log_tail()}")

    def _recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise self._fail(f"no answer within {timeout_s:.0f} s") from None
        if line is None:
            self._lines.put(None)  # later calls see the exit too
            raise self._fail(f"exited (rc={self._proc.wait()})")
        return json.loads(line)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, *, index_up: bool = True) -> Node:
        """Wait for the engine to be up; returns self.

        ``index_up``: an in-process node with an index also waits (up to ``INDEX_UP_S``) until
        its index backend answers. An engine registers with the index as it starts; on a
        loaded 2-core host that call can run past the index's 0.25 s socket timeout, and the
        engine then serves from its own cache until its retry a second later (the designed
        outage path, tested on its own): a test's first lookup must not land in that second.
        False for a node started while Redis is down on purpose."""
        if not self.ready:
            msg = self._recv(timeout_s)
            if not msg.get("ready"):
                raise self._fail(f"did not start: {msg.get('error')}\n{msg.get('traceback')}")
            self.ready = msg
        if index_up and self.mode == "inproc":
            deadline = time.monotonic() + INDEX_UP_S
            while self.call({"cmd": "stats"}, 60).get("index_available") is False:
                if time.monotonic() > deadline:
                    raise self._fail(f"its index did not answer within {INDEX_UP_S:.0f} s")
                time.sleep(0.1)
        return self

    def send(self, cmd: dict[str, Any]) -> None:
        """Send one command without waiting (pair with ``result``)."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(cmd) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise self._fail(f"cannot send {cmd.get('cmd')!r}: {e!r}") from None

    def result(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """The answer to the command sent last; raises ``NodeError`` on ``ok: false``."""
        msg = self._recv(timeout_s)
        if not msg.get("ok"):
            raise self._fail(f"command failed: {msg.get('error')}\n{msg.get('traceback')}")
        return msg

    def call(self, cmd: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        self.send(cmd)
        return self.result(timeout_s)

    def submit(self, requests: list[dict[str, Any]]) -> None:
        """Start a ``generate`` (its answer comes from ``result()``)."""
        self.send({"cmd": "generate", "requests": requests})

    def generate(self, requests: list[dict[str, Any]],
                 timeout_s: float = 300.0) -> list[dict[str, Any]]:
        """Greedy outputs, one dict per request (see ``_node.py``)."""
        self.submit(requests)
        return self.result(timeout_s)["outputs"]

    def stats(self) -> dict[str, Any] | None:
        """The scheduler-side connector's ``stats.snapshot()`` (in-process nodes only)."""
        return self.call({"cmd": "stats"}, 60)["stats"]

    def rank_stats(self) -> dict[int, dict[str, Any]]:
        """Each worker rank's own ``stats.snapshot()`` by tp rank, as the scheduler-side
        connector has them from the ranks' reports (in-process nodes only)."""
        return {int(r): s for r, s in self.call({"cmd": "stats"}, 60)["rank_stats"].items()}

    def pid_listening_on(self, port: int) -> int | None:
        """The process of the node's group that listens on TCP ``port`` (a worker rank's
        transport), or None."""
        return _listening_pid(self.pid, port)

    def metrics(self) -> dict[str, float]:
        """vLLM's own metrics of kvbridge and of external prefix hits (``_node.py``,
        ``metrics``), read in the node's frontend (both modes)."""
        return self.call({"cmd": "metrics"}, 60)["metrics"]

    def state(self) -> dict[str, Any] | None:
        """``{"requests", "free_blocks", "num_blocks"}`` of the scheduler (in-process only)."""
        return self.call({"cmd": "state"}, 60)["state"]

    def wait_drained(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """Poll ``state()`` until the scheduler holds no request and every block is free
        (vLLM's null block is never free); returns the last state (None in mp mode). Returns
        at once when drained; the timeout outlasts a connector loop stalled for about a lease
        (``kvbridge_config``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            if st is None or (st["requests"] == 0
                              and st["free_blocks"] == st["num_blocks"] - 1):
                return st
            if time.monotonic() > deadline:
                return st
            time.sleep(0.1)

    def connected_to(self, port: int) -> bool:
        """True while a process of the node's group has an established TCP connection to
        ``port`` on this host (how a test sees that D's pull has reached P)."""
        return port in _established_remote_ports(self.pid)

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP the node's whole process group (its transport stops answering); returns once
        every thread of the group is stopped (``killpg`` returns before that, and a request
        that lands in between is still served)."""
        os.killpg(self.pid, signal.SIGSTOP)
        self._paused = True
        deadline = time.monotonic() + timeout_s
        while not _group_stopped(self.pid):
            if time.monotonic() > deadline:
                raise self._fail(f"not stopped {timeout_s:.0f} s after SIGSTOP")
            time.sleep(0.01)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)
        self._paused = False

    def kill(self) -> None:
        """SIGKILL the node's whole process group, at once (the "P killed" tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self._reap(10)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the node to shut its engine down and exit; kill it if that takes too long (or
        at once when it is paused)."""
        if self.alive() and not self._paused:
            with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
                self.call({"cmd": "stop"}, timeout_s)
                self._proc.wait(timeout=timeout_s)
        self.kill()

    def _reap(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout_s)
        # vLLM's children sit in the same group: leave nothing behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._log.close()


def _group_stopped(pgid: int) -> bool:
    """True when every thread of every process in process group ``pgid`` is stopped."""
    for pid in _group_pids(pgid):
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                state = Path(task.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("T", "t", "Z", "X"):
                    return False
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return True


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return pids


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            target = os.readlink(fd.path)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _listening_pid(pgid: int, port: int) -> int | None:
    """The pid of group ``pgid`` holding a LISTEN TCP socket on ``port``."""
    listening: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pgid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                listening.add(cols[9])  # 0A: LISTEN
    for pid in _group_pids(pgid):
        if _socket_inodes(pid) & listening:
            return pid
    return None


def _established_remote_ports(pgid: int) -> set[int]:
    """Remote ports of the ESTABLISHED TCP sockets that processes of group ``pgid`` hold."""
    inodes: set[str] = set()
    for pid in _group_pids(pgid):
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pgid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "01" and cols[9] in inodes:  # 01: ESTABLISHED
                ports.add(int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def start_nodes(*nodes: Node, timeout_s: float = START_TIMEOUT_S,
                index_up: bool = True) -> tuple[Node, ...]:
    """Wait for nodes started together (``Node.wait_ready``); stops them all if one fails to
    come up."""
    try:
        for node in nodes:
            node.wait_ready(timeout_s, index_up=index_up)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


def stop_nodes(*nodes: Node) -> None:
    """``Node.stop`` on every node at once (one thread each): an engine's shutdown mostly
    waits, so a module's engines need not take their turns."""
    threads = [threading.Thread(target=node.stop, name=f"stop-{node.name}") for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def assert_drained(*nodes: Node) -> None:
    """Each node's scheduler holds no request and every block but vLLM's null block is free
    (``Node.wait_drained``; issue 31, part 6: "after every test every block is free and
    nothing is held")."""
    for node in nodes:
        state = node.wait_drained()
        assert state is not None, f"node {node.name}: no scheduler state (mp mode)"
        assert state["requests"] == 0 and state["free_blocks"] == state["num_blocks"] - 1, (
            node.name, state)


# ----------------------------------------------------------------------------- configs
def kvbridge_config(role: str, engine_id: str, *, policy: str = "recompute",
                    **extra: Any) -> dict[str, Any]:
    """The contract of issue 13: ``role`` is ``"producer"`` or ``"consumer"``; ``extra`` goes to
    ``kv_connector_extra_config`` (``cma``, ``load_timeout_s``, ``lease_s``, ...).

    Given ``load_timeout_s`` and no ``lease_s``, P's lease is ``max(30, 3 * load_timeout_s)``,
    as ``make demo-vllm`` sets it (``connector/serve/demo/vllm_pd.py``). The tests count D's
    release notices, and one CI run saw both loop threads of a TP=2 D stand still for 30 s
    right after its loads had landed (on a 2-core host, while a worker ran its forward): with a
    lease as long as D's load deadline, P's lease ran out before the notice came. The load's
    own deadline is unchanged."""
    if "load_timeout_s" in extra:
        extra.setdefault("lease_s", max(30.0, 3 * extra["load_timeout_s"]))
    return {"kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.connector.vllm",
            "kv_role": f"kv_{role}", "engine_id": engine_id,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra}


def nixl_config(role: str, engine_id: str) -> dict[str, Any]:
    """vLLM's own NixlConnector on this CPU (the harness self-check)."""
    return {"kv_connector": "NixlConnector", "kv_role": f"kv_{role}",
            "kv_buffer_device": "cpu", "engine_id": engine_id}


# ----------------------------------------------------------------------------- prompts
def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids in [1, 512) (the tiny Llama's vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def request(prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    return {"prompt_token_ids": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}


def prefill_requests(prompts: list[list[int]]) -> list[dict[str, Any]]:
    """P's side of a handover: one token each, asking for a ticket."""
    return [request(p, 1, {"do_remote_decode": True}) for p in prompts]


def full_blocks(n_tokens: int) -> int:
    return n_tokens // BLOCK
