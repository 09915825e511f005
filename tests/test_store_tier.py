"""The remote store tier (issue 7): a store node over the loopback transport and a real Redis
index; nodes offload cold cached blocks to it and pull them back through the index. One test
runs the store as its own process (``kvbridge-store``) and restores over UCX; the last
ones test offload's two halves (``OffloadPlanner``, ``OffloadSender``) on their own."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import _store_builders
import msgpack
import pytest
import redis
import torch
from _engine_builders import reference_greedy, tiny_model
from _ipv6 import require_ipv6_loopback
from _pd_builders import assert_node_empty, long_prompt, run_to_completion
from _running import Running, started_since
from kvbridge.connector.factory import create_engine
from kvbridge.connector.loop_thread import LoopThread, get_loop_thread
from kvbridge.connector.metadata import (
    KVBridgeWorkerMeta,
    decode_worker_meta,
    encode_worker_meta,
)
from kvbridge.connector.serve.store_server import DEFAULT_MAX_SHELVES
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.store.cache import ROOT_PARENT, StoreCache
from kvbridge.connector.store.node import (
    StoreNode,
    close_store_node,
    start_store_node,
    store_kv_caches,
)
from kvbridge.connector.store.offload_items import (
    OffloadItem,
    OffloadOutcome,
    items_from_wire,
    outcomes_from_wire,
)
from kvbridge.connector.store.planner import OffloadPlanner
from kvbridge.connector.store.sender import OffloadSender
from kvbridge.connector.store.wire import (
    MAX_GROUPS,
    MAX_HEADER_BYTES,
    PutGroup,
    PutReply,
    PutRequest,
    StoreWireError,
    decode_header,
    decode_reply,
    encode_reply,
)
from kvbridge.connector.store.writer import StoreWriter
from kvbridge.kvmanager import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    Request,
    SamplingParams,
    get_request_block_hasher,
)
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.transport import LoopbackNetwork, NodeMetadata, format_host_port

BLOCK_SIZE = 16
MAX_TOKENS = 3
NUM_BLOCKS = 24  # 23 usable: one 20-block prompt evicts most of another one's blocks


def make_store(
    network: LoopbackNetwork, index_url: str, *, capacity_blocks: int, **kw
) -> StoreNode:
    """A started store of ``capacity_blocks`` tiny-model blocks (4 layers of float32)."""
    return _store_builders.make_store(
        network, index_url=index_url, capacity_blocks=capacity_blocks, engine_id="store-0",
        index_ttl_s=5.0, **kw,
    )


def make_node(
    engine_id: str,
    network: LoopbackNetwork | None,
    index_url: str,
    store: StoreNode | None,
    **extra,
) -> Engine:
    """A node with a 24-block pool; with ``store``, it offloads to it (policy evict). ``extra``
    overrides ``kv_connector_extra_config`` (e.g. ``transport="ucxx"`` with ``network=None``)."""
    config = EngineConfig(
        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=360, max_num_batched_tokens=512
    )
    store_extra = {}
    if store is not None:
        store_extra = {"store_url": store.store_url, "offload": "evict"}
    kv_transfer_config = {
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "transport": "loopback",
            "index_url": index_url,
            "index_ttl_s": 5.0,
            "heartbeat_interval_s": 0.1,
            "load_timeout_s": 5.0,
            "offload_blocks_per_step": 64,
            **store_extra,
            **extra,
        },
    }
    return create_engine(
        tiny_model(hybrid=False), config, kv_transfer_config, loopback_network=network
    )


@pytest.fixture
def network():
    return LoopbackNetwork()


@pytest.fixture
def cleanup():
    engines: list[Engine] = []
    stores: list[StoreNode] = []
    yield engines, stores
    for engine in engines:
        engine.shutdown()
    for store in stores:
        close_store_node(store)


def serve(engine: Engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    output = run_to_completion(engine, request_id)
    engine.step()  # the step after the finish: its blocks are free and get offloaded now
    offloader = engine.runner.connector.worker_half.offload_sender
    if offloader is not None:
        offloader.wait_idle()
        engine.step()  # the worker's counters and outcomes reach the scheduler half
    return output


def store_and_node(network, redis_url, cleanup, *, capacity_blocks: int):
    """A store of ``capacity_blocks`` blocks and node "node-a" offloading to it (both closed by
    the ``cleanup`` fixture)."""
    engines, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=capacity_blocks)
    stores.append(store)
    node = make_node("node-a", network, redis_url, store)
    engines.append(node)
    return store, node


def two_documents() -> tuple[list[int], list[int]]:
    """Two unrelated 20-block prompts (plus a partial block each)."""
    prompt_a = long_prompt(20 * BLOCK_SIZE + 5)
    prompt_b = long_prompt(20 * BLOCK_SIZE + 5, salt="Another document entirely. ")
    return prompt_a, prompt_b


def stats(engine: Engine) -> dict:
    return engine.scheduler.connector.stats.snapshot()


def hashes_of(engine: Engine, prompt: list[int]) -> list[bytes]:
    probe = Request(
        "probe",
        prompt,
        SamplingParams(max_tokens=1),
        block_hasher=engine.kv_cache_manager.request_block_hasher,
    )
    return list(probe.block_hashes)


def store_depth(store: StoreNode, hashes: list[bytes]) -> int:
    """Blocks of ``hashes`` the index lists for the store, from block 0 (after the store's
    queued publishes reached the index: ``IndexClient.publish`` returns at once)."""
    assert store.index_client.flush()
    index = store.index_client.index
    hit = index.longest_prefix(hashes, (0,), all_holders=True)
    return max((h.num_blocks for h in hit.holders if h.node_id == store.engine_id), default=0)


def test_evicted_prefix_is_offloaded_then_restored_with_equal_greedy_tokens(
    network, redis_url, cleanup
):
    store, node = store_and_node(network, redis_url, cleanup, capacity_blocks=64)
    prompt_a, prompt_b = two_documents()

    # (1) A runs; at the next step its 20 full blocks (ref_cnt 0, hashed) go to the store.
    out = serve(node, "a-0", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    s = stats(node)
    # 325 + 3 tokens fill 20 blocks (hashed) and part of a 21st (never hashed, never offloaded);
    # all 20 go in one step (64 per step allowed).
    assert s["num_offloaded_blocks"] == 20
    assert s["bytes_offloaded"] == 20 * store.cache.groups[0].block_nbytes
    hashes_a = hashes_of(node, prompt_a)
    assert store_depth(store, hashes_a[:20]) == 20

    # (2) B needs 21 of the 23 usable blocks: the 2 never-used blocks, A's unhashed 21st, then
    # A's hashed blocks from the free queue's head. A freed in reverse order, so its blocks
    # 19..2 go and its blocks 0 and 1 (the tail of the free queue) stay cached on the node.
    serve(node, "b-0", prompt_b)
    pool = node.kv_cache_manager.block_pool
    assert [pool.get_cached_block(h, [0]) is not None for h in hashes_a[:3]] == [True, True, False]

    # (3) A again: 2 blocks from local APC, the index names the store (20 blocks), the node
    # pulls the 18 it lacks.
    out = serve(node, "a-1", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    s = stats(node)
    assert s["store_hit_tokens"] == 18 * BLOCK_SIZE
    assert s["num_restored_blocks"] == 18
    assert s["bytes_restored"] == 18 * store.cache.groups[0].block_nbytes
    assert s["num_failed_loads"] == 0
    # The model only ran the 5 tokens past the 320 cached ones (a recompute would run 325).
    assert out.num_cached_tokens == 20 * BLOCK_SIZE
    assert store.stats.num_blocks_hit == 18 and store.stats.hit_ratio == 1.0
    assert_node_empty(node)


def test_a_shared_first_block_in_use_is_offloaded_so_a_prefix_below_it_comes_back(
    network, redis_url, cleanup
):
    store, node = store_and_node(network, redis_url, cleanup, capacity_blocks=64)
    system = long_prompt(BLOCK_SIZE, salt="You are a helpful assistant. ")  # one whole block
    prompt_s = system + long_prompt(BLOCK_SIZE + 5, salt="Keep talking. ")
    prompt_a = system + long_prompt(9 * BLOCK_SIZE + 5)
    prompt_c = long_prompt(16 * BLOCK_SIZE + 5, salt="Another document entirely. ")
    hashes_a = hashes_of(node, prompt_a)[:10]
    # (1) S, a long request, holds the shared first block for the whole test.
    node.add_request("s", prompt_s, SamplingParams(max_tokens=40))
    node.step()
    # (2) A (the system block and 9 blocks of its own) runs and finishes: its 9 blocks go
    # cold; the first block, in use by S, is written too, before them, so the store anchors
    # A's chain and the index lists all 10 of its blocks on the store. (Cold blocks alone
    # were held but never listed: depth 0.)
    out = serve(node, "a-0", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    assert stats(node)["num_offloaded_blocks"] == 10
    assert store_depth(store, hashes_a) == 10
    pool = node.kv_cache_manager.block_pool
    assert pool.get_cached_block(hashes_a[0], [0])[0].ref_cnt == 1  # still S's, never cold
    # (3) C (17 blocks) takes A's partial block (unhashed: the queue's front) and the 10
    # never-used blocks, then 6 of A's hashed ones from the queue's head, where A's tail is
    # (A freed in reverse): blocks 9..4. S's 3 blocks are not free; A's blocks 1..3 stay.
    serve(node, "c-0", prompt_c)
    cached = [pool.get_cached_block(h, [0]) is not None for h in hashes_a]
    assert cached == [True] * 4 + [False] * 6
    # (4) A again: 4 blocks from local APC, the other 6 pulled from the store.
    out = serve(node, "a-1", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    s = stats(node)
    assert (s["store_hit_tokens"], s["num_restored_blocks"]) == (6 * BLOCK_SIZE, 6)
    assert s["num_failed_loads"] == 0
    out = run_to_completion(node, "s")
    assert out.token_ids == reference_greedy(prompt_s, 40, hybrid=False)
    assert_node_empty(node)


def test_store_full_drops_coldest_blocks_and_their_entries_then_requests_fall_back(
    network, redis_url, cleanup
):
    engines, stores = cleanup
    # Room for 24 blocks: A's 20 blocks, then B's 20 push out A's 16 coldest ones.
    store = make_store(network, redis_url, capacity_blocks=24)
    stores.append(store)
    node = make_node("node-a", network, redis_url, store)
    engines.append(node)
    prompt_a = long_prompt(20 * BLOCK_SIZE + 5)
    prompt_b = long_prompt(20 * BLOCK_SIZE + 5, salt="Another document entirely. ")
    serve(node, "a-0", prompt_a)
    hashes_a = hashes_of(node, prompt_a)[:20]
    assert store_depth(store, hashes_a) == 20
    serve(node, "b-0", prompt_b)  # evicts A on the node; B's blocks go to the store
    hashes_b = hashes_of(node, prompt_b)[:20]
    assert store_depth(store, hashes_b) == 20
    # The store's LRU order was A (offloaded tail first: block 19 ... 0), then B: the 16
    # coldest are A's blocks 19..4; A's blocks 0..3 are left.
    assert store.stats.num_blocks_dropped == 16
    assert store.cache.num_held() == 24
    held = [store.cache.block_id_of(0, h) is not None for h in hashes_a]
    assert held == [True] * 4 + [False] * 16
    assert store_depth(store, hashes_a) == 4

    # A again: only 4 blocks restorable; the node pulls them and computes the rest.
    out = serve(node, "a-1", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    assert out.num_cached_tokens == 4 * BLOCK_SIZE
    assert stats(node)["num_failed_loads"] == 0
    assert_node_empty(node)


def test_store_restart_vanishes_from_index_and_serves_no_old_block(network, redis_url, cleanup):
    engines, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=64)
    node = make_node("node-a", network, redis_url, store)
    engines.append(node)
    prompt_a = long_prompt(20 * BLOCK_SIZE + 5)
    prompt_b = long_prompt(20 * BLOCK_SIZE + 5, salt="Another document entirely. ")
    serve(node, "a-0", prompt_a)
    serve(node, "b-0", prompt_b)
    hashes_a = hashes_of(node, prompt_a)[:20]
    old_incarnation = store.incarnation
    # (1) The store restarts empty (a new incarnation, same id): A's entries vanish.
    close_store_node(store)
    restarted = make_store(network, redis_url, capacity_blocks=64)
    stores.append(restarted)
    assert restarted.incarnation > old_incarnation
    assert store_depth(restarted, hashes_a) == 0
    # (2) A again: nothing to restore (no pull, no read of a block the new store lacks).
    out = serve(node, "a-1", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    s = stats(node)
    assert (s["store_hit_tokens"], s["num_restored_blocks"], s["num_failed_loads"]) == (0, 0, 0)
    assert restarted.stats.num_blocks_requested == 0
    assert_node_empty(node)


def test_stale_index_entry_for_a_block_the_store_no_longer_holds_is_a_load_error_then_recompute(
    network, redis_url, cleanup
):
    store, node = store_and_node(network, redis_url, cleanup, capacity_blocks=64)
    prompt_a, prompt_b = two_documents()
    serve(node, "a-0", prompt_a)
    serve(node, "b-0", prompt_b)
    hashes_a = hashes_of(node, prompt_a)[:20]
    # The store forgets block 7's hash behind the index's back (as if reused): the index still
    # lists it, the store's hash check refuses it.
    group = store.cache.groups[0]
    block_id = group.hash_to_block_id[hashes_a[7]]
    group.block_id_to_hash[block_id] = b"\x00" * len(hashes_a[7])
    out = serve(node, "a-1", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    s = stats(node)
    # One pull of blocks 2..19 (0 and 1 are still cached locally, see the first test); block 7
    # failed the store's hash check: 17 landed, the request recomputed from block 7 (token 112).
    assert s["num_failed_loads"] == 1 and s["num_load_errors_blocks"] == 1
    assert s["num_restored_blocks"] == 17
    assert store.stats.num_blocks_requested == 18 and store.stats.num_blocks_hit == 17
    assert_node_empty(node)


# ---------------------------------------------------------------------- bad writes
def test_a_node_of_another_model_revision_never_writes_to_nor_restores_from_the_store(
    network, redis_url, cleanup
):
    # Issue 28 item 7, store tier: a store keeps the blocks of one block identity. A node of
    # another revision of the model (its KV differs under the same hashes) has its puts
    # refused (the put's compat_hash covers the identity) and never finds the store's blocks
    # in the index (another namespace). Before, model_revision was no setting at all.
    engines, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=64, model_revision="5d0f2ab1")
    stores.append(store)
    node = make_node("node-a", network, redis_url, store)  # revision "" (unknown)
    engines.append(node)
    namespace = node.scheduler.connector.scheduler_half.index_client.index.namespace
    assert namespace.key_prefix != store.namespace.key_prefix
    prompt_a, prompt_b = two_documents()
    # (1) A, then B evicts most of A: A's cold blocks go to the store, which refuses them.
    serve(node, "a-0", prompt_a)
    serve(node, "b-0", prompt_b)
    s = stats(node)
    assert s["num_offloaded_blocks"] == 0 and s["num_offload_failures"] >= 1
    assert store.cache.num_held() == 0 and store.stats.num_put_errors >= 1
    # (2) A again: nothing comes from the store, the node computes it (right tokens).
    out = serve(node, "a-1", prompt_a)
    assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
    s = stats(node)
    assert (s["store_hit_tokens"], s["num_restored_blocks"], s["num_failed_loads"]) == (0, 0, 0)
    assert_node_empty(node)


def _raw_put(address: tuple[str, int], frame: bytes) -> dict:
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(frame)
        (n,) = struct.unpack(">I", sock.recv(4))
        data = b""
        while len(data) < n:
            data += sock.recv(n - len(data))
        return msgpack.unpackb(data)


def _header_frame(header: dict, payload: bytes = b"") -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(raw)) + raw + payload


def test_malformed_and_wrong_size_writes_are_errors_for_that_writer_and_the_store_keeps_serving(
    network, redis_url, cleanup
):
    engines, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=8)
    stores.append(store)
    address = store.write_address
    good = {
        "v": 1,
        "type": "put",
        "compat_hash": store.metadata.compat_hash,
        "payload_nbytes": 10,
        "groups": [
            {"group_id": 0, "block_hashes": [b"h" * 32], "parent_hashes": [b""], "nbytes": 10}
        ],
    }
    # Wrong size: 10 bytes for a block of block_nbytes.
    reply = _raw_put(address, _header_frame(good, b"x" * 10))
    assert reply["type"] == "error" and "nbytes 10" in reply["error"]
    # Unknown schema version, not msgpack, a field of the wrong type.
    assert _raw_put(address, _header_frame({**good, "v": 9}))["type"] == "error"
    assert _raw_put(address, struct.pack(">I", 3) + b"\xc1\xc1\xc1")["type"] == "error"
    bad_group = {**good, "groups": [{**good["groups"][0], "group_id": "zero"}]}
    assert "group_id" in _raw_put(address, _header_frame(bad_group))["error"]
    # Another model's compat hash.
    other = {**good, "compat_hash": "f" * 64}
    assert "compat_hash" in _raw_put(address, _header_frame(other, b"x" * 10))["error"]
    assert store.stats.num_put_errors == 5
    assert store.cache.num_held() == 0

    # The store still serves: a node offloads and restores through it.
    node = make_node("node-a", network, redis_url, store)
    engines.append(node)
    prompt = long_prompt(5 * BLOCK_SIZE + 3)
    serve(node, "a-0", prompt)
    assert stats(node)["num_offloaded_blocks"] == 5


def _recv_reply(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    return msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))


def test_a_content_error_keeps_the_connection_and_later_frames_of_any_size_land(
    network, redis_url, cleanup
):
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=8)
    stores.append(store)
    nbytes = store.cache.groups[0].block_nbytes

    def put_frame(hashes: list[bytes], payload: bytes, *, nbytes_per_block: int = nbytes) -> bytes:
        header = {
            "v": 1,
            "type": "put",
            "compat_hash": store.metadata.compat_hash,
            "payload_nbytes": len(payload),
            "groups": [
                {
                    "group_id": 0,
                    "block_hashes": hashes,
                    "parent_hashes": [b"", *hashes[:-1]],
                    "nbytes": nbytes_per_block * len(hashes),
                }
            ],
        }
        return _header_frame(header, payload)

    with socket.create_connection(store.write_address, timeout=5) as sock:
        # (1) A wrong size (one byte short of a block): the payload is consumed, error reply.
        sock.sendall(put_frame([b"a" * 32], b"x" * (nbytes - 1), nbytes_per_block=nbytes - 1))
        assert "nbytes" in _recv_reply(sock)["error"]
        # (2) Same connection: 3 blocks (a larger receive buffer), then 1 block (reuses it).
        sock.sendall(put_frame([b"b" * 32, b"c" * 32, b"d" * 32], b"\x01" * (3 * nbytes)))
        assert _recv_reply(sock)["num_stored"] == 3
        sock.sendall(put_frame([b"e" * 32], b"\x02" * nbytes))
        assert _recv_reply(sock)["num_stored"] == 1
    # Each block's bytes landed in its own store block (1 byte = one uint8 in every layer).
    group = store.cache.groups[0]
    for block_hash, value in [(b"c" * 32, 1), (b"e" * 32, 2)]:
        block_id = store.cache.block_id_of(0, block_hash)
        assert all(bool((c[block_id].view(torch.uint8) == value).all()) for c in group.kv_caches)
    assert store.stats.num_put_errors == 1 and store.cache.num_held() == 4


def test_a_put_the_store_refuses_is_an_error_for_the_writer(network, redis_url, cleanup):
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=8)
    stores.append(store)

    writer = StoreWriter(*store.write_address)
    put = PutRequest(
        compat_hash=store.metadata.compat_hash,
        groups=(PutGroup(group_id=0, block_hashes=(b"h" * 32,), parent_hashes=(b"",), nbytes=4),),
    )
    loop = get_loop_thread()
    with pytest.raises(StoreWireError, match="nbytes 4"):
        loop.run(writer.put(put, [memoryview(b"abcd")]), 10)
    # The writer reconnects and a good put lands.
    nbytes = store.cache.groups[0].block_nbytes
    group = PutGroup(group_id=0, block_hashes=(b"h" * 32,), parent_hashes=(b"",), nbytes=nbytes)
    good = PutRequest(compat_hash=store.metadata.compat_hash, groups=(group,))
    reply = loop.run(writer.put(good, [memoryview(bytes(nbytes))]), 10)
    assert (reply.num_stored, reply.num_present, reply.num_refused) == (1, 0, 0)
    loop.run(writer.close(), 5)


def _put_to_a_fake_store(reply_frame: bytes, block_hashes: tuple[bytes, ...]) -> PutReply:
    """A put of ``block_hashes`` (group 0, roots, 4 bytes in all) by a ``StoreWriter`` to a
    store that answers ``reply_frame`` whatever it gets; what the writer returns or raises."""
    server = socket.create_server(("127.0.0.1", 0))

    def fake_store() -> None:
        conn, _ = server.accept()
        with conn:
            header = _recv_reply(conn)
            conn.recv(header["payload_nbytes"], socket.MSG_WAITALL)
            conn.sendall(reply_frame)

    thread = threading.Thread(target=fake_store)
    thread.start()
    writer = StoreWriter(*server.getsockname())
    group = PutGroup(group_id=0, block_hashes=block_hashes,
                     parent_hashes=(b"",) * len(block_hashes), nbytes=4)
    loop = get_loop_thread()
    try:
        return loop.run(writer.put(PutRequest(compat_hash="c", groups=(group,)),
                                   [memoryview(b"abcd")]), 10)
    finally:
        loop.run(writer.close(), 5)
        thread.join(5)
        server.close()


def test_the_writer_takes_a_reply_as_long_as_a_store_may_send():
    # A store frames replies of up to MAX_HEADER_BYTES. A put of 40,000 blocks whose
    # ancestors the store dropped gets a reply of over 1 MiB (one name a block), which the
    # writer once refused (its own 1 MiB cap), failing a put the store had taken.
    hashes = tuple(i.to_bytes(32, "big") for i in range(40_000))
    names = tuple((0, b"p" + h[1:]) for h in hashes)
    reply_frame = encode_reply(PutReply(40_000, 0, 0, (), names, store_incarnation=9))
    assert 1 << 20 < len(reply_frame) <= MAX_HEADER_BYTES
    reply = _put_to_a_fake_store(reply_frame, hashes)
    assert reply.missing_ancestors == names and reply.store_incarnation == 9


def test_a_reply_that_does_not_answer_the_put_is_an_error_for_it():
    # A faulty store's names would make the writer's planner write blocks again: a reply that
    # refuses a block the put did not send, names more ancestors than the put has blocks, or
    # names one in another group is refused, and the put counts as failed.
    hashes = (b"a" * 32, b"b" * 32)
    for reply, message in (
        (PutReply(1, 0, 1, ((0, b"x" * 32),)), "refuses 1 block"),
        (PutReply(2, 0, 0, (), ((0, b"p" * 32),) * 3), "names 3 missing ancestors"),
        (PutReply(2, 0, 0, (), ((1, b"p" * 32),)), "in a group the put did not write"),
    ):
        with pytest.raises(StoreWireError, match=message):
            _put_to_a_fake_store(encode_reply(reply), hashes)
    good = PutReply(1, 0, 1, ((0, hashes[1]),), ((0, b"p" * 32),) * 2)
    assert _put_to_a_fake_store(encode_reply(good), hashes) == good


# ---------------------------------------------------------------------- store in its own process
_STORE_MAIN = "kvbridge.connector.serve.store_server"
_PROCESS_TIMEOUT_S = 60.0


def _start_store_process(
    redis_url: str, *, capacity_blocks: int, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen, dict]:
    """``kvbridge-store`` as a child process listening on ``host``, from the plain command line
    (no model or profile: it learns the writer's geometry; ``capacity_blocks`` is one shelf's,
    ``DEFAULT_MAX_SHELVES`` of them in the capacity); returns it and its "serving" JSON line."""
    model = tiny_model(hybrid=False).config
    per_block = 2 * BLOCK_SIZE * model.num_kv_heads * model.head_dim * 4 * model.num_layers
    proc = subprocess.Popen(
        [sys.executable, "-m", _STORE_MAIN, "--index-url", redis_url,
         "--capacity-bytes", str(capacity_blocks * per_block * DEFAULT_MAX_SHELVES),
         "--host", host],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # blocks until the store serves (or exits)
        if line.startswith("{"):  # UCX may print warnings on stdout first
            return proc, json.loads(line)
    raise AssertionError(f"store process exited with code {proc.wait()} before serving")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_store_in_its_own_process_takes_offloads_and_serves_restores_over_ucx(request, host):
    """With ``host`` ``::1`` every address is IPv6 (issue 28, item 2): the index is a Redis on
    ``redis://[::1]:PORT/0``, the store's write server and pull endpoint and the node listen on
    ``::1``, the store hands out ``store_url`` ``[::1]:PORT`` and the node writes there. The
    store is started with no model: it takes the kvbridge node's geometry from its hello."""
    if host == "::1":
        require_ipv6_loopback()
    redis_url = request.getfixturevalue("redis_url_ipv6" if host == "::1" else "redis_url")
    proc, serving = _start_store_process(redis_url, capacity_blocks=64, host=host)
    node = None
    try:
        # No geometry until the first writer: no pull address, no capacity in blocks yet.
        assert (serving["capacity_blocks"], serving["pull_address"]) == (None, None)
        write_port = int(serving["store_url"].rpartition(":")[2])
        assert serving["store_url"] == format_host_port(host, write_port)  # [::1]:PORT
        # The node runs here with a UCX transport; the store's write server and its UCX pull
        # endpoint are in the child process, the index is the real Redis.
        node = make_node(
            "node-ucx",
            None,
            redis_url,
            None,
            transport="ucxx",
            host=host,
            port=0,
            load_timeout_s=30.0,
            store_url=serving["store_url"],
            offload="evict",
        )
        prompt_a = long_prompt(20 * BLOCK_SIZE + 5)
        prompt_b = long_prompt(20 * BLOCK_SIZE + 5, salt="Another document entirely. ")
        # (1) A's 20 full blocks go to the store process once A is done.
        out = serve(node, "a-0", prompt_a)
        assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
        assert stats(node)["num_offloaded_blocks"] == 20
        # (2) B evicts A's blocks 2..19 on the node (as in the first test of this file).
        serve(node, "b-0", prompt_b)
        # (3) A again: 2 blocks from local APC, 18 pulled from the store process over UCX.
        out = serve(node, "a-1", prompt_a)
        assert out.token_ids == reference_greedy(prompt_a, MAX_TOKENS, hybrid=False)
        s = stats(node)
        assert (s["store_hit_tokens"], s["num_restored_blocks"]) == (18 * BLOCK_SIZE, 18)
        assert s["num_failed_loads"] == 0
        # Only the 5 tokens past the 320 restored or cached ones went through the model.
        assert out.num_cached_tokens == 20 * BLOCK_SIZE
        assert_node_empty(node)
    finally:
        if node is not None:
            node.shutdown()
        proc.send_signal(signal.SIGTERM)
        try:
            tail, _ = proc.communicate(timeout=_PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # The store's own counters, printed as it stopped: A and B (20 blocks each) stored, the
    # 18 blocks served, no bad put.
    last_json = [line for line in tail.splitlines() if line.startswith('{"stats"')][-1]
    final = json.loads(last_json)
    store_stats = final["stats"]
    # One shelf (one geometry): its counters are the totals, its profile the node's.
    [shelf] = final["shelves"]
    assert shelf["stats"] == store_stats
    assert shelf["profile"]["identity"]["block_size"] == BLOCK_SIZE
    assert store_stats["num_blocks_stored"] == 40
    assert (store_stats["num_blocks_requested"], store_stats["num_blocks_hit"]) == (18, 18)
    assert store_stats["num_put_errors"] == 0
    assert store_stats["capacity_blocks"] == 64  # the node's (tiny model's) geometry, taken
    assert proc.returncode == 0


# ---------------------------------------------------------------------- offload halves
# The scheduler half's OffloadPlanner against a real BlockPool, the worker half's OffloadSender
# against a real store node, and both across a msgpack boundary (as in two processes).
def _cold_pool(
    *, num_full_blocks: int = 4, free: bool = True
) -> tuple[BlockPool, list[bytes], list]:
    """A 10-block pool with events on: blocks 1..5 taken, 1..``num_full_blocks`` cached as one
    request's chain; with ``free``, all freed in reverse (a finished request), so the queue is
    ``[5, 6, 7, 8, 9, 4, 3, 2, 1]``. Returns the pool, the chain's hashes and its events."""
    pool = BlockPool(10, enable_caching=True, enable_kv_cache_events=True)
    request = Request(
        "r",
        long_prompt(num_full_blocks * BLOCK_SIZE + 3),
        SamplingParams(max_tokens=1),
        block_hasher=get_request_block_hasher(BLOCK_SIZE),
    )
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(
        request, blocks, request.block_hashes, 0, num_full_blocks, BLOCK_SIZE, 0
    )
    if free:
        pool.free_blocks(reversed(blocks))
    return pool, list(request.block_hashes), pool.take_events()


def _item(block_id: int, hashes: list[bytes], position: int) -> OffloadItem:
    """The item for chain position ``position`` in block ``block_id`` (group 0)."""
    parent = hashes[position - 1] if position else b""
    return OffloadItem(block_id, 0, hashes[position], parent)


def test_planner_picks_cold_chains_root_first_once_each_until_reported():
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="evict", blocks_per_step=2, scan_blocks=100)
    assert planner.plan(pool) == []  # no BlockStored observed: parents unknown, nothing planned
    planner.observe(events)
    # (1) The queue's first hashed block is 4 (the chain's tail is evicted first), but its
    # cached ancestors come before it, root first, so the store can anchor the chain: 1, 2;
    # the rest of the chain (3, then 4) does not fit in this step and is planned next.
    assert planner.plan(pool) == [_item(1, h, 0), _item(2, h, 1)]
    # (2) 1 and 2 are in flight: the next plan goes on with 3, 4; then nothing is left.
    assert planner.plan(pool) == [_item(3, h, 2), _item(4, h, 3)]
    assert planner.plan(pool) == [] and planner.num_in_flight == 4
    # (3) The worker reports: 3 skipped (back-pressure), the others held. Only 3 comes back.
    planner.apply_outcomes(
        [OffloadOutcome(0, h[3], True), OffloadOutcome(0, h[2], False),
         OffloadOutcome(0, h[1], True), OffloadOutcome(0, h[0], True)]
    )
    assert planner.plan(pool) == [_item(3, h, 2)]
    planner.apply_outcomes([OffloadOutcome(0, h[2], True)])
    assert planner.plan(pool) == [] and planner.num_in_flight == 0
    assert all(planner.is_offloaded(0, x) for x in h)


