"""A node whose ``index_url`` names a Redis that does not answer (issue 29, part 5): ONE warning
that says what is wrong and what to change, said once however many requests, publishes and
heartbeats meet the outage; one line when Redis answers again; the node's blocks land then.

The shared index client layer (``open_index`` + ``IndexClient``, what kvbridge's nodes, the store
and the connector inside vLLM use) first, then ``kvbridge-node`` as a user starts it. The Redis
is the suite's (``tests/_redis_fixture.py``), started by the test on a port where nothing
listened before: Redis "down at start", then up; then killed mid-run and started again.

A ``redis-cluster://`` index with no seed answering at start cannot be served that way (the client
learns the slot map from a seed): the node, the store and the proxy refuse to start, in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from _identity_builders import BASE_IDENTITY
from _redis_fixture import RedisServer, server_binary
from kvbridge.connector.index import IndexClient, IndexNamespace, new_incarnation, open_index
from kvbridge.connector.serve.demo.processes import free_port
from kvbridge.kvmanager.block_pool import CachedBlock
from kvbridge.kvmanager.kv_events import BlockStored

_NS = IndexNamespace(identity=BASE_IDENTITY)
_DOWN = "cannot reach"
_UP = "answers again"


def _client(node_id: str, url: str, port: int, prompt: list[bytes] | None = None) -> IndexClient:
    index, directory = open_index(url, _NS)
    client = IndexClient(index, directory, node_id=node_id, incarnation=new_incarnation(),
                         group_ids=(0,), ttl_s=1.5, lookup_timeout_s=0.2)  # heartbeats: 0.5 s
    if prompt is not None:  # the node's cached set, republished once Redis answers
        client.set_resync_source(lambda: [CachedBlock(h, 0, i + 1) for i, h in enumerate(prompt)])
    client.start("127.0.0.1", port)
    return client


def _stored(prompt: list[bytes]) -> BlockStored:
    return BlockStored(block_hashes=prompt, parent_block_hash=None, token_ids=[],
                       block_size=_NS.block_size, lora_name=None, medium=None, group_id=0,
                       block_ids=list(range(1, len(prompt) + 1)))


def _steps(client: IndexClient, prompt: list[bytes], seconds: float, tag: str) -> set[str]:
    """Drive ``client`` as an engine does for ``seconds``: a lookup per step, polled until it
    is answered, and ``publish`` every step. Returns the lookups' answers."""
    answers, end_s, step = set(), time.monotonic() + seconds, 0
    while time.monotonic() < end_s:
        key = f"{tag}-{step}"
        client.start_lookup(key, prompt, num_local_blocks=0, min_gain_blocks=1)
        while (result := client.poll_lookup(key)).status == "pending":
            time.sleep(0.01)
        answers.add(result.status)
        client.publish([])
        step += 1
    return answers


def _lines(caplog, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if word in r.getMessage()]


def _kvbridge_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("kvbridge") and r.levelno >= logging.WARNING]


def test_the_index_client_says_once_that_redis_is_unreachable_and_once_that_it_is_back(caplog):
    caplog.set_level(logging.INFO, logger="kvbridge")
    port = free_port()  # nothing listens there yet
    url = f"redis://127.0.0.1:{port}/0"
    prompt = [hashlib.sha256(b"%d" % i).digest()[:16] for i in range(6)]
    a = _client("node-a", url, 7001, prompt)
    b = None
    with tempfile.TemporaryDirectory(prefix="kvbridge-redis-") as tmp:
        server = RedisServer(server_binary().path, Path(tmp), port)
        try:
            # (1) down at start: 3 s of steps (heartbeats, a publish, a lookup per step, retries)
            a.publish([_stored(prompt)])
            assert _steps(a, prompt, 3.0, "down") <= {"unavailable", "timed_out", "no_hit"}
            [warning] = _kvbridge_warnings(caplog)  # one line, not one per step or retry
            assert warning.startswith(f"kvbridge index: {_DOWN} {url} (ConnectionError: ")
            assert "Connection refused" in warning and "own cache" in warning
            assert "retrying every 1.0 s" in warning and "set index_url (--index-url)" in warning
            # (2) Redis starts on that port: one line says so, and A's blocks reach the index
            server.start()
            _steps(a, prompt, 2.5, "up")
            b = _client("node-b", url, 7002)
            assert "hit" in _steps(b, prompt, 1.0, "b")
            b.close()  # (each node says it once: B would add its own lines below)
            [back] = _lines(caplog, _UP)
            assert back.startswith(f"kvbridge index: {url} {_UP} after ")
            # (3) Redis dies mid-run and comes back: one more line each way
            server.stop()
            _steps(a, prompt, 2.0, "down-again")
            server.start()
            _steps(a, prompt, 2.5, "up-again")
        finally:
            a.close()
            if b is not None:
                b.close()
            server.stop()
    assert len(_lines(caplog, _DOWN)) == 2 and len(_lines(caplog, _UP)) == 2
    assert len(_kvbridge_warnings(caplog)) == 2


def test_kvbridge_node_says_once_that_redis_is_unreachable_and_once_that_it_is_back(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    log = tmp_path / "node.log"
    server = RedisServer(server_binary().path, tmp_path, port)
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.connector.serve.commands", "node", "--port", "0",
             "--role", "both", "--max-model-len", "256", "--index-url", url],
            stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = "-"
        while line and not line.startswith("{"):  # (UCX may warn on stdout first)
            line = proc.stdout.readline()
        assert line.startswith("{"), log.read_text()[-3000:]
        base = json.loads(line)["url"]
        with httpx.Client(base_url=base, timeout=120) as http:
            end_s = time.monotonic() + 4.0  # past a heartbeat and a few retries
            while time.monotonic() < end_s:  # requests served meanwhile, from its own cache
                answer = http.post("/v1/completions", json={"prompt": "hello " * 20,
                                                            "max_tokens": 2})
                assert answer.status_code == 200, answer.text
                time.sleep(0.2)
            server.start()
            deadline_s = time.monotonic() + 60
            while _UP not in log.read_text() and time.monotonic() < deadline_s:
                http.post("/v1/completions", json={"prompt": "again " * 20, "max_tokens": 1})
                time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            server.stop()
    text = log.read_text()
    down = [x for x in text.splitlines() if _DOWN in x]
    assert len(down) == 1 and url in down[0] and "--index-url" in down[0], text[-3000:]
    assert "WARNING" in down[0]
    assert len([x for x in text.splitlines() if _UP in x]) == 1, text[-3000:]


@pytest.mark.parametrize("argv", [
    ["node", "--port", "0", "--max-model-len", "256"],
    ["store", "--capacity-bytes", "1048576"],
    ["proxy", "--port", "0", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"],
], ids=lambda argv: argv[0])
def test_an_unreachable_cluster_index_at_start_is_one_line_and_exit_code_2(argv):
    url = f"redis-cluster://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge.connector.serve.commands", *argv, "--index-url", url],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [x for x in done.stderr.splitlines() if f"kvbridge-{argv[0]}: error:" in x]
    assert len(errors) == 1 and f"cannot reach the Redis Cluster at {url}" in errors[0], \
        done.stderr[-3000:]
    assert "--index-url" in errors[0] and "Traceback" not in done.stderr
