"""A store port that answers garbage (issue 31, part 6: "a malformed ... store reply: a clear log
line, never a crash"): another service on the port, a store of an unknown version, a stream cut
off. Both of a node's paths to a store are fed garbage by a fake store (a TCP server that answers
each frame with the given bytes, then closes the connection):

- the offload path (``OffloadSender`` and its ``StoreWriter`` on the store's write port): the
  garbage answers the writer's hello, or, after a good ``hello_ok``, its put. Every item is
  reported not held, the failure is counted and said in one WARNING naming what was wrong, and
  the next write is tried afresh (no stuck lock, no bytes left in flight);
- the restore path (kvbridge's own engine, UCX transport, a Redis index): the index names the
  fake store (tier ``store``) as the holder of a prompt's blocks; the engine's pull meets garbage
  at the handshake on the store's pull port. The request is recomputed (greedy tokens equal a
  plain run), the failure counted and logged, nothing restored, no block held, and the engine
  serves the next request.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading

import msgpack
import pytest
import torch
from _engine_builders import reference_greedy
from _pd_builders import assert_node_empty, long_prompt
from kvbridge.connector.index import IndexClient, open_index
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.store.offload_items import OffloadItem, OffloadOutcome
from kvbridge.connector.store.sender import OffloadSender
from kvbridge.connector.store.wire import PutReply, encode_hello_ok, encode_reply
from kvbridge.kvmanager import BlockStored
from kvbridge.transport import NodeMetadata
from test_store_tier import BLOCK_SIZE, MAX_TOKENS, hashes_of, make_node, serve, stats

_FRAME = struct.Struct(">I")


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload)) + payload


GARBAGE = {
    "not msgpack": _frame(b"\xc1" * 8),  # 0xc1: a byte msgpack never uses
    "a msgpack list": _frame(msgpack.packb([1, 2, 3])),
    "an unknown schema version": _frame(msgpack.packb({"v": 99, "type": "put_ok"})),
    "an unknown message type": _frame(msgpack.packb({"v": 1, "type": "surprise"})),
    "a frame too long": b"\xff\xff\xff\xff",
    "a frame cut off": _FRAME.pack(1000) + b"\x81",
    "http": b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
}


class _FakeStore:
    """A TCP server on 127.0.0.1 that answers, on each connection, the first frame it gets with
    ``first`` (None: ``garbage``) and the next ones with ``garbage``; after a ``garbage`` reply
    it closes the connection unless ``keep_open``. Frames are read as ``u32 length | msgpack
    header`` (a store put's payload, ``payload_nbytes``, is read too). The attributes may be
    changed between writes; one connection is served at a time."""

    def __init__(self, garbage: bytes, first: bytes | None = None) -> None:
        self.garbage, self.first, self.keep_open = garbage, first, False
        self.num_connections = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            self.num_connections += 1
            with conn, contextlib.suppress(OSError):  # OSError: the node gave up on it first
                conn.settimeout(5.0)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        first = self.first
        while not self._stop.is_set():
            header = conn.recv(_FRAME.size, socket.MSG_WAITALL)
            if len(header) < _FRAME.size:
                return
            raw = conn.recv(_FRAME.unpack(header)[0], socket.MSG_WAITALL)
            try:
                obj = msgpack.unpackb(raw, raw=False)
            except Exception:  # the transport's frames are msgpack too; never mind what
                obj = None
            if isinstance(obj, dict) and obj.get("type") == "put":
                conn.recv(obj["payload_nbytes"], socket.MSG_WAITALL)
            if first is not None:
                conn.sendall(first)
                first = None
                continue
            conn.sendall(self.garbage)
            if not self.keep_open:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._server.close()


@pytest.fixture(params=sorted(GARBAGE), ids=lambda name: name.replace(" ", "-"))
def garbage(request) -> bytes:
    return GARBAGE[request.param]


# ---------------------------------------------------------------------- the offload path
def _sender(port: int, node_stats: KVTransferStats) -> OffloadSender:
    caches = [torch.zeros(4, 2, BLOCK_SIZE, 2, 8)]
    sender = OffloadSender(store_address=("127.0.0.1", port), max_inflight_bytes=1 << 20,
                           stats=node_stats)
    sender.bind([caches], NodeMetadata.from_kv_caches(
        engine_id="n", kv_caches_by_group=[caches], model_name="m", hash_fn_name="sha256"))
    sender.wait_idle()  # its hello at bind (an empty put, on a connection of its own)
    # (said at INFO, and no write failed: the first write connects again)
    assert node_stats.num_offload_failures == 0 and sender.take_outcomes() == []
    return sender


_ITEMS = [OffloadItem(1, 0, b"a" * 32, b""), OffloadItem(3, 0, b"b" * 32, b"a" * 32)]


def _write(sender: OffloadSender, caplog) -> list[logging.LogRecord]:
    """Submit ``_ITEMS`` and wait for the write; the sender's log records of it (DEBUG up)."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvbridge.connector.store.sender"):
        assert sender.submit(_ITEMS) == 2
        sender.wait_idle()
    return [r for r in caplog.records if r.name == "kvbridge.connector.store.sender"]


@pytest.mark.parametrize("where", ["hello", "put"])
def test_a_store_that_answers_a_write_with_garbage_costs_that_write_only(garbage, where, caplog):
    store = _FakeStore(garbage, first=encode_hello_ok(7) if where == "put" else None)
    node_stats = KVTransferStats()
    sender = _sender(store.port, node_stats)
    try:
        for attempt in (1, 2, 3):  # each write reconnects and fails the same way
            records = _write(sender, caplog)
            assert sender.take_outcomes() == [
                OffloadOutcome(0, b"a" * 32, False), OffloadOutcome(0, b"b" * 32, False)]
            assert (node_stats.num_offload_failures, node_stats.num_offloaded_blocks) == (
                attempt, 0)
            assert sender.inflight_bytes == 0
            # Said once, at the first failure, naming the store and what was wrong; later
            # failures of the same outage only at DEBUG (a write fails every step meanwhile).
            warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
            if attempt == 1:
                assert len(warnings) == 1, warnings
                assert f"store at 127.0.0.1:{store.port} failed (" in warnings[0], warnings
            else:
                assert warnings == [] and len(records) == 1, [r.getMessage() for r in records]
        assert store.num_connections == 1 + 3  # the hello at bind, then one per write
    finally:
        sender.close()
        store.close()


def test_a_store_write_failure_is_said_once_per_outage_and_its_end_in_one_line(caplog):
    # A store that closes every connection unanswered, then answers, then fails again: one
    # WARNING when writes start failing, one INFO when one lands again, one WARNING for the
    # next outage; nothing above DEBUG in between.
    store = _FakeStore(garbage=b"")
    node_stats = KVTransferStats()
    sender = _sender(store.port, node_stats)
    good = (encode_hello_ok(7), encode_reply(PutReply(2, 0, 0, store_incarnation=7)))
    try:
        levels = []
        for first, garbage in [(None, b"")] * 3 + [good] * 2 + [(None, b"")] * 2:
            store.first, store.garbage, store.keep_open = first, garbage, first is not None
            levels.append([r.levelno for r in _write(sender, caplog)])
            sender.take_outcomes()
        assert levels == [[logging.WARNING], [logging.DEBUG], [logging.DEBUG], [logging.INFO],
                          [], [logging.WARNING], [logging.DEBUG]], levels
        assert (node_stats.num_offload_failures, node_stats.num_offloaded_blocks) == (5, 4)
    finally:
        sender.close()
        store.close()


# ---------------------------------------------------------------------- the restore path
@pytest.fixture
def ucx_node(redis_url):
    """A kvbridge node pulling over UCX (its control channel: TCP), on ``redis_url``'s index."""
    node = make_node("node-a", None, redis_url, None, transport="ucxx")
    yield node
    node.shutdown()


def test_a_store_whose_pull_port_answers_garbage_costs_a_recompute(
        garbage, redis_url, ucx_node, caplog):
    node = ucx_node
    prompt = long_prompt(12 * BLOCK_SIZE + 5)
    hashes = hashes_of(node, prompt)[:12]
    # The fake store registers in the node's index namespace as a store holding the prompt's
    # first 12 blocks (ids 1..12), its pull address the garbage server's.
    store = _FakeStore(garbage)
    namespace = node.scheduler.connector.scheduler_half.index_client.index.namespace
    index, directory = open_index(redis_url, namespace)
    fake = IndexClient(index, directory, node_id="store-fake", incarnation=1, group_ids=[0],
                       ttl_s=30.0, tier="store")
    try:
        fake.start("127.0.0.1", store.port)
        fake.publish([BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=[],
                                  block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=0,
                                  block_ids=[i + 1])
                      for i, (h, parent) in enumerate(zip(hashes, [None, *hashes], strict=False))])
        assert fake.flush()
        with caplog.at_level(logging.WARNING):
            out = serve(node, "r-1", prompt)
        assert out.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
        s = stats(node)
        assert (s["num_index_hits"], s["num_failed_loads"], s["num_restored_blocks"]) == (1, 1, 0)
        assert store.num_connections >= 1  # the pull did reach the garbage
        said = [r.getMessage() for r in caplog.records if "pull of r-1 failed" in r.getMessage()]
        assert len(said) == 1 and "handshake" in said[0], said
        assert_node_empty(node)
        # The node keeps serving (another prompt, nobody else holds it).
        other = long_prompt(3 * BLOCK_SIZE, salt="Something else. ")
        assert serve(node, "r-2", other).token_ids == reference_greedy(other, MAX_TOKENS,
                                                                       hybrid=False)
        assert_node_empty(node)
    finally:
        fake.close()
        store.close()