def test_planner_names_the_parent_a_held_write_was_planned_with_after_its_block_went():
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="evict", blocks_per_step=8, scan_blocks=100)
    planner.observe(events)
    assert planner.plan(pool) == [_item(i + 1, h, i) for i in range(4)]
    pool.get_new_blocks(6)  # 5..9 and block 4: the chain's tail loses its hash while in flight
    planner.observe(pool.take_events())
    assert planner.parent_of(0, h[3]) is None
    planner.apply_outcomes([OffloadOutcome(0, x, True) for x in h])
    # The store tier's BlockStored names the parent the store recorded, not a chain root.
    assert [planner.written_parent_of(0, x) for x in h] == [b"", h[0], h[1], h[2]]
    planner.apply_outcomes([])  # only the latest outcomes' parents are kept
    assert planner.written_parent_of(0, h[3]) is None
    assert planner.written_parent_of(0, h[2]) == h[1]  # (cached: learnt from its event)


def test_planner_plans_what_is_left_of_the_step_s_bound():
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="evict", blocks_per_step=4, scan_blocks=100)
    planner.observe(events)
    # Two outputs between two schedules (vLLM's async scheduling): the second plan fills what
    # the first left of the step's bound, and no more.
    assert planner.plan(pool, num_planned=3) == [_item(1, h, 0)]
    assert planner.plan(pool, num_planned=4) == [] and planner.num_in_flight == 1
    assert planner.plan(pool, num_planned=1) == [_item(2, h, 1), _item(3, h, 2), _item(4, h, 3)]


