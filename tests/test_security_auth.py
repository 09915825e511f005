"""Peer authentication (issue 15, "Security"): an optional cluster key, proved both ways by an
HMAC challenge-response in the transport handshake (kvbridge.transport.auth).

Shown here: a stranger process that reaches a keyed holder's port (a real subprocess, plain
sockets) gets one ``unauthenticated`` error per connection and is closed; it reads no block,
touches no lease and is never told the holder's layout; the holder counts it. Peers with the key
read bytes-exact; a requester without it, or with another key, and a keyed requester facing a
holder that cannot prove the key, are refused at handshake. The connector reads the key from
``auth_key``, ``auth_key_env`` or ``auth_key_file``, and a P/D pair with the key serves as before
while a decode node with the wrong key recomputes (right tokens) and P counts the refusal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import pytest_asyncio
from _pd_builders import long_prompt
from _transport_helpers import make_kv_caches, make_metadata
from kvbridge.connector.config import KVTransferConfig
from kvbridge.connector.errors import KVTransferConfigError
from kvbridge.connector.factory import create_engine
from kvbridge.kernels.model import ModelConfig
from kvbridge.kvmanager import SamplingParams
from kvbridge.kvmanager.engine import EngineConfig
from kvbridge.transport import GroupRead, HandshakeError, LoopbackNetwork

pytestmark = pytest.mark.timeout(120)
in_module_loop = pytest.mark.asyncio(loop_scope="module")

KEY = b"cluster-secret-0123456789abcdef"
STRANGER = Path(__file__).resolve().parent / "_stranger_peer.py"


@pytest.fixture(scope="module")
def _ucxx():
    return pytest.importorskip("ucxx")


class _Recorder:
    """The holder's callbacks, recording every call (none may come from a stranger)."""

    def __init__(self) -> None:
        self.validated: list[list[int]] = []
        self.heartbeats: list[list[str]] = []
        self.notices: list[object] = []

    def kwargs(self) -> dict:
        return {
            "block_validator": lambda g, ids, hashes, lease: self.validated.append(ids) or [],
            "on_heartbeat": lambda peer, ids, tokens: self.heartbeats.append(ids),
            "on_transfer_done": self.notices.append,
        }


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def keyed_holder(_ucxx):
    from kvbridge.transport import UcxxTransport

    caches = make_kv_caches(seed=41)
    holder = UcxxTransport(make_metadata("keyed-holder", caches), caches, auth_key=KEY)
    recorder = _Recorder()
    holder.set_callbacks(**recorder.kwargs())
    await holder.start()
    yield holder, recorder
    await holder.close()


async def _requester(key: bytes | None, name: str):
    from kvbridge.transport import UcxxTransport

    caches = make_kv_caches(seed=0)
    requester = UcxxTransport(make_metadata(name, caches), caches, auth_key=key, cma=False)
    await requester.start()
    return requester


_READ = [GroupRead(group_id=0, remote_block_ids=[5, 9], local_block_ids=[1, 2])]


