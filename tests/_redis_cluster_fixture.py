"""A real three-shard Redis Cluster for tests: three ``redis-server`` processes started with
``cluster-enabled yes`` on free ports, slots assigned and nodes met through redis-py
(``CLUSTER ADDSLOTSRANGE``, ``CLUSTER MEET``), no replicas, no persistence.

Registered as a pytest plugin from ``tests/conftest.py``. Fixtures:

- ``redis_cluster`` (module scope): a running :class:`RedisClusterServers`; ``.url`` is
  ``redis-cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3``; ``.stop(i)`` kills shard ``i``
  (SIGKILL, its data lost) and ``.start(i)`` brings it back on its port with its slots (its
  ``nodes.conf`` survives); ``.stop_all()`` and ``.start_stopped()`` do the same for every
  stopped shard at once (a whole-cluster outage); the fixture restarts stopped shards between
  tests and kills all at the end. ``.move_slot(slot, i)`` migrates a slot and its keys to shard
  ``i`` (a test that moves one moves it back: the fixture does not).
- ``redis_cluster_url`` (function scope): the URL after ``FLUSHALL`` on every shard.

The servers run with ``cluster-require-full-coverage no`` (the live shards keep serving while one
is down) and ``cluster-node-timeout 1000``. A missing server binary FAILS the test (never skips).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from _redis_fixture import free_port, server_binary, wait_until_answering
from kvbridge.transport import format_host_port

_START_TIMEOUT_S = 15.0
_NUM_SHARDS = 3
_NUM_SLOTS = 16384


class RedisClusterServers:
    """Three cluster-enabled server processes, one shard each (slots split in three ranges),
    each bound to ``host`` alone (``"::1"``: an IPv6 cluster, ``redis-cluster://[::1]:P1,...``)."""

    def __init__(self, binary: str, workdir: Path, *, host: str = "127.0.0.1") -> None:
        self.binary = binary
        self.workdir = workdir
        self.host = host
        self.ports = [free_port() for _ in range(_NUM_SHARDS)]
        self.bus_ports = [free_port() for _ in range(_NUM_SHARDS)]  # cluster bus, set apart
        self.url = "redis-cluster://" + ",".join(format_host_port(host, p) for p in self.ports)
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * _NUM_SHARDS
        bounds = [round(i * _NUM_SLOTS / _NUM_SHARDS) for i in range(_NUM_SHARDS + 1)]
        self.slot_ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(_NUM_SHARDS)]

    def _client(self, i: int, timeout_s: float = 1.0) -> redis.Redis:
        return redis.Redis(
            host=self.host, port=self.ports[i], socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )

    def running(self, i: int) -> bool:
        proc = self._procs[i]
        return proc is not None and proc.poll() is None

    def _spawn(self, i: int) -> None:
        shard_dir = self.workdir / f"shard-{i}"
        shard_dir.mkdir(exist_ok=True)
        self._procs[i] = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.ports[i]),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", str(shard_dir),
                "--logfile", str(shard_dir / "server.log"),
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(self.bus_ports[i]),
                "--cluster-node-timeout", "1000",
                "--cluster-require-full-coverage", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = self._client(i, 0.2)
        try:
            wait_until_answering(self._procs[i], client, name=f"cluster shard {i}",
                                 log_path=shard_dir / "server.log", timeout_s=_START_TIMEOUT_S)
        finally:
            client.close()

    def start_all(self) -> None:
        """Start the three shards, assign each its slot range, meet them, wait for ``ok``."""
        for i in range(_NUM_SHARDS):
            self._spawn(i)
        for i, (first, last) in enumerate(self.slot_ranges):
            client = self._client(i)
            try:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                if i:
                    client.execute_command(
                        "CLUSTER", "MEET", self.host, self.ports[0], self.bus_ports[0]
                    )
            finally:
                client.close()
        self.wait_ok()

    def wait_ok(self) -> None:
        """Wait until every running shard reports ``cluster_state:ok`` and knows 3 masters."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            states = []
            for i in range(_NUM_SHARDS):
                if not self.running(i):
                    continue
                client = self._client(i)
                try:
                    info = client.execute_command("CLUSTER", "INFO").decode()
                    fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
                    states.append(
                        fields.get("cluster_state") == "ok"
                        and fields.get("cluster_known_nodes") == str(_NUM_SHARDS)
                        and fields.get("cluster_slots_ok") == str(_NUM_SLOTS)
                    )
                except redis.RedisError:
                    states.append(False)
                finally:
                    client.close()
            if states and all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok within {_START_TIMEOUT_S} s: {states}")
            time.sleep(0.05)

    def stop(self, i: int) -> None:
        """Kill shard ``i`` (SIGKILL: its keys are lost, as after a crash)."""
        proc = self._procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        self._procs[i] = None

    def start(self, i: int) -> None:
        """Bring shard ``i`` back (same port, id and slots, empty) and wait for ``ok``."""
        if not self.running(i):
            self._spawn(i)
        self.wait_ok()

    def start_stopped(self) -> None:
        """Bring every stopped shard back, then wait for ``ok`` once (after a whole-cluster
        outage: ``start(i)`` one by one would wait for ``ok`` with the others still down)."""
        for i in range(_NUM_SHARDS):
            if not self.running(i):
                self._spawn(i)
        self.wait_ok()

    def owner_of(self, slot: int) -> int:
        """The shard that serves ``slot`` (as shard 0 sees the cluster)."""
        client = self._client(0)
        try:
            for first, last, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if first <= slot <= last:
                    return self.ports.index(int(primary[1]))
        finally:
            client.close()
        raise RuntimeError(f"no shard serves slot {slot}")

    def move_slot(self, slot: int, target: int) -> int:
        """Migrate ``slot`` with its keys to shard ``target`` as ``redis-cli --cluster reshard``
        does (``SETSLOT IMPORTING``/``MIGRATING``, ``MIGRATE``, then ``SETSLOT NODE`` on every
        shard); returns the shard that served it. Clients learn of it by a ``MOVED`` reply."""
        source = self.owner_of(slot)
        clients = [self._client(i, 5.0) for i in range(_NUM_SHARDS)]
        try:
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            if source != target:
                source_client, target_client = clients[source], clients[target]
                target_client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
                source_client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
                while keys := source_client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                    source_client.execute_command(
                        "MIGRATE", self.host, self.ports[target], "", 0, 5000, "KEYS", *keys
                    )
                others = [i for i in range(_NUM_SHARDS) if i not in (source, target)]
                for i in (target, source, *others):
                    clients[i].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        finally:
            for client in clients:
                client.close()
        return source

    def flushall(self) -> None:
        for i in range(_NUM_SHARDS):
            client = self._client(i)
            try:
                client.flushall()
            finally:
                client.close()

    def stop_all(self) -> None:
        for i in range(_NUM_SHARDS):
            self.stop(i)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServers]:
    with tempfile.TemporaryDirectory(prefix="kvbridge-cluster-") as tmp:
        servers = RedisClusterServers(server_binary().path, Path(tmp))
        try:
            servers.start_all()
            yield servers
        finally:
            servers.stop_all()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisClusterServers) -> Iterator[str]:
    redis_cluster.start_stopped()
    redis_cluster.flushall()
    yield redis_cluster.url
    redis_cluster.start_stopped()