def test_the_fence_withdraws_every_item_planned_before_a_prefix_cache_reset():
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="evict", blocks_per_step=8, scan_blocks=100)
    planner.observe(events)
    items = [tuple(item) for item in planner.plan(pool)]
    assert pool.reset_prefix_cache()  # new weights, say: every block's KV is stale
    # The next schedule takes every block and hashes blocks 1..4 again with the same chain,
    # before its forward recomputes them: the planned blocks hold the planned hashes again.
    taken = {block.block_id: block for block in pool.get_new_blocks(9)}
    again = Request("r", long_prompt(4 * BLOCK_SIZE + 3), SamplingParams(max_tokens=1),
                    block_hasher=get_request_block_hasher(BLOCK_SIZE))
    assert list(again.block_hashes) == h
    pool.cache_full_blocks(again, [taken[i] for i in range(1, 6)], again.block_hashes, 0, 4,
                           BLOCK_SIZE, 0)
    assert all(pool.get_block(i + 1).block_hash == make_block_hash_with_group_id(h[i], 0)
               for i in range(4))
    planner.observe(pool.take_events())  # AllBlocksCleared, then the chain stored again
    assert planner.drop_reused(items, pool) == []  # pre-reset KV is never written
    assert planner.num_in_flight == 0
    # Withdrawn, they are due: planned again after that forward, and the next fence (no reset
    # since) lets them through.
    replanned = [tuple(item) for item in planner.plan(pool)]
    assert replanned == items and planner.drop_reused(replanned, pool) == replanned


