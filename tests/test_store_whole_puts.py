"""A store commits whole puts only: a writer that goes away part-way through a put's payload (an
engine killed mid-offload, a dropped connection) leaves no block of it stored, listed or
servable, and the store goes on taking whole puts (issue 31 part 4: "never half-written")."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import torch
from _store_builders import make_store
from kvbridge.connector.loop_thread import get_loop_thread
from kvbridge.connector.store import PutGroup, PutRequest, StoreWriter, close_store_node
from kvbridge.connector.store.wire import encode_put_header
from kvbridge.transport import LoopbackNetwork


def _put(store, num_blocks: int, first: int) -> tuple[PutRequest, bytes]:
    block_nbytes = store.cache.groups[0].block_nbytes
    hashes = tuple(bytes([first + i]) * 32 for i in range(num_blocks))
    parents = (b"", *hashes[:-1])
    put = PutRequest(compat_hash=store.metadata.compat_hash, groups=(PutGroup(
        group_id=0, block_hashes=hashes, parent_hashes=parents,
        nbytes=num_blocks * block_nbytes),))
    payload = torch.arange(put.payload_nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    return put, payload.numpy().tobytes()


@pytest.fixture
def store():
    node = make_store(LoopbackNetwork(), index_url="memory", capacity_blocks=8)
    yield node
    close_store_node(node)


def test_a_put_cut_off_mid_payload_stores_nothing_and_the_next_whole_put_lands(store, caplog):
    caplog.set_level(logging.INFO, logger="kvbridge.connector.store.server")
    put, payload = _put(store, 3, first=1)
    with socket.create_connection(store.write_address, timeout=5) as sock:
        sock.sendall(encode_put_header(put) + payload[: len(payload) - 100])  # 2.99 blocks
    deadline = time.monotonic() + 10.0
    while "writer connection lost" not in caplog.text:  # the store saw the connection close
        assert time.monotonic() < deadline, "the store never noticed the writer leave"
        time.sleep(0.02)
    assert store.cache.num_held() == 0 and store.stats.num_blocks_stored == 0
    assert store.cache.validate(0, [1, 2, 3], list(put.groups[0].block_hashes)) == [0, 1, 2]
    # The store keeps serving writers: a whole put of other blocks is stored, all of it.
    whole, whole_payload = _put(store, 2, first=10)
    writer = StoreWriter(*store.write_address)
    loop = get_loop_thread()
    try:
        reply = loop.run(writer.put(whole, [memoryview(whole_payload)]), 10.0)
    finally:
        loop.run(writer.close(), 5.0)
    assert (reply.num_stored, reply.num_refused) == (2, 0)
    assert store.cache.num_held() == 2