@in_module_loop
async def test_a_stranger_process_reads_nothing_and_touches_no_lease(keyed_holder):
    holder, recorder = keyed_holder
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(STRANGER), str(holder.address.port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    attempts = {a["attempt"]: a for a in map(json.loads, out.decode().splitlines())}
    assert attempts["no_nonce"]["replies"] == [{"type": "ErrorMsg", "code": "unauthenticated"}]
    # a notices-only connection skips the compatibility check, never the key
    assert attempts["notices_only_no_nonce"]["replies"] == [
        {"type": "ErrorMsg", "code": "unauthenticated"}]
    # a forged proof: the challenge (harmless to reveal), then the refusal; never a HelloOk
    assert attempts["forged_proof"]["replies"] == [
        {"type": "AuthChallenge", "code": None},
        {"type": "ErrorMsg", "code": "unauthenticated"},
    ]
    assert attempts["no_hello"]["replies"] == [{"type": "ErrorMsg", "code": "bad_message"}]
    assert all(a["closed"] for a in attempts.values())
    assert recorder.validated == [] and recorder.heartbeats == [] and recorder.notices == []
    assert holder.num_active_serves == 0
    assert holder.num_refused_peers == 3


@in_module_loop
async def test_peers_with_the_key_read_and_others_are_refused(keyed_holder):
    holder, recorder = keyed_holder
    refused_before = holder.num_refused_peers
    friend = await _requester(KEY, "friend")
    try:
        result = await friend.read_blocks(holder.address, "r", _READ, deadline_s=20)
        assert result.ok and result.num_blocks_landed == 2
        source = make_kv_caches(seed=41)
        for layer, dst in enumerate(friend.kv_caches_by_group[0]):
            assert dst[[1, 2]].view(-1).equal(source[0][layer][[5, 9]].view(-1))
        await friend.send_heartbeat(holder.address, ["r"], ["t"])
        for _ in range(100):
            if recorder.heartbeats:
                break
            await asyncio.sleep(0.01)
        assert recorder.heartbeats == [["r"]]
    finally:
        await friend.close()
    for key, name in ((None, "keyless"), (b"another-secret-0123456789", "wrong-key")):
        other = await _requester(key, name)
        try:
            with pytest.raises(HandshakeError, match="cluster key"):
                await other.connect(holder.address)
        finally:
            await other.close()
    assert holder.num_refused_peers == refused_before + 1  # the keyless one reached the holder
    # (the wrong key failed the holder's proof first: the requester hung up before proving)
    keyless_holder = await _requester(None, "keyless-holder")
    keyed = await _requester(KEY, "keyed-requester")
    try:  # a holder that cannot prove the key might serve forged KV: refused by the requester
        with pytest.raises(HandshakeError, match="did not prove the cluster key"):
            await keyed.connect(keyless_holder.address)
    finally:
        await keyed.close()
        await keyless_holder.close()


@in_module_loop
async def test_an_incompatible_peers_notice_needs_the_key_too(keyed_holder):
    # a keyed peer the holder refuses for its layout still frees a lease (a notices-only
    # connection); without the key its notice is refused like everything else
    from kvbridge.transport import UcxxTransport

    holder, recorder = keyed_holder
    for key, name in ((KEY, "keyed-other"), (None, "keyless-other")):
        caches = make_kv_caches(seed=0, block_size=32)
        other = UcxxTransport(make_metadata(name, caches), caches, auth_key=key, cma=False)
        await other.start()
        try:
            with pytest.raises(HandshakeError, match="block_size" if key else "cluster key"):
                await other.connect(holder.address)
            notice = other.notify_transfer_done(holder.address, "p-1", success=False,
                                                reason="", token="tok")
            if key is None:
                with pytest.raises(HandshakeError, match="cluster key"):
                    await notice
                continue
            await notice
            for _ in range(200):
                if recorder.notices:
                    break
                await asyncio.sleep(0.005)
        finally:
            await other.close()
    assert [(n.peer_engine_id, n.request_id) for n in recorder.notices] == [("keyed-other", "p-1")]


# ----------------------------------------------------------------------------- configuration


def test_the_key_comes_from_the_config_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    def config(**extra) -> KVTransferConfig:
        return KVTransferConfig.from_dict({"kv_connector_extra_config": extra})

    assert config().auth_key_bytes() is None
    assert config(auth_key=KEY.decode()).auth_key_bytes() == KEY
    assert KEY.decode() not in repr(config(auth_key=KEY.decode()))  # never in a log line
    monkeypatch.setenv("KVB_TEST_KEY", KEY.decode())
    assert config(auth_key_env="KVB_TEST_KEY").auth_key_bytes() == KEY
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    assert config(auth_key_file=str(key_file)).auth_key_bytes() == KEY
    for extra, message in (
        ({"auth_key": "short"}, "at least 16 bytes"),
        ({"auth_key_env": "KVB_TEST_UNSET"}, "KVB_TEST_UNSET"),
        ({"auth_key_file": str(tmp_path / "missing")}, "auth_key_file"),
        ({"auth_key": KEY.decode(), "auth_key_env": "KVB_TEST_KEY"}, "at most one"),
        ({"auth_key": 12345}, "must be a string"),
    ):
        with pytest.raises(KVTransferConfigError, match=message):
            config(**extra)


def _node(network: LoopbackNetwork, engine_id: str, role: str, key: str | None):
    extra = {"transport": "loopback", "heartbeat_interval_s": 0.05, "load_timeout_s": 5.0}
    if key is not None:
        extra["auth_key"] = key
    config = EngineConfig(num_blocks=64, block_size=16, max_model_len=256)
    kv_transfer_config = {"kv_role": role, "engine_id": engine_id,
                          "kv_connector_extra_config": extra}
    return create_engine(ModelConfig.tiny(), config, kv_transfer_config, loopback_network=network)


def _run(engine, request_id, prompt, params, max_tokens):
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens), params)
    for _ in range(2000):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
    raise AssertionError(f"{request_id} did not finish")


def test_pd_pair_with_the_key_pulls_and_a_decode_node_with_another_recomputes():
    network = LoopbackNetwork()
    p = _node(network, "p0", "kv_producer", KEY.decode())
    good_d = _node(network, "d-good", "kv_consumer", KEY.decode())
    bad_d = _node(network, "d-bad", "kv_consumer", "a-different-secret-000")
    engines = [p, good_d, bad_d]
    try:
        prompt = long_prompt(50)
        expected = p.generate([prompt], max_tokens=3)[0].token_ids  # no params: one node
        for name, d in (("good", good_d), ("bad", bad_d)):
            out = _run(p, f"p-{name}", prompt, {"do_remote_decode": True}, 1)
            p.step()  # hands the lease to P's worker half
            got = _run(d, f"d-{name}", prompt, out.kv_transfer_params, 3)
            assert got.token_ids == expected, name
        assert good_d.scheduler.connector.stats.snapshot()["num_loads"] == 1
        assert bad_d.scheduler.connector.stats.snapshot()["num_loads"] == 0
        assert bad_d.scheduler.connector.stats.snapshot()["num_failed_loads"] == 1
        p_transport = p.runner.connector.worker_half.transport
        assert p_transport.num_refused_peers == 0  # the bad D refused P's proof first
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_store_node_with_the_key_serves_only_keyed_peers():
    from kvbridge.connector.store.node import StoreNode
    from kvbridge.transport import LoopbackTransport

    network = LoopbackNetwork()
    model = ModelConfig.tiny()
    store = StoreNode(model, block_size=16, capacity_bytes=1 << 20, transport="loopback",
                      loopback_network=network, auth_key=KEY)

    async def scenario() -> None:
        await store.start()
        try:
            caches = store.kv_caches_by_group
            for key, ok in ((KEY, True), (None, False)):
                metadata = dataclasses.replace(store.metadata, engine_id=f"peer-{ok}")
                peer = LoopbackTransport(metadata, caches, network=network, auth_key=key)
                await peer.start()
                if ok:
                    assert (await peer.connect(store.address)).engine_id == "store-0"
                else:
                    with pytest.raises(HandshakeError, match="cluster key"):
                        await peer.connect(store.address)
            assert store.transport.num_refused_peers == 1
        finally:
            await store.close()

    asyncio.run(scenario())