def test_planner_scans_at_most_scan_blocks_entries_and_forgets_evicted_parents():
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="evict", blocks_per_step=8, scan_blocks=5)
    planner.observe(events)
    assert planner.plan(pool) == []  # 5 entries looked at: 5, 6, 7, 8, 9, none hashed
    planner.scan_blocks = 7
    # ... then 4, which brings its whole chain, root first (8 per step: all of it fits).
    assert planner.plan(pool) == [_item(i + 1, h, i) for i in range(4)]
    planner.apply_outcomes([OffloadOutcome(0, h[3], False), OffloadOutcome(0, h[2], False),
                            OffloadOutcome(0, h[1], True), OffloadOutcome(0, h[0], True)])
    # The next schedule takes 6 blocks: 5..9 and block 4 (its hash dropped, BlockRemoved).
    pool.get_new_blocks(6)
    planner.observe(pool.take_events())
    planner.scan_blocks = 100
    # Block 4's write is forgotten with its hash; block 3's comes again (its parent is held).
    assert planner.plan(pool) == [_item(3, h, 2)]


def test_planner_remembering_few_writes_writes_each_cold_block_once_per_stay():
    # It remembers its last 2 writes; the pool's 4 cold cached blocks never change. Each is
    # written once, then scans find nothing. (Remembering only the last 2 writes, the head
    # blocks, forgotten after 2 later writes, were written again at every step, forever.)
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="evict", blocks_per_step=2, scan_blocks=100,
                             max_offloaded=2)
    planner.observe(events)
    written: list[OffloadItem] = []
    for _ in range(6):
        items = planner.plan(pool)
        written += items
        planner.apply_outcomes(OffloadOutcome(0, item.block_hash, True) for item in items)
    assert written == [_item(i + 1, h, i) for i in range(4)]
    # (2) All four are evicted, then the same chain is cached anew: the writes of h0 and h1
    # are older than the last 2 (the store may have dropped them), so they are written again;
    # h2 and h3 are among the last 2 writes and are not.
    taken = pool.get_new_blocks(9)
    pool.free_blocks(taken)
    request = Request("r", long_prompt(4 * BLOCK_SIZE + 3), SamplingParams(max_tokens=1),
                      block_hasher=get_request_block_hasher(BLOCK_SIZE))
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, 4, BLOCK_SIZE, 0)
    pool.free_blocks(reversed(blocks))
    planner.observe(pool.take_events())
    assert [item.block_hash for item in planner.plan(pool)] == h[:2]
    assert planner.plan(pool) == []


def test_planner_takes_the_first_store_that_names_its_incarnation_for_a_restart():
    # Writes answered by a store from before the field (incarnation 0) are forgotten when a
    # store that names one answers: a new store process, so a restarted one. A first answer
    # with nothing remembered before it (a node's first put) forgets nothing.
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="evict", blocks_per_step=4, scan_blocks=100)
    planner.observe(events)
    items = planner.plan(pool)
    assert items == [_item(i + 1, h, i) for i in range(4)]
    planner.apply_outcomes([OffloadOutcome(0, item.block_hash, True) for item in items], 0)
    assert planner.plan(pool) == [] and planner.store_incarnation == 0
    planner.apply_outcomes([], 7)
    assert planner.store_incarnation == 7 and planner.plan(pool) == items
    fresh = OffloadPlanner(policy="evict", blocks_per_step=4, scan_blocks=100)
    fresh.observe(events)
    assert fresh.plan(pool) == items
    fresh.apply_outcomes([OffloadOutcome(0, item.block_hash, True) for item in items], 7)
    assert fresh.plan(pool) == [] and all(fresh.is_offloaded(0, x) for x in h)


