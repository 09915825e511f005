"""A refused start leaves nothing running (issue 28, item 5).

A node starts in steps: the engine builds the connector's scheduler half, then its worker half,
whose ``register_kv_caches`` starts the transport (a listening port, its server on the
connector loop, UCX) and the heartbeats; then the scheduler half registers in the block index
(``set_xfer_handshake_metadata``). Whichever step refuses (bad config, a server it needs
unreachable, a port taken), everything the steps before it started is closed before the error
reaches the caller: ``create_engine`` for kvbridge's engine, ``KVBridgeWorker.register_kv_caches``
for vLLM's worker. Counted here: threads, listening TCP sockets and tasks on the connector loop
(``_running``), before and after each refused start; a loopback node's address on its network.
"""

from __future__ import annotations

import logging
import socket
import sys

import pytest
import redis
import torch
from _engine_builders import BLOCK_SIZE, tiny_model
from _running import Running, started_since
from kvbridge.connector import KVTransferConfig
from kvbridge.connector.factory import create_engine
from kvbridge.connector.puller import Puller
from kvbridge.connector.worker_half import KVBridgeWorker
from kvbridge.kvmanager.engine import EngineConfig
from kvbridge.kvmanager.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvbridge.transport import LoopbackNetwork

pytestmark = pytest.mark.timeout(120)

_LOOPBACK_PORT = 7001  # a loopback node's port, fixed so the test can look it up
_NOTHING = {"threads": [], "listening": [], "loop_tasks": []}
_ENGINE = EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=128)


def _transport_config(transport: str, port: int | None = None) -> dict:
    if transport == "loopback":
        return {"transport": "loopback", "port": _LOOPBACK_PORT if port is None else port}
    pytest.importorskip("ucxx")  # a dependency: installed wherever the suite runs
    return {"transport": "ucxx", "host": "127.0.0.1", "port": port or 0}


def _create(transport: str, network: LoopbackNetwork, engine_config: EngineConfig = _ENGINE,
            engine_id: str = "node-0", **extra):
    config = {"kv_role": "kv_both", "engine_id": engine_id,
              "kv_connector_extra_config": {**_transport_config(transport), **extra}}
    return create_engine(tiny_model(hybrid=False), engine_config, config,
                         **({"loopback_network": network} if transport == "loopback" else {}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=["loopback", "ucxx"])
def transport(request) -> str:
    """A transport whose process-wide pieces (the connector loop, UCX and its progress) a node
    that started and shut down has already brought up: those stay, by design."""
    _create(request.param, LoopbackNetwork()).shutdown()
    return request.param


@pytest.fixture
def taken_port(transport):
    """A port another node (loopback) or socket (ucxx) listens on."""
    if transport == "loopback":
        yield _LOOPBACK_PORT + 1
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def _fail_heartbeats(monkeypatch) -> None:
    """The last step of the worker half's start fails (after its transport started)."""
    def refuse(self, transport, timeout_s):
        raise RuntimeError("heartbeats refused to start")

    monkeypatch.setattr(Puller, "start_heartbeats", refuse)


# (extra kv_connector_extra_config keys, engine id, error): each refused after the transport
# started, but the two refused before anything started ("engine_config", "kv_config")
_REFUSALS = {
    "index_url_malformed": ({"index_url": "bogus://index"}, "node-0", ValueError),
    "index_option_malformed": (
        {"index_url": "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus"}, "node-0", redis.RedisError),
    "index_refuses_engine_id": ({"index_url": "memory"}, "node:0", ValueError),
    "index_cluster_unreachable": ({"index_url": "redis-cluster://127.0.0.1:{dead}"}, "node-0",
                                  ValueError),  # ClusterUnreachableError, one line
    "port_taken": ({"port": "{taken}"}, "node-0", (OSError, ValueError)),
    "heartbeats_fail": ({}, "node-0", RuntimeError),
    "engine_config": ({}, "node-0", ValueError),
    "kv_config": ({"lease_s": -1.0}, "node-0", ValueError),
}


@pytest.mark.parametrize("refusal", list(_REFUSALS))
def test_a_refused_create_engine_leaves_nothing_running(refusal, transport, taken_port,
                                                        monkeypatch, caplog):
    caplog.set_level(logging.CRITICAL)
    extra, engine_id, error = _REFUSALS[refusal]
    extra = {key: value.format(dead=_free_port(), taken=taken_port) if isinstance(value, str)
             else value for key, value in extra.items()}
    if "port" in extra:
        extra["port"] = int(extra["port"])
    engine_config = _ENGINE
    if refusal == "engine_config":  # too few blocks for one request of max_model_len
        engine_config = EngineConfig(num_blocks=4, block_size=BLOCK_SIZE, max_model_len=128)
    if refusal == "heartbeats_fail":
        _fail_heartbeats(monkeypatch)
    network = LoopbackNetwork()
    other = None
    if refusal == "port_taken" and transport == "loopback":
        other = _create(transport, network, engine_id="node-1", port=taken_port)
    try:
        before = Running.now()
        with pytest.raises(error):
            _create(transport, network, engine_config, engine_id, **extra)
        assert started_since(before) == _NOTHING
        if transport == "loopback":
            assert network.lookup(("127.0.0.1", _LOOPBACK_PORT)) is None
            if other is not None:  # the node that held the port still serves on it
                assert network.lookup(("127.0.0.1", taken_port)) is other.runner.connector \
                    .worker_half.transport
    finally:
        if other is not None:
            other.shutdown()


def _worker(transport: str, network: LoopbackNetwork, **extra) -> KVBridgeWorker:
    """A worker half as vLLM's adapter builds one (``register_kv_caches`` starts it)."""
    config = KVTransferConfig.from_dict({
        "engine_id": "worker-0",
        "kv_connector_extra_config": {**_transport_config(transport), **extra},
    })
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=2, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=16, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KVBridgeWorker(config, kv_config, hash_fn_name="sha256", loopback_network=network)


@pytest.mark.parametrize("refusal", ["heartbeats_fail", "port_taken"])
def test_a_refused_worker_start_leaves_nothing_running_and_can_shut_down(
    refusal, transport, taken_port, monkeypatch, caplog
):
    caplog.set_level(logging.CRITICAL)
    network = LoopbackNetwork()
    other = None
    if refusal == "port_taken":
        if transport == "loopback":
            other = _worker(transport, network, port=taken_port)
            other.register_kv_caches({"layer.0": torch.zeros(16, 2, 1, 1, 2)})
        worker = _worker(transport, network, port=taken_port)
    else:
        _fail_heartbeats(monkeypatch)
        # opted in to the process-wide switch interval: a refused start puts it back too
        worker = _worker(transport, network, gil_switch_interval_s=0.0005)
    try:
        before, interval = Running.now(), sys.getswitchinterval()
        with pytest.raises((RuntimeError, OSError, ValueError)):
            worker.register_kv_caches({"layer.0": torch.zeros(16, 2, 1, 1, 2)})
        assert started_since(before) == _NOTHING
        assert sys.getswitchinterval() == interval
        assert worker.transport is None and worker.get_handshake_metadata() is None
        if transport == "loopback" and other is None:
            assert network.lookup(("127.0.0.1", _LOOPBACK_PORT)) is None
        worker.shutdown()  # what vLLM may call next: nothing left to close, no error
    finally:
        if other is not None:
            other.shutdown()
