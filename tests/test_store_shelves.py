"""One store keeps several block geometries apart (issue 31, "The contract users write": "keeps
each geometry's blocks apart, and never serves a block to an engine of another geometry";
docs/operations.md, "Several block geometries in one store").

Writers of another KV dtype and of another block size each open a shelf of their own on one
store: their blocks, even under the same block hashes, are stored, counted, published (in their
own index namespace, naming their shelf's pull address) and served apart; a puller reads only
its own geometry's shelf and is refused at the handshake by another's; the shelves' shares
never exceed the store's capacity; a writer beyond ``max_shelves``, or one whose index
namespace another shelf has, is refused with one error and opens nothing."""

from __future__ import annotations

import socket

import pytest
import torch
from kvbridge.connector.index import open_index
from kvbridge.connector.loop_thread import get_loop_thread
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.store import (
    OffloadItem,
    OffloadSender,
    PutGroup,
    PutRequest,
    StoreNode,
    close_store_node,
    start_store_node,
)
from kvbridge.connector.store.profile import StoreProfile
from kvbridge.connector.store.wire import (
    FRAME_HEADER,
    decode_header,
    encode_hello,
    encode_put_header,
)
from kvbridge.transport import (
    GroupRead,
    HandshakeError,
    LoopbackNetwork,
    LoopbackTransport,
    NodeMetadata,
)

A, B = b"a" * 32, b"b" * 32  # the same two hashes, written by every writer
SHELF_BLOCKS = 8  # blocks of the float32, block-size-16 geometry one shelf holds
F32_BLOCK_BYTES = 2 * (2 * 16 * 2 * 8 * 4)  # 2 layers of [2, 16, 2, 8] float32
CAPACITY = 4 * SHELF_BLOCKS * F32_BLOCK_BYTES


def _writer(name: str, *, dtype: torch.dtype = torch.float32, block_size: int = 16,
            num_layers: int = 2) -> tuple[list[torch.Tensor], NodeMetadata]:
    """A writer's layers of 8 blocks ``[8, 2, block_size, 2, 8]`` of ``dtype`` (each block's
    bytes distinct) and its handshake metadata; ``name`` is its model (and engine) name."""
    caches = [torch.randn(8, 2, block_size, 2, 8).to(dtype) for _ in range(num_layers)]
    metadata = NodeMetadata.from_kv_caches(
        engine_id=f"writer-{name}", kv_caches_by_group=[caches], model_name="model",
        hash_fn_name="sha256", model_revision="r1", kv_layout="vllm:test-layout",
        hash_root="0123456789abcdef")
    return caches, metadata


def _store(redis_url: str, max_shelves: int) -> StoreNode:
    return start_store_node(StoreNode(capacity_bytes=CAPACITY, index_url=redis_url,
                                      transport="loopback", loopback_network=LoopbackNetwork(),
                                      index_ttl_s=5.0, max_shelves=max_shelves))


@pytest.fixture
def store(redis_url):
    node = _store(redis_url, max_shelves=4)
    yield node
    close_store_node(node)


def _offload(store: StoreNode, caches, metadata) -> tuple[OffloadSender, list[bool]]:
    """Write ``A`` (block 1) and its child ``B`` (block 2) of ``caches``; returns the sender
    and whether the store holds each."""
    sender = OffloadSender(store_address=store.write_address, max_inflight_bytes=1 << 20,
                           stats=KVTransferStats())
    sender.bind([caches], metadata)
    assert sender.submit([OffloadItem(1, 0, A, b""), OffloadItem(2, 0, B, A)]) == 2
    sender.wait_idle()
    return sender, [o.held for o in sender.take_outcomes()]


def _writers():
    return {"f32": _writer("f32"), "f16": _writer("f16", dtype=torch.float16),
            "bs32": _writer("bs32", block_size=32)}