def test_planner_keeps_a_hash_plannable_while_another_block_still_caches_it():
    # Two requests with one prompt compute its 2 full blocks each (blocks 1, 2 and 4, 5 hold
    # the same two hashes), finish, and a 6-block allocation evicts the first copies (queue:
    # 7, 8, 9, 3, 2, 1, 6, 5, 4). The second copies are cold and still cached: the planner
    # must still know their parents (one BlockRemoved per evicted copy is not the hash gone).
    pool = BlockPool(10, enable_caching=True, enable_kv_cache_events=True)
    prompt = long_prompt(2 * BLOCK_SIZE + 3)
    hasher = get_request_block_hasher(BLOCK_SIZE)
    first_copies = pool.get_new_blocks(3)
    second_copies = pool.get_new_blocks(3)
    for name, blocks in (("r", first_copies), ("r2", second_copies)):
        request = Request(name, prompt, SamplingParams(max_tokens=1), block_hasher=hasher)
        pool.cache_full_blocks(request, blocks, request.block_hashes, 0, 2, BLOCK_SIZE, 0)
    h = list(request.block_hashes)
    pool.free_blocks(reversed(first_copies))
    pool.free_blocks(reversed(second_copies))
    pool.get_new_blocks(7)
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, BlockRemoved]
    planner = OffloadPlanner(policy="evict", blocks_per_step=8, scan_blocks=100)
    planner.observe(events)
    assert planner.parent_of(0, h[1]) == h[0] and planner.parent_of(0, h[0]) == b""
    assert planner.plan(pool) == [_item(4, h, 0), _item(5, h, 1)]
    # The last copy's removal forgets the hash.
    planner.apply_outcomes([OffloadOutcome(0, x, False) for x in h])
    pool.get_new_blocks(2)
    planner.observe(pool.take_events())
    assert planner.parent_of(0, h[0]) is None and planner.plan(pool) == []


def test_planner_write_through_plans_new_cached_blocks_first_even_while_held():
    # Blocks 1..4 cached and still held by the request (not in the free queue).
    pool, h, events = _cold_pool(free=False)
    planner = OffloadPlanner(policy="write_through", blocks_per_step=3, scan_blocks=100)
    planner.observe(events)
    assert planner.plan(pool) == [_item(1, h, 0), _item(2, h, 1), _item(3, h, 2)]
    pool.evict_blocks([4])  # lost its hash before the next plan: not planned
    assert planner.plan(pool) == []
    # Write-through candidates come first, then the queue; a block is planned once per plan.
    pool, h, events = _cold_pool()
    planner = OffloadPlanner(policy="write_through", blocks_per_step=8, scan_blocks=100)
    planner.observe(events)
    assert planner.plan(pool) == [_item(i + 1, h, i) for i in range(4)]
    with pytest.raises(ValueError, match="policy must be one of"):
        OffloadPlanner(policy="lru", blocks_per_step=1, scan_blocks=1)
    with pytest.raises(ValueError, match="scan_blocks must be >= 1, got 0"):
        OffloadPlanner(policy="evict", blocks_per_step=1, scan_blocks=0)


def _pool_with_a_hot_first_block() -> tuple[BlockPool, list[bytes], list]:
    """A 10-block pool with events on: request R cached a 3-block chain in blocks 1, 2, 3 (and
    a partial block 4) and finished, freed in reverse, while request S, whose prompt starts
    with the same block (a shared system prompt), still runs and holds block 1. Queue:
    ``[4, 5, 6, 7, 8, 9, 3, 2]`` (unhashed 4 at the front); block 1 is hot (ref_cnt 1), never
    cold. Returns the pool, R's chain hashes and the events."""
    pool = BlockPool(10, enable_caching=True, enable_kv_cache_events=True)
    request = Request(
        "r",
        long_prompt(3 * BLOCK_SIZE + 3),
        SamplingParams(max_tokens=1),
        block_hasher=get_request_block_hasher(BLOCK_SIZE),
    )
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, 3, BLOCK_SIZE, 0)
    pool.touch(blocks[:1])  # S's prefix hit on the shared first block
    pool.free_blocks(reversed(blocks))  # R finishes
    return pool, list(request.block_hashes), pool.take_events()


def _store_cache(num_blocks: int, **kw) -> StoreCache:
    """A store cache of ``num_blocks`` one-layer blocks (no bytes worth checking)."""
    return StoreCache([[torch.zeros(num_blocks + 1, 2, BLOCK_SIZE, 1, 1)]], **kw)


def _put(cache: StoreCache, hashes: list[bytes], parents: list[bytes]):
    return cache.put(0, hashes, parents, torch.zeros(1, len(hashes), 2, BLOCK_SIZE, 1, 1))


def test_planner_plans_a_hot_first_block_before_its_cold_descendants_so_the_store_publishes():
    pool, h, events = _pool_with_a_hot_first_block()
    assert pool.get_block(1).ref_cnt == 1  # the shared first block is in use: never cold
    planner = OffloadPlanner(policy="evict", blocks_per_step=8, scan_blocks=100)
    planner.observe(events)
    # The first cold block from the queue's head is 3 (R's tail); its ancestors that the pool
    # caches come first, root first, the hot block 1 included. (A planner of cold blocks only
    # planned 3, 2 and never block 1, so the store never anchored R's chain.)
    items = planner.plan(pool)
    assert items == [_item(1, h, 0), _item(2, h, 1), _item(3, h, 2)]
    # The fence after the next schedule keeps the in-use block: it still holds its hash.
    assert planner.drop_reused([tuple(item) for item in items], pool) == [
        tuple(item) for item in items
    ]
    # The store anchors at the root and publishes the chain, parents first.
    put = _put(_store_cache(4, read_guard_s=0.0), [it.block_hash for it in items],
               [it.parent_hash for it in items])
    assert [(e.block_hashes, e.parent_block_hash) for e in put.events] == [
        ([h[0]], None), ([h[1]], h[0]), ([h[2]], h[1])
    ]
    # Why block 1 matters: the cold blocks alone are held but published by no store.
    cold_only = _put(_store_cache(4, read_guard_s=0.0), [h[2], h[1]], [h[1], h[0]])
    assert (cold_only.num_stored, cold_only.events) == (2, ())


@pytest.mark.parametrize("policy", ["evict", "write_through"])
def test_planner_continues_a_chain_next_step_and_retries_a_hot_ancestor_not_held(policy):
    pool, h, events = _pool_with_a_hot_first_block()
    planner = OffloadPlanner(policy=policy, blocks_per_step=2, scan_blocks=100)
    planner.observe(events)
    # Two per step: the chain root first (evict: block 3's ancestors; write_through: the
    # blocks in the order they were cached, the same order), the rest in the next step.
    assert planner.plan(pool) == [_item(1, h, 0), _item(2, h, 1)]
    assert planner.plan(pool) == [_item(3, h, 2)]
    # The hot block 1 is skipped (back-pressure), its descendants held. No cold block leads to
    # it any more (its child is remembered as offloaded) and it is never cold itself, so it is
    # planned again from the planner's due list, or the store never anchors the chain.
    planner.apply_outcomes([OffloadOutcome(0, h[0], False), OffloadOutcome(0, h[1], True),
                            OffloadOutcome(0, h[2], True)])
    assert planner.plan(pool) == [_item(1, h, 0)]
    planner.apply_outcomes([OffloadOutcome(0, h[0], True)])
    assert planner.plan(pool) == [] and planner.num_in_flight == 0


def test_store_lru_keeps_a_chains_head_after_its_descendants_on_writes_and_reads():
    r, a, b, x, y, z = (bytes([i]) * 32 for i in b"rabxyz")
    # (1) Writes. The store holds root r; unrelated roots x, y come; then r's children a, b
    # (written later, as a node writes a shared head's descendants). The put touches r after
    # them, so the coldest block is x, not r (a plain LRU would drop r, unlisting a and b).
    cache = _store_cache(5, read_guard_s=0.0)
    for block_hash in (r, x, y):
        _put(cache, [block_hash], [ROOT_PARENT])
    _put(cache, [a, b], [r, a])
    assert cache.lru_hashes(0) == [x, y, b, a, r]  # each block after its descendants
    put = _put(cache, [z], [ROOT_PARENT])
    assert isinstance(put.events[0], BlockRemoved) and put.events[0].block_hashes == [x]
    assert cache.lru_hashes(0) == [y, b, a, r, z]

    # (2) Reads. The chain r, a, b is written first, then x, y; a puller that holds r reads
    # a and b: the read touches r after them (not stamped for the read guard: not read).
    now = [0.0]
    cache = _store_cache(5, read_guard_s=1.0, clock=lambda: now[0])
    _put(cache, [r, a, b], [ROOT_PARENT, r, a])
    assert cache.lru_hashes(0) == [b, a, r]  # one put: the same order, head last
    for block_hash in (x, y):
        _put(cache, [block_hash], [ROOT_PARENT])
    now[0] = 5.0
    ids = [cache.block_id_of(0, block_hash) for block_hash in (a, b)]
    assert cache.validate(0, ids, [a, b]) == []
    assert cache.lru_hashes(0) == [x, y, b, a, r]
    served_at = cache.groups[0].served_at
    assert [served_at[cache.block_id_of(0, k)] for k in (r, a, b)] == [float("-inf"), 5.0, 5.0]
    # The next write drops x (a plain LRU would drop r); one more drops y; the one after
    # would drop b, read 0 s ago: the read guard refuses it, as before.
    put = _put(cache, [z], [ROOT_PARENT])
    assert isinstance(put.events[0], BlockRemoved) and put.events[0].block_hashes == [x]
    assert isinstance(put.events[1], BlockStored) and put.events[1].block_hashes == [z]
    _put(cache, [bytes(32)], [ROOT_PARENT])
    assert _put(cache, [bytes([1]) * 32], [ROOT_PARENT]).refused == (bytes([1]) * 32,)
    assert cache.lru_hashes(0) == [b, a, r, z, bytes(32)]


