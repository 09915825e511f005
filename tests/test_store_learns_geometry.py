"""A store started with no geometry (``kvbridge-store --index-url URL --capacity-bytes N``)
takes its block geometry from the first writer's hello: its KV tensors, its handshake (the
writer's ``BlockIdentity``) and its index namespace are the writer's. A writer of another
geometry is refused with one error naming both profiles, counted as store write failures and
logged once; the store keeps serving the first geometry and never mixes blocks. An engine of
another identity is refused at the handshake (issue 31, "The contract users write")."""

from __future__ import annotations

import logging
import socket

import msgpack
import pytest
import torch
from _store_builders import learning_store
from kvbridge.connector.index import IndexNamespace
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.store import (
    OffloadItem,
    OffloadOutcome,
    OffloadSender,
    PutGroup,
    PutRequest,
    StoreNode,
    StoreWireError,
)
from kvbridge.connector.store.profile import StoreProfile
from kvbridge.connector.store.wire import (
    FRAME_HEADER,
    STORE_SCHEMA_VERSION,
    decode_header,
    encode_hello,
)
from kvbridge.transport import HandshakeError, NodeMetadata, check_compatible

BLOCK_BYTES = 2 * 16 * 2 * 8 * 4  # one layer's block: [2, 16, 2, 8] float32


def _writer(name: str, *, block_size: int = 16) -> tuple[list[torch.Tensor], NodeMetadata]:
    """A writer's 2 layers of 8 blocks ``[8, 2, block_size, 2, 8]`` (each block's bytes
    distinct) and its handshake metadata, of the model ``name``."""
    caches = [torch.randn(8, 2, block_size, 2, 8) for _ in range(2)]
    metadata = NodeMetadata.from_kv_caches(
        engine_id=f"writer-{name}", kv_caches_by_group=[caches], model_name=name,
        hash_fn_name="sha256", model_revision="r1", kv_layout="vllm:test-layout",
        hash_root="0123456789abcdef")
    return caches, metadata


@pytest.fixture
def store(redis_url):
    yield from learning_store(redis_url, 8 * 2 * BLOCK_BYTES)


def _sender(store: StoreNode, caches, metadata, stats: KVTransferStats) -> OffloadSender:
    sender = OffloadSender(store_address=store.write_address, max_inflight_bytes=1 << 20,
                           stats=stats)
    sender.bind([caches], metadata)
    return sender


def test_a_store_without_a_profile_takes_the_first_writer_s_geometry_and_refuses_another(
    store, caplog
):
    # (0) Nothing yet: no tensors, no transport, no namespace; a put without a hello is refused.
    assert (store.profile, store.cache, store.transport, store.namespace) == (None,) * 4
    with pytest.raises(StoreWireError, match="no block geometry yet"):
        store.check_put(PutRequest(compat_hash="0" * 64, groups=(
            PutGroup(group_id=0, block_hashes=(b"a" * 32,), parent_hashes=(b"",), nbytes=0),)))
    # (1) Writer A starts: its hello at bind, before any write, gives the store A's geometry,
    # identity and namespace (the shelf opens at the engine's start, not in its first write).
    caches_a, meta_a = _writer("model-a")
    stats_a = KVTransferStats()
    sender_a = _sender(store, caches_a, meta_a, stats_a)
    sender_a.wait_idle()
    assert store.metadata.identity == meta_a.identity and store.stats.num_puts == 0
    assert sender_a.store_incarnation == store.incarnation and sender_a.take_outcomes() == []
    # A offloads two blocks into it.
    assert sender_a.submit([OffloadItem(1, 0, b"a" * 32, b""),
                            OffloadItem(2, 0, b"b" * 32, b"a" * 32)]) == 2
    sender_a.wait_idle()
    assert [o.held for o in sender_a.take_outcomes()] == [True, True]
    assert store.metadata.identity == meta_a.identity
    assert store.metadata.compat_hash == meta_a.compat_hash
    assert store.namespace == IndexNamespace(identity=meta_a.identity)
    assert store.cache.num_store_blocks == 8 and store.transport is not None
    held = store.cache.block_id_of(0, b"a" * 32)
    for layer, cache in enumerate(store.cache.groups[0].kv_caches):
        assert torch.equal(cache[held], caches_a[layer][1])
    # (2) Writer B, another model: refused, naming both profiles and the remedy; counted as a
    # store write failure, logged once however often B tries; nothing of B is stored.
    caches_b, meta_b = _writer("model-b")
    stats_b = KVTransferStats()
    caplog.set_level(logging.ERROR, logger="kvbridge.connector.store.sender")
    sender_b = _sender(store, caches_b, meta_b, stats_b)
    sender_b.wait_idle()  # refused at its hello, at bind: said then, before any write
    assert [r.getMessage() for r in caplog.records][-1].startswith(
        "offload to the store tier refused at start: ")
    assert stats_b.num_offload_failures == 0
    for i in range(3):
        assert sender_b.submit([OffloadItem(3, 0, bytes([i]) * 32, b"")]) == 1
        sender_b.wait_idle()
        assert sender_b.take_outcomes() == [OffloadOutcome(0, bytes([i]) * 32, False)]
    assert stats_b.num_offload_failures == 3 and stats_b.num_offloaded_blocks == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "model_name: local 'model-a', remote 'model-b'" in errors[0]
    assert "start another kvbridge-store for it" in errors[0]
    assert sender_a.profile.to_json() in errors[0] and sender_b.profile.to_json() in errors[0]
    assert store.stats.num_blocks_stored == 2 and store.metadata.identity == meta_a.identity
    assert store.stats.num_put_errors == 1  # B was asked once: later tries wait for the retry
    # (3) A still writes to it.
    assert sender_a.submit([OffloadItem(3, 0, b"c" * 32, b"b" * 32)]) == 1
    sender_a.wait_idle()
    assert [o.held for o in sender_a.take_outcomes()] == [True]
    # (4) An engine of B's identity pulling from the store is refused at the handshake.
    with pytest.raises(HandshakeError, match="model_name: local 'model-b', remote 'model-a'"):
        check_compatible(meta_b, store.metadata)
    for sender in (sender_a, sender_b):
        sender.close()