def test_writers_of_another_dtype_and_block_size_each_keep_their_blocks_on_a_shelf(store):
    writers = _writers()
    senders = {}
    for name, (caches, metadata) in writers.items():
        senders[name], held = _offload(store, caches, metadata)
        assert held == [True, True], name
    # One shelf per geometry, in the order the writers came, each with its writer's profile,
    # handshake identity and index namespace.
    assert [s.profile for s in store.shelves] == [senders[n].profile for n in writers]
    assert [s.metadata.compat_hash for s in store.shelves] == [
        m.compat_hash for _, m in writers.values()]
    assert len({s.namespace for s in store.shelves}) == 3
    assert len({s.address for s in store.shelves}) == 3
    # The same hashes, three geometries: each shelf holds its own writer's bytes.
    for shelf, (caches, _) in zip(store.shelves, writers.values(), strict=True):
        for block_hash, block_id in ((A, 1), (B, 2)):
            held = shelf.cache.block_id_of(0, block_hash)
            for layer, cache in enumerate(shelf.cache.groups[0].kv_caches):
                assert cache.dtype == caches[layer].dtype
                assert torch.equal(cache[held], caches[layer][block_id])
    # Counted per shelf, and in the store's totals.
    assert [s.stats.num_blocks_stored for s in store.shelves] == [2, 2, 2]
    assert [s.stats.num_puts for s in store.shelves] == [1, 1, 1]
    assert store.stats.num_blocks_stored == 6 and store.stats.num_puts == 3
    assert store.stats.num_put_errors == 0
    # Equal shares of the capacity, never more than the total.
    assert [s.cache.num_store_blocks for s in store.shelves] == [8, 16, 4]
    shares = [s.cache.num_store_blocks * s.profile.bytes_per_block for s in store.shelves]
    assert all(share <= CAPACITY // 4 for share in shares) and sum(shares) <= CAPACITY
    assert store.stats.capacity_blocks == 8 + 16 + 4
    # Each shelf publishes in its own namespace, its entries naming its own pull address.
    for shelf in store.shelves:
        index, directory = open_index(store.index_url, shelf.namespace)
        assert index.longest_prefix([A, B]).num_blocks == 2
        address = directory.lookup(store.engine_id)
        assert (address.host, address.port) == (shelf.address.host, shelf.address.port)
    for sender in senders.values():
        sender.close()


async def _pull(puller: LoopbackTransport, shelf, block_hashes: list[bytes]):
    await puller.start()
    try:
        remote = [shelf.cache.block_id_of(0, h) for h in block_hashes]
        reads = [GroupRead(group_id=0, remote_block_ids=remote,
                           local_block_ids=list(range(1, len(remote) + 1)),
                           expected_hashes=block_hashes)]
        return await puller.read_blocks(shelf.address, "pull", reads, deadline_s=5)
    finally:
        await puller.close()


def test_a_puller_reads_its_own_geometry_s_blocks_and_is_refused_by_another_s_shelf(store):
    writers = _writers()
    senders = [_offload(store, *writers[name])[0] for name in ("f32", "f16")]
    shelf_f32, shelf_f16 = store.shelves
    network = store._loopback_network
    loop = get_loop_thread()
    for name, shelf, other in (("f32", shelf_f32, shelf_f16), ("f16", shelf_f16, shelf_f32)):
        caches, _ = writers[name]
        mine = [torch.zeros_like(c) for c in caches]
        metadata = NodeMetadata.from_kv_caches(
            engine_id=f"puller-{name}", kv_caches_by_group=[mine], model_name="model",
            hash_fn_name="sha256", model_revision="r1", kv_layout="vllm:test-layout",
            hash_root="0123456789abcdef")
        puller = LoopbackTransport(metadata, [mine], network=network)
        result = loop.run(_pull(puller, shelf, [A, B]), 10)
        assert result.ok and result.num_blocks_landed == 2
        for layer in range(2):  # its own writer's bytes, not the other geometry's
            assert torch.equal(mine[layer][1:3], caches[layer][1:3])
        stranger = LoopbackTransport(metadata, [mine], network=network)
        with pytest.raises(HandshakeError, match="kv_cache_dtype"):
            loop.run(_pull(stranger, other, [A, B]), 10)
    assert [s.stats.num_blocks_hit for s in store.shelves] == [2, 2]
    for sender in senders:
        sender.close()


def test_a_writer_beyond_max_shelves_is_refused_and_opens_nothing(redis_url, caplog):
    store = _store(redis_url, max_shelves=2)
    try:
        writers = _writers()
        senders = [_offload(store, *writers[name]) for name in ("f32", "f16")]
        assert [held for _, held in senders] == [[True, True]] * 2
        extra, held = _offload(store, *writers["bs32"])
        assert held == [False, False] and len(store.shelves) == 2
        assert extra.stats.num_offload_failures == 1
        errors = [r.getMessage() for r in caplog.records if "bs32" in r.getMessage()
                  or "block_size" in r.getMessage()]
        assert any("keeps at most 2 geometries (--max-shelves)" in e
                   and "start another kvbridge-store for it" in e
                   and "block_size: local 16, remote 32" in e for e in errors), errors
        assert store.stats.capacity_blocks == sum(s.cache.num_store_blocks
                                                  for s in store.shelves)
        assert sum(s.cache.num_store_blocks * s.profile.bytes_per_block
                   for s in store.shelves) <= CAPACITY
        # The shelves it has still take writes.
        again, held = _offload(store, *writers["f32"])
        assert held == [True, True] and store.shelves[0].stats.num_blocks_present == 2
        for sender in (*(s for s, _ in senders), extra, again):
            sender.close()
    finally:
        close_store_node(store)


def test_a_geometry_in_another_shelf_s_index_namespace_is_refused(store):
    first, held = _offload(store, *_writer("two-layers"))
    assert held == [True, True]
    # The same identity (model, dtypes, block size, layout) with three layers: engines of both
    # would look up the same namespace, so the store refuses it.
    other, held = _offload(store, *_writer("three-layers", num_layers=3))
    assert held == [False, False] and len(store.shelves) == 1
    assert store.stats.num_put_errors == 1
    first.close()
    other.close()


def _send(sock: socket.socket, frame: bytes, payload: bytes = b"") -> dict:
    """Send one frame (and its payload); return the store's reply header."""
    sock.sendall(frame + payload)
    (size,) = FRAME_HEADER.unpack(sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
    return decode_header(sock.recv(size, socket.MSG_WAITALL))


def _put(caches, metadata, block_id: int, block_hash: bytes) -> tuple[bytes, bytes]:
    """The frame and payload of a put of one block of ``caches`` (every layer's bytes)."""
    payload = torch.stack([c[block_id] for c in caches]).contiguous().view(torch.uint8)
    put = PutRequest(compat_hash=metadata.compat_hash, groups=(PutGroup(
        group_id=0, block_hashes=(block_hash,), parent_hashes=(b"",),
        nbytes=payload.numel()),))
    return encode_put_header(put), payload.numpy().tobytes()


def test_each_connection_s_puts_go_to_the_shelf_its_hello_named(redis_url):
    store = _store(redis_url, max_shelves=2)
    writers = _writers()
    c, d = b"c" * 32, b"d" * 32
    try:
        sender, held = _offload(store, *writers["f32"])
        assert held == [True, True]
        with socket.create_connection(store.write_address, timeout=10) as sock:
            # No hello: the put goes to the one shelf of its compat_hash.
            reply = _send(sock, *_put(*writers["f32"], 3, c))
            assert (reply["type"], reply["num_stored"]) == ("put_ok", 1), reply
        assert store.shelves[0].cache.block_id_of(0, c) is not None
        with socket.create_connection(store.write_address, timeout=10) as sock:
            reply = _send(sock, encode_hello(StoreProfile.of_metadata(writers["f16"][1])))
            assert reply["type"] == "hello_ok" and len(store.shelves) == 2
            # A put of another geometry than the hello's is refused by the hello's shelf.
            reply = _send(sock, *_put(*writers["f32"], 4, d))
            assert reply["type"] == "error" and "compat_hash" in reply["error"], reply
        with socket.create_connection(store.write_address, timeout=10) as sock:
            reply = _send(sock, encode_hello(StoreProfile.of_metadata(writers["bs32"][1])))
            assert reply["type"] == "error" and "at most 2" in reply["error"], reply
            # After a refused hello the connection takes no put, even one another shelf fits.
            reply = _send(sock, *_put(*writers["f32"], 4, d))
            assert reply["type"] == "error" and "hello was refused" in reply["error"], reply
        assert all(shelf.cache.block_id_of(0, d) is None for shelf in store.shelves)
        assert store.stats.num_put_errors == 3
        sender.close()
    finally:
        close_store_node(store)


def test_the_store_s_index_calls_wait_its_socket_timeout(redis_url):
    """``index_socket_timeout_s`` (``kvbridge-store --index-socket-timeout-s``, default 0.25 s)
    reaches a shelf's index connections, its index's and its node directory's, as an engine's
    setting does; 0 is refused by name."""
    with pytest.raises(ValueError, match="index_socket_timeout_s must be > 0"):
        StoreNode(capacity_bytes=CAPACITY, index_url=redis_url, transport="loopback",
                  loopback_network=LoopbackNetwork(), index_socket_timeout_s=0.0)
    node = start_store_node(StoreNode(capacity_bytes=CAPACITY, index_url=redis_url,
                                      transport="loopback", loopback_network=LoopbackNetwork(),
                                      index_socket_timeout_s=2.0))
    try:
        sender, held = _offload(node, *_writer("f32"))  # the first writer opens the shelf
        assert held == [True, True]
        sender.close()
        [shelf] = node.shelves
        client = shelf.index_client
        for redis_client in (client.index._client, client.directory._client):
            settings = redis_client.connection_pool.connection_kwargs
            assert (settings["socket_timeout"], settings["socket_connect_timeout"]) == (2.0, 2.0)
    finally:
        close_store_node(node)