def test_offload_records_round_trip_msgpack_and_bad_fields_are_named():
    items = [OffloadItem(4, 0, b"h" * 32, b"p" * 32), OffloadItem(1, 1, b"g" * 32, b"")]
    outcomes = [OffloadOutcome(0, b"h" * 32, True), OffloadOutcome(1, b"g" * 32, False),
                OffloadOutcome(0, b"m" * 32, False, True)]
    assert items_from_wire(msgpack.unpackb(msgpack.packb(items))) == items
    assert outcomes_from_wire(msgpack.unpackb(msgpack.packb(outcomes))) == outcomes
    assert outcomes_from_wire([[0, b"h", False]]) == [OffloadOutcome(0, b"h", False, False)]
    # The halves' own report (what the worker half sends each step, a separate process under
    # vLLM) carries the four fields through its schema.
    meta = KVBridgeWorkerMeta(offload_outcomes=[tuple(o) for o in outcomes])
    decoded = decode_worker_meta(encode_worker_meta(meta)).offload_outcomes
    assert [OffloadOutcome(*o) for o in decoded] == outcomes
    with pytest.raises(StoreWireError, match=r"offload outcome \[0\] must be .*not both"):
        outcomes_from_wire([[0, b"h", True, True]])
    with pytest.raises(StoreWireError, match=r"offload item \[1\].block_hash must be bytes"):
        items_from_wire([list(items[0]), [1, 0, "not bytes", b""]])
    with pytest.raises(StoreWireError, match=r"offload item \[0\].group_id must be an int"):
        items_from_wire([[1, -1, b"h", b""]])
    with pytest.raises(StoreWireError, match=r"offload outcome \[0\] must be"):
        outcomes_from_wire([[0, b"h", 1]])


def _node_caches(store: StoreNode, num_blocks: int) -> list[list[torch.Tensor]]:
    """KV tensors laid out like the store's (``num_blocks`` rows), each block's bytes distinct."""
    model = tiny_model(hybrid=False).config
    nbytes = num_blocks * store.cache.groups[0].block_nbytes
    by_group, _ = store_kv_caches(model, block_size=BLOCK_SIZE, capacity_bytes=nbytes)
    for group in by_group:
        for layer, cache in enumerate(group):
            cache.copy_(torch.randn_like(cache) + layer)
    return [[c[: num_blocks] for c in group] for group in by_group]


def _assert_store_holds(store: StoreNode, caches: list[torch.Tensor], block_id: int, h: bytes):
    """The store holds ``h`` with exactly the bytes of the node's block ``block_id``."""
    store_block_id = store.cache.block_id_of(0, h)
    assert store_block_id is not None, "the store does not hold the block"
    for node_cache, store_cache in zip(caches, store.cache.groups[0].kv_caches, strict=True):
        assert torch.equal(store_cache[store_block_id], node_cache[block_id])


def test_sender_snapshots_at_submit_and_reports_one_outcome_per_item(network, redis_url, cleanup):
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=16)
    stores.append(store)
    caches = _node_caches(store, 10)
    block_nbytes = store.cache.groups[0].block_nbytes
    gate, loop_thread = threading.Event(), LoopThread(name="test-offload-sender")
    loop_thread.call_soon(gate.wait)  # the sender's loop is stuck until the gate opens
    node_stats = KVTransferStats()
    sender = OffloadSender(
        store_address=store.write_address,
        max_inflight_bytes=block_nbytes,  # one block waiting is the most
        stats=node_stats,
        loop_thread=loop_thread,
    )
    items = [OffloadItem(2, 0, b"a" * 32, b""), OffloadItem(5, 0, b"b" * 32, b"a" * 32)]
    with pytest.raises(RuntimeError, match="before bind"):
        sender.submit(items)
    sender.bind([caches[0]], store.metadata)
    with pytest.raises(ValueError, match=r"offload item \[0\]: block_id 10 not in \[1, 10\)"):
        sender.submit([OffloadItem(10, 0, b"c" * 32, b"")])
    with pytest.raises(ValueError, match=r"offload item \[0\]: group_id 1 not in \[0, 1\)"):
        sender.submit([OffloadItem(1, 1, b"c" * 32, b"")])
    original = [c.clone() for c in caches[0]]

    # (1) Two blocks are snapshotted now; the forward then overwrites block 2 (as a reused block
    # would be): the store must still get the bytes of the moment of submit.
    assert sender.submit(items) == 2
    for cache in caches[0]:
        cache[2].zero_()
    # (2) 2 blocks wait (>= max_inflight_bytes): the next submit is skipped, reported at once.
    assert sender.submit([OffloadItem(7, 0, b"c" * 32, b"b" * 32)]) == 0
    assert sender.take_outcomes() == [OffloadOutcome(0, b"c" * 32, False)]
    assert node_stats.num_offload_skipped_blocks == 1
    gate.set()
    sender.wait_idle()
    assert sender.take_outcomes() == [
        OffloadOutcome(0, b"a" * 32, True), OffloadOutcome(0, b"b" * 32, True)
    ]
    assert sender.inflight_bytes == 0
    _assert_store_holds(store, original, 2, b"a" * 32)
    _assert_store_holds(store, original, 5, b"b" * 32)
    # (3) With room again the skipped block goes.
    assert sender.submit([OffloadItem(7, 0, b"c" * 32, b"b" * 32)]) == 1
    sender.wait_idle()
    assert sender.take_outcomes() == [OffloadOutcome(0, b"c" * 32, True)]
    _assert_store_holds(store, original, 7, b"c" * 32)
    s = node_stats.snapshot()
    assert (s["num_offloaded_blocks"], s["bytes_offloaded"]) == (3, 3 * block_nbytes)
    assert (s["num_offload_failures"], s["num_offload_refused_blocks"]) == (0, 0)
    assert store_depth(store, [b"a" * 32, b"b" * 32, b"c" * 32]) == 3  # the chain is indexed
    sender.close()
    with pytest.raises(RuntimeError, match="after close"):
        sender.submit(items)


def test_sender_reports_every_item_not_held_when_the_store_is_unreachable():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    caches = [torch.zeros(4, 2, BLOCK_SIZE, 2, 8)]
    node_stats = KVTransferStats()
    sender = OffloadSender(
        store_address=("127.0.0.1", port), max_inflight_bytes=1 << 20, stats=node_stats
    )
    sender.bind([caches], NodeMetadata.from_kv_caches(
        engine_id="n", kv_caches_by_group=[caches], model_name="m", hash_fn_name="sha256"))
    items = [OffloadItem(1, 0, b"a" * 32, b""), OffloadItem(3, 0, b"b" * 32, b"")]
    assert sender.submit(items) == 2
    sender.wait_idle()
    assert sender.take_outcomes() == [
        OffloadOutcome(0, b"a" * 32, False), OffloadOutcome(0, b"b" * 32, False)
    ]
    assert (node_stats.num_offload_failures, node_stats.num_offloaded_blocks) == (1, 0)
    assert sender.inflight_bytes == 0
    sender.close()


def test_planner_and_sender_across_msgpack_offload_a_whole_chain(network, redis_url, cleanup):
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=16)
    stores.append(store)
    pool, h, events = _cold_pool()
    caches = _node_caches(store, pool.num_gpu_blocks)
    planner = OffloadPlanner(policy="evict", blocks_per_step=3, scan_blocks=100)
    sender = OffloadSender(
        store_address=store.write_address, max_inflight_bytes=1 << 20, stats=KVTransferStats()
    )
    sender.bind([caches[0]], store.metadata)  # (0) register_kv_caches
    planner.observe(events)  # (0) update_connector_output of the step that computed the chain
    outcomes_wire = msgpack.packb([])
    for step in range(3):
        # (a) scheduler half, build_connector_meta: the worker's last outcomes, then the plan.
        planner.apply_outcomes(outcomes_from_wire(msgpack.unpackb(outcomes_wire)))
        metadata_wire = msgpack.packb(planner.plan(pool))
        # (b) worker half, start_load_kv (the forward follows); then its step output.
        sender.submit(items_from_wire(msgpack.unpackb(metadata_wire)))
        sender.wait_idle()
        outcomes_wire = msgpack.packb(sender.take_outcomes())
        planned = len(msgpack.unpackb(metadata_wire))
        # Steps: blocks 1, 2, 3 (block 4 at the queue's head brings its ancestors, root
        # first), then block 4, then nothing.
        assert planned == [3, 1, 0][step]
    planner.apply_outcomes(outcomes_from_wire(msgpack.unpackb(outcomes_wire)))
    assert planner.num_in_flight == 0 and all(planner.is_offloaded(0, x) for x in h)
    for position, block_id in enumerate([1, 2, 3, 4]):
        _assert_store_holds(store, caches[0], block_id, h[position])
    # Parents were stored before their children; the index lists the whole chain.
    assert store_depth(store, h) == 4
    sender.close()