def test_a_store_not_up_at_a_writer_s_start_is_said_once_and_its_first_write_connects(
        redis_url, caplog):
    with socket.socket() as probe:  # a port nothing listens on: the store is not up yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    caches, metadata = _writer("model-a")
    stats = KVTransferStats()
    caplog.set_level(logging.INFO, logger="kvbridge.connector.store.sender")
    sender = OffloadSender(store_address=("127.0.0.1", port), max_inflight_bytes=1 << 20,
                           stats=stats)
    sender.bind([caches], metadata)
    sender.wait_idle()
    said = [r for r in caplog.records if "does not answer yet" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    assert said[0].getMessage().startswith(f"the store at 127.0.0.1:{port} does not answer yet")
    assert stats.num_offload_failures == 0 and sender.store_incarnation == 0
    # The store comes up on that port; the next write connects, says hello and lands.
    for store in learning_store(redis_url, 8 * 2 * BLOCK_BYTES, write_port=port):
        assert sender.submit([OffloadItem(1, 0, b"a" * 32, b"")]) == 1
        sender.wait_idle()
        assert [o.held for o in sender.take_outcomes()] == [True]
        assert store.metadata.identity == metadata.identity
        assert sender.store_incarnation == store.incarnation
    sender.close()


def test_a_writer_s_geometry_the_capacity_cannot_hold_leaves_the_store_without_one(store):
    caches, metadata = _writer("huge", block_size=4096)  # one block is more than the capacity
    stats = KVTransferStats()
    sender = _sender(store, caches, metadata, stats)
    assert sender.submit([OffloadItem(1, 0, b"a" * 32, b"")]) == 1
    sender.wait_idle()
    assert stats.num_offload_failures == 1
    assert (store.profile, store.transport) == (None, None)
    sender.close()
    # A writer that fits still gets the store.
    caches_a, meta_a = _writer("model-a")
    sender_a = _sender(store, caches_a, meta_a, KVTransferStats())
    assert sender_a.submit([OffloadItem(1, 0, b"a" * 32, b"")]) == 1
    sender_a.wait_idle()
    assert [o.held for o in sender_a.take_outcomes()] == [True]
    assert store.metadata.identity == meta_a.identity
    sender_a.close()


def _exchange(sock: socket.socket, frame: bytes) -> dict:
    """Send one frame, return the store's reply header."""
    sock.sendall(frame)
    (size,) = FRAME_HEADER.unpack(sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
    return decode_header(sock.recv(size, socket.MSG_WAITALL))


def test_a_malformed_hello_is_refused_naming_the_field_and_the_connection_goes_on(store):
    _, metadata = _writer("model-a")
    bad = msgpack.packb({"v": STORE_SCHEMA_VERSION, "type": "hello", "profile": b"\x81\xa1x\x01"},
                        use_bin_type=True)
    with socket.create_connection(store.write_address, timeout=10) as sock:
        reply = _exchange(sock, FRAME_HEADER.pack(len(bad)) + bad)
        assert reply["type"] == "error" and "field 'profile'" in reply["error"], reply
        assert store.profile is None and store.stats.num_put_errors == 1
        profile = StoreProfile.of_metadata(metadata)
        reply = _exchange(sock, encode_hello(profile))  # the same connection still serves
        assert reply == {"v": STORE_SCHEMA_VERSION, "type": "hello_ok",
                         "incarnation": store.incarnation}
    assert store.profile == profile