# ---------------------------------------------------------------------- the store's evictions
# A node remembers what it wrote as offloaded and does not write it again. When the store drops
# such a block, a put of anything below it names it (missing_ancestors), so the node writes it
# again; otherwise every chain the node writes below it stays out of the index.
def test_a_put_names_the_first_missing_ancestor_of_the_blocks_it_cannot_publish():
    r, a, b, c, x, y, w, z = (bytes([i]) * 32 for i in b"rabcxywz")
    cache = _store_cache(4, read_guard_s=0.0)
    assert _put(cache, [r], [ROOT_PARENT]).missing_ancestors == ()
    for root in (x, y, w):
        _put(cache, [root], [ROOT_PARENT])
    dropped = _put(cache, [z], [ROOT_PARENT])  # r, the coldest, goes
    assert dropped.events[0].block_hashes == [r] and cache.block_id_of(0, r) is None
    # a's parent r is gone: a is held but not published, and the put names r.
    put = _put(cache, [a], [r])
    assert (put.num_stored, put.missing_ancestors) == (1, (r,))
    assert [type(e) for e in put.events] == [BlockRemoved]  # x dropped for room; a unlisted
    # b and c below a: each walk goes up through the held a to r; one name for both.
    assert _put(cache, [b, c], [a, a]).missing_ancestors == (r,)
    assert cache.lru_hashes(0) == [z, b, c, a] or cache.lru_hashes(0) == [z, c, b, a]
    # r comes back (z makes room): the chain is published, parents first; nothing is missing.
    put = _put(cache, [r], [ROOT_PARENT])
    stored = [e.block_hashes[0] for e in put.events if isinstance(e, BlockStored)]
    assert stored[:2] == [r, a] and set(stored) == {r, a, b, c} and put.missing_ancestors == ()
    assert _put(cache, [c], [a]).missing_ancestors == ()  # present, anchored


def test_a_put_reply_carries_missing_ancestors_and_a_bad_list_is_named():
    reply = PutReply(2, 0, 0, (), ((0, b"r" * 32), (1, b"s" * 32)), store_incarnation=7)
    raw = encode_reply(reply)
    decoded = decode_reply(decode_header(raw[4:]))
    assert decoded == reply
    older = {"v": 1, "type": "put_ok", "num_stored": 1, "num_present": 0, "num_refused": 0,
             "refused": []}  # a store from before the fields
    assert decode_reply(older).missing_ancestors == ()
    assert decode_reply(older).store_incarnation == 0  # unknown: never taken for a restart
    for bad in ([[0, b""]], [[MAX_GROUPS, b"r"]], [[0, "r"]], [0], "r"):
        with pytest.raises(StoreWireError, match="'missing_ancestors'"):
            decode_reply({**older, "missing_ancestors": bad})
    for bad in (-1, 1 << 63, "7", None):
        with pytest.raises(StoreWireError, match="'incarnation'"):
            decode_reply({**older, "incarnation": bad})


def test_planner_writes_again_an_offloaded_block_reported_missing():
    pool, h, events = _pool_with_a_hot_first_block()
    planner = OffloadPlanner(policy="evict", blocks_per_step=1, scan_blocks=100)
    planner.observe(events)
    assert [planner.plan(pool) for _ in range(3)] == [[_item(i + 1, h, i)] for i in range(3)]
    planner.apply_outcomes([OffloadOutcome(0, x, True) for x in h])
    assert planner.plan(pool) == [] and planner.is_offloaded(0, h[0])
    # A plain not-held outcome for a block the planner knows the store holds changes nothing.
    planner.apply_outcomes([OffloadOutcome(0, h[0], False)])
    assert planner.is_offloaded(0, h[0]) and planner.plan(pool) == []
    # A later put's reply names the hot first block: the store dropped it.
    planner.apply_outcomes([OffloadOutcome(0, h[0], False, True)])
    assert not planner.is_offloaded(0, h[0])
    # Its write is in flight when more names arrive (puts queued before it): a name never takes
    # a block out of flight, so it is not planned twice; its own outcome settles it.
    assert planner.plan(pool) == [_item(1, h, 0)]
    planner.apply_outcomes([OffloadOutcome(0, h[0], False, True)] * 2)
    assert planner.num_in_flight == 1 and planner.plan(pool) == []
    planner.apply_outcomes([OffloadOutcome(0, h[0], True)])
    assert planner.is_offloaded(0, h[0]) and planner.num_in_flight == 0
    # A name goes first in the due list, before blocks due already (it keeps chains unlisted):
    # h[2] named, then h[0]: h[0] is planned first, h[2] after (its parent h[1] still held).
    planner.apply_outcomes([OffloadOutcome(0, h[2], False, True)])
    planner.apply_outcomes([OffloadOutcome(0, h[0], False, True)])
    assert planner.plan(pool) == [_item(1, h, 0)]
    assert planner.plan_due(pool) == [_item(3, h, 2)] and planner.plan_due(pool) == []


def test_offload_remember_blocks_sizes_the_planners_memory(network, redis_url, cleanup):
    engines, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=8)
    stores.append(store)
    engines.append(make_node("node-a", network, redis_url, store, offload_remember_blocks=3))
    planner = engines[0].scheduler.connector.scheduler_half.offload_planner
    assert (planner.max_offloaded, planner.max_remembered) == (3, 1 << 20)
    # Four writes reported held: the oldest is forgotten, so it may be written again.
    keys = [bytes([i]) * 32 for i in range(4)]
    planner.apply_outcomes(OffloadOutcome(0, k, True) for k in keys)
    assert [planner.is_offloaded(0, k) for k in keys] == [False, True, True, True]


def test_a_full_due_list_keeps_the_names_the_store_sent():
    # Room for 2 due keys. Two blocks reported not held fill it; a name goes first and the
    # last entry makes room; a later not-held block finds the list full and is dropped (a
    # later walk or scan finds it again): the name is never pushed out.
    pool, h, events = _pool_with_a_hot_first_block()
    planner = OffloadPlanner(policy="evict", blocks_per_step=8, scan_blocks=100,
                             max_remembered=2)
    planner.observe(events)
    assert planner.plan(pool) == [_item(1, h, 0), _item(2, h, 1), _item(3, h, 2)]
    planner.apply_outcomes([OffloadOutcome(0, h[0], True)])
    planner.apply_outcomes([OffloadOutcome(0, h[1], False), OffloadOutcome(0, h[2], False)])
    planner.apply_outcomes([OffloadOutcome(0, h[0], False, True)])  # due: h0, h1 (h2 dropped)
    planner.apply_outcomes([OffloadOutcome(0, b"x" * 32, False)])  # due: h0, h1 (x dropped)
    assert planner.plan_due(pool) == [_item(1, h, 0), _item(2, h, 1)]


def test_a_root_the_store_dropped_is_written_again_and_the_chain_listed(
    network, redis_url, cleanup
):
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=3)
    stores.append(store)
    pool, h, events = _pool_with_a_hot_first_block()  # h[0] hot in block 1; h[1], h[2] cold
    caches = _node_caches(store, pool.num_gpu_blocks)
    stats = KVTransferStats()
    planner = OffloadPlanner(policy="evict", blocks_per_step=1, scan_blocks=100)
    sender = OffloadSender(
        store_address=store.write_address, max_inflight_bytes=1 << 20, stats=stats
    )
    sender.bind([caches[0]], store.metadata)
    planner.observe(events)

    def step(extra: list[OffloadItem] = ()) -> list[OffloadItem]:
        items = planner.plan(pool)
        sender.submit([*items, *extra])
        sender.wait_idle()
        planner.apply_outcomes(sender.take_outcomes())
        return items

    assert step() == [_item(1, h, 0)]  # the root first; h[1], h[2] are due
    assert planner.is_offloaded(0, h[0])
    # Other writers' roots fill the store (3 blocks) and push the root out.
    fillers = [OffloadItem(5 + i, 0, bytes([0xF0 + i]) * 32, b"") for i in range(3)]
    sender.submit(fillers)
    sender.wait_idle()
    sender.take_outcomes()
    assert store.cache.block_id_of(0, h[0]) is None
    # The next write (h[1]) names the root missing; the planner writes it again, first.
    assert step() == [_item(2, h, 1)]
    assert stats.num_offload_missing_ancestors == 1 and not planner.is_offloaded(0, h[0])
    written = [step() for _ in range(3)]
    assert written == [[_item(1, h, 0)], [_item(3, h, 2)], []]
    assert stats.num_offload_missing_ancestors == 1
    for position, block_id in enumerate([1, 2, 3]):
        _assert_store_holds(store, caches[0], block_id, h[position])
    assert store_depth(store, h) == 3  # listed: without the report, 0 (never anchored)
    sender.close()


def test_a_store_restarted_empty_gets_the_cold_blocks_written_again(network, redis_url, cleanup):
    # The node wrote its cold chain, and its planner remembers it as held. The store restarts
    # empty on the same write port (a new incarnation). The next put's reply names the new
    # incarnation, so the planner forgets what it remembered and writes the chain again: the
    # store lists it. (Without the incarnation, the node never wrote the chain again.)
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=8)
    stores.append(store)
    pool, h, events = _cold_pool()  # h in blocks 1..4, cold; blocks 5..9 free
    caches = _node_caches(store, pool.num_gpu_blocks)
    planner = OffloadPlanner(policy="evict", blocks_per_step=4, scan_blocks=100)
    sender = OffloadSender(
        store_address=store.write_address, max_inflight_bytes=1 << 20, stats=KVTransferStats()
    )
    sender.bind([caches[0]], store.metadata)
    planner.observe(events)

    def step() -> list[OffloadItem]:
        items = planner.plan(pool)
        sender.submit(items)
        sender.wait_idle()
        planner.apply_outcomes(sender.take_outcomes(), sender.store_incarnation)
        return items

    assert step() == [_item(i + 1, h, i) for i in range(4)] and step() == []
    assert store_depth(store, h) == 4 and sender.store_incarnation == store.incarnation
    port = store.write_address[1]
    close_store_node(store)
    restarted = make_store(network, redis_url, capacity_blocks=8, write_port=port)
    stores.append(restarted)
    assert step() == [] and store_depth(restarted, h) == 0  # nothing new to write yet
    # (2) A new request's 2-block chain is cached in blocks 5, 6 and goes cold: its put is the
    # first the restarted store answers.
    other = Request("o", long_prompt(2 * BLOCK_SIZE + 1, salt="Another document. "),
                    SamplingParams(max_tokens=1), block_hasher=get_request_block_hasher(BLOCK_SIZE))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(other, blocks, other.block_hashes, 0, 2, BLOCK_SIZE, 0)
    pool.free_blocks(reversed(blocks))
    planner.observe(pool.take_events())
    assert [item.block_hash for item in step()] == list(other.block_hashes)
    # That put may meet the connection the old store left (failed: due, written again next).
    # (3) Once the restarted store has answered, the old chain is written again.
    written = [item.block_hash for _ in range(4) for item in step()]
    assert sender.store_incarnation == restarted.incarnation
    assert written.count(h[0]) == 1 and store_depth(restarted, h) == 4
    sender.close()


def test_a_store_restarted_while_nothing_goes_cold_is_found_by_a_probe(
    network, redis_url, cleanup
):
    # As above, but no new block goes cold after the restart, so no put would carry the new
    # incarnation. After ``probe_interval_s`` without a put the sender sends an empty put; its
    # reply names the restarted store, and the remembered chain is written again.
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=8)
    stores.append(store)
    pool, h, events = _cold_pool()  # h in blocks 1..4, cold
    caches = _node_caches(store, pool.num_gpu_blocks)
    planner = OffloadPlanner(policy="evict", blocks_per_step=4, scan_blocks=100)
    sender = OffloadSender(
        store_address=store.write_address, max_inflight_bytes=1 << 20, stats=KVTransferStats(),
        probe_interval_s=30.0,
    )
    sender.bind([caches[0]], store.metadata)
    planner.observe(events)

    def step(now_s: float) -> list[OffloadItem]:
        items = planner.plan(pool)
        sender.submit(items)
        sender.wait_idle()
        sender.probe_if_due(now_s)
        sender.wait_idle()
        planner.apply_outcomes(sender.take_outcomes(), sender.store_incarnation)
        return items

    t0 = time.monotonic()
    assert len(step(t0)) == 4 and step(t0 + 1.0) == []
    port = store.write_address[1]
    close_store_node(store)
    restarted = make_store(network, redis_url, capacity_blocks=8, write_port=port)
    stores.append(restarted)
    assert step(t0 + 2.0) == [] and sender.store_incarnation == store.incarnation  # too soon
    # 30 s after the last put: a probe. It may meet the connection the old store left (failed,
    # counted nowhere); the next one, due 30 s later, reaches the restarted store.
    for k in (1, 2):
        step(t0 + 31.0 * k)
        if sender.store_incarnation == restarted.incarnation:
            break
    assert sender.store_incarnation == restarted.incarnation
    assert sender.stats.take_report()[0].get("num_offload_failures", 0) == 0
    written = [item.block_hash for _ in range(3) for item in step(t0 + 100.0)]
    assert written == h and store_depth(restarted, h) == 4
    sender.close()


def test_a_probe_waits_for_the_interval_and_for_puts_in_flight(network, redis_url, cleanup):
    _, stores = cleanup
    store = make_store(network, redis_url, capacity_blocks=8)
    stores.append(store)
    pool, _, _ = _cold_pool()
    sender = OffloadSender(
        store_address=store.write_address, max_inflight_bytes=1 << 20, stats=KVTransferStats(),
        probe_interval_s=5.0,
    )
    assert not sender.probe_if_due(0.0)  # not bound yet
    sender.bind([_node_caches(store, pool.num_gpu_blocks)[0]], store.metadata)
    sender.wait_idle()  # the hello at bind already learnt the store's incarnation
    assert sender.store_incarnation == store.incarnation and sender.take_outcomes() == []
    assert not sender.probe_if_due(100.0)  # the first call starts the interval
    assert not sender.probe_if_due(104.9)
    assert sender.probe_if_due(105.0) and sender.store_incarnation in (0, store.incarnation)
    sender.wait_idle()
    assert sender.store_incarnation == store.incarnation and sender.take_outcomes() == []
    assert not sender.probe_if_due(109.0) and sender.probe_if_due(110.0)
    sender.wait_idle()
    never = OffloadSender(store_address=store.write_address, max_inflight_bytes=1,
                          stats=KVTransferStats())  # probe_interval_s 0: never
    never.bind([_node_caches(store, pool.num_gpu_blocks)[0]], store.metadata)
    assert not never.probe_if_due(0.0) and not never.probe_if_due(1e9)
    sender.close()
    never.close()
    with pytest.raises(ValueError, match="probe_interval_s"):
        OffloadSender(store_address=store.write_address, max_inflight_bytes=1,
                      stats=KVTransferStats(), probe_interval_s=-1.0)


def _put_chain(store: StoreNode, hashes: list[bytes]) -> dict:
    """Write ``hashes`` (one chain from block 0) to ``store``'s write server; its reply."""
    nbytes = store.cache.groups[0].block_nbytes * len(hashes)
    return _raw_put(store.write_address, _header_frame({
        "v": 1, "type": "put", "compat_hash": store.metadata.compat_hash,
        "payload_nbytes": nbytes,
        "groups": [{"group_id": 0, "block_hashes": hashes, "parent_hashes": [b"", *hashes[:-1]],
                    "nbytes": nbytes}],
    }, b"\0" * nbytes))


def test_a_store_lists_its_blocks_again_after_the_index_lost_them(network, redis_url, cleanup):
    # Redis restarts empty (FLUSHALL stands in). The store's heartbeat is fenced and it
    # registers again, with no entries; a writer that offers the blocks again gets "present",
    # which makes no event. Before the fix the blocks stayed out of the index until each was
    # dropped and written anew; now the store resyncs its held set (a tick offers the index
    # client a step every third of the TTL, so it happens with no put at all).
    _, stores = cleanup
    store = _store_builders.make_store(network, index_url=redis_url, capacity_blocks=16,
                                       engine_id="store-0", index_ttl_s=0.6)
    stores.append(store)
    hashes = [hashlib.sha256(f"listed/{i}".encode()).digest() for i in range(4)]
    assert _put_chain(store, hashes)["num_stored"] == 4 and store_depth(store, hashes) == 4
    redis.Redis.from_url(redis_url).flushall()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
        store.index_client.num_reregistrations and store.index_client.num_resyncs
        and store_depth(store, hashes) == 4
    ):
        time.sleep(0.05)
    assert store.index_client.num_reregistrations >= 1 and store.index_client.num_resyncs >= 1
    assert store_depth(store, hashes) == 4 and store.cache.num_held() == 4


def test_a_store_whose_start_fails_leaves_nothing_running(network, redis_url):
    # The write port is taken: start fails after the transport and the index client started.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    store = StoreNode(tiny_model(hybrid=False).config, block_size=BLOCK_SIZE,
                      capacity_bytes=1 << 20, engine_id="store-fails", transport="loopback",
                      loopback_network=network, index_url=redis_url,
                      write_port=taken.getsockname()[1])
    try:
        before = Running.now()
        with pytest.raises(OSError):
            start_store_node(store)
        assert store.transport is None and store.index_client is None
        assert not [t for t in threading.enumerate() if t.name == "kvbridge-index-store-fails"]
        assert started_since(before) == {"threads": [], "listening": [], "loop_tasks": []}
    finally:
        taken.close()


def test_a_stores_resync_lists_its_anchored_blocks_parents_first_with_their_parents():
    # The store's resync takes parents from its cache, not from events the index client has
    # seen: a put's events may still wait on the publisher thread when the set is read.
    cache = _store_cache(8, read_guard_s=0.0)
    a = [hashlib.sha256(f"a/{i}".encode()).digest() for i in range(3)]
    b = [hashlib.sha256(f"b/{i}".encode()).digest() for i in range(2)]
    _put(cache, a, [ROOT_PARENT, a[0], a[1]])
    _put(cache, b[1:], [b[0]])  # held, not anchored: its parent was never written
    events = cache.resync_events()
    assert isinstance(events[0], AllBlocksCleared)
    stored = [(e.block_hashes[0], e.parent_block_hash) for e in events[1:]]
    assert stored == [(a[0], None), (a[1], a[0]), (a[2], a[1])]
