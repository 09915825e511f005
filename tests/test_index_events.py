"""Events that never leave the index wrong (issue 14, part 3): numbered publish batches, a
resync of the node's whole cached set after a gap, and no resurrection by a late or replayed
"stored". Real ``redis-server`` (``tests/_redis_fixture.py``) and the in-memory reference."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest
import redis
from _engine_builders import reference_greedy, tiny_model
from _pd_builders import assert_node_empty, long_prompt, run_to_completion
from kvbridge.connector.factory import create_engine
from kvbridge.connector.index import (
    BlockIndex,
    IndexClient,
    IndexNamespace,
    InMemoryBlockIndex,
    InMemoryNodeDirectory,
    RedisBlockIndex,
    RedisClusterBlockIndex,
    open_index,
)
from kvbridge.connector.index import worker as worker_module
from kvbridge.connector.index.protocol import PublishResult, events_to_ops
from kvbridge.connector.index.redis_index import _PUBLISH
from kvbridge.kvmanager import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlock,
    Request,
    SamplingParams,
)
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.transport import BlockIdentity, LoopbackNetwork

BLOCK_SIZE = 16
MAX_TOKENS = 3
NAMESPACE = IndexNamespace(identity=BlockIdentity(
    model_name="events", kv_cache_dtype="float32", block_size=BLOCK_SIZE, hash_fn_name="sha256"
))


def _hash(i: int) -> bytes:
    return bytes([i + 1]) * 32


def _stored(i: int, block_id: int, *, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[_hash(i)],
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=[],
        block_size=BLOCK_SIZE,
        lora_name=None,
        medium=None,
        group_id=0,
        block_ids=[block_id],
    )


def _removed(i: int, block_id: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[_hash(i)], medium=None, group_id=0, block_ids=[block_id])


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[BlockIndex]:
    if request.param == "memory":
        backend: BlockIndex = InMemoryBlockIndex(NAMESPACE)
    else:
        backend = RedisBlockIndex(NAMESPACE, request.getfixturevalue("redis_url"))
    yield backend
    backend.close()


def _keys(index: BlockIndex, node_id: str) -> set[tuple[int, bytes, int]]:
    entries = index.node_entries(node_id)
    assert entries is not None
    return entries


def test_numbered_batches_apply_in_order_replays_are_ignored_gaps_refused(index):
    assert index.register_node("a", 7, ttl_s=10.0) == "ok"
    k = NAMESPACE.key_hash_bytes
    # (1) Batch 1 stores block 0; the same batch again (a retry that landed twice) is ignored.
    assert index.publish("a", 7, [_stored(0, 5)], seq=(1, 1)).status == "ok"
    assert index.publish("a", 7, [_stored(0, 5)], seq=(1, 1)).status == "replayed"
    # (2) Batches 2-3 (merged in one call) store block 1 and remove block 0.
    result = index.publish("a", 7, [_stored(1, 6, parent=0), _removed(0, 5)], seq=(2, 3))
    assert result.status == "ok"
    assert _keys(index, "a") == {(0, _hash(1)[:k], 6)}
    # (3) A late "stored" of block 0 (batch 1 replayed after its removal) resurrects nothing.
    assert index.publish("a", 7, [_stored(0, 5)], seq=(1, 1)).status == "replayed"
    assert _keys(index, "a") == {(0, _hash(1)[:k], 6)}
    # (4) Batch 5 after batch 3: batch 4 is missing, so the index refuses it (the node resyncs).
    assert index.publish("a", 7, [_stored(2, 7, parent=1)], seq=(5, 5)).status == "gap"
    assert _keys(index, "a") == {(0, _hash(1)[:k], 6)}
    # (5) The resync (batch 6) replaces everything with the node's whole set.
    resync = [AllBlocksCleared(medium=None), _stored(0, 9), _stored(1, 10, parent=0)]
    assert index.publish("a", 7, resync, seq=(6, 6), resync=True).status == "ok"
    assert _keys(index, "a") == {(0, _hash(0)[:k], 9), (0, _hash(1)[:k], 10)}
    assert index.longest_prefix([_hash(0), _hash(1)]).num_blocks == 2
    assert index.publish("a", 7, [_removed(1, 10)], seq=(7, 7)).status == "ok"
    assert index.longest_prefix([_hash(0), _hash(1)]).num_blocks == 1
    # (6) A new incarnation starts counting again from 1.
    assert index.register_node("a", 8, ttl_s=10.0) == "ok"
    assert index.publish("a", 8, [_stored(0, 3)], seq=(1, 1)).status == "ok"
    assert (index.stats.publishes_replayed, index.stats.publishes_gap) == (2, 1)
    assert index.stats.resyncs == 1


# ---------------------------------------------------------------------------- a real node


def make_node(
    engine_id: str, network: LoopbackNetwork, index_url: str, num_blocks: int, ttl_s: float
) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=1100,
        max_num_batched_tokens=1100,
    )
    kv_transfer_config = {
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "transport": "loopback",
            "index_url": index_url,
            "index_ttl_s": ttl_s,
            "load_timeout_s": 5.0,
        },
    }
    return create_engine(
        tiny_model(hybrid=False), config, kv_transfer_config, loopback_network=network
    )


def client_of(engine: Engine):
    return engine.scheduler.connector.scheduler_half.index_client


def serve(engine: Engine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    return run_to_completion(engine, request_id).token_ids


def pool_entries(engine: Engine) -> set[tuple[int, bytes, int]]:
    """The node's cached set, read through the pool's thread-safe snapshot API."""
    k = NAMESPACE.key_hash_bytes
    return {
        (entry.group_id, entry.block_hash[:k], entry.block_id)
        for entry in engine.kv_cache_manager.block_pool.snapshot_cached_blocks()
    }


def step_until_resynced(engine: Engine, *, min_resyncs: int, timeout_s: float = 10.0) -> None:
    """Step the (idle) node until its worker has had ``min_resyncs`` resyncs applied and no
    batch is in doubt, then until every queued batch is sent."""
    client = client_of(engine)
    deadline = time.monotonic() + timeout_s
    while client.resync_pending or client.num_resyncs < min_resyncs:
        assert time.monotonic() < deadline, "the node never resynced"
        engine.step()
        time.sleep(0.01)
    assert client.flush()


def hashes_of(engine: Engine, prompt: list[int]) -> list[bytes]:
    probe = Request(
        "probe", prompt, SamplingParams(max_tokens=1),
        block_hasher=engine.kv_cache_manager.request_block_hasher,
    )
    return list(probe.block_hashes)


@pytest.fixture
def node(redis_url):
    made: list[Engine] = []
    network = LoopbackNetwork()

    def build(engine_id: str, num_blocks: int, ttl_s: float = 1.5) -> Engine:
        made.append(make_node(engine_id, network, redis_url, num_blocks, ttl_s))
        return made[-1]

    yield build
    for engine in made:
        engine.shutdown()


def test_after_a_redis_outage_the_resync_makes_the_index_say_exactly_what_the_node_holds(
    node, redis_server, redis_url
):
    a = node("node-a", num_blocks=72)  # 71 usable blocks
    index = client_of(a).index
    old = long_prompt(40 * BLOCK_SIZE + 3)
    serve(a, "old", old)
    assert client_of(a).flush()
    assert index.node_entries("node-a") == pool_entries(a)  # 40 blocks
    # (1) Redis goes down (SIGKILL: its data is lost). The node caches a 50-block prompt; the
    # pool has 31 unhashed free blocks, so 20 of the old prompt's cached blocks are evicted.
    redis_server.stop()
    new = long_prompt(50 * BLOCK_SIZE + 3, salt="While Redis was down. ")
    assert serve(a, "new", new) == reference_greedy(new, MAX_TOKENS, hybrid=False)
    cached = pool_entries(a)
    pool = a.kv_cache_manager.block_pool
    old_hashes, new_hashes = hashes_of(a, old)[:40], hashes_of(a, new)[:50]
    assert sum(pool.get_cached_block(h, [0]) is not None for h in old_hashes) == 20
    assert all(pool.get_cached_block(h, [0]) is not None for h in new_hashes)
    assert len(cached) == 70
    # (2) Redis is back, empty. The node registers again and re-publishes its whole set.
    redis_server.start()
    step_until_resynced(a, min_resyncs=1)
    assert index.node_entries("node-a") == pool_entries(a) == cached
    assert index.longest_prefix(new_hashes).num_blocks == 50
    assert index.longest_prefix(old_hashes).num_blocks == 20  # its tail went first (rule 7)
    # (3) Deltas flow again after the resync.
    a.kv_cache_manager.block_pool.evict_blocks(
        {pool.get_cached_block(new_hashes[30], [0])[0].block_id}
    )
    a.step()
    assert client_of(a).flush()
    assert index.node_entries("node-a") == pool_entries(a)
    assert index.longest_prefix(new_hashes).num_blocks == 30
    assert_node_empty(a)


class _HeldPublish:
    """Holds the first ``publish`` the node's index worker makes from now on until ``release``
    (then it runs on the real server): a server that answers late but within the client's
    socket timeout, so no call fails and nothing but a full queue can lose a batch meanwhile.
    ``entered`` is set once the worker is inside that call."""

    def __init__(self, index: BlockIndex) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        publish = index.publish

        def held_publish(*args, **kwargs):
            if not self.entered.is_set():
                self.entered.set()
                self._released.wait(timeout=60.0)
            return publish(*args, **kwargs)

        index.publish = held_publish  # type: ignore[method-assign]

    def release(self) -> None:
        self._released.set()


def evict_cached(engine: Engine, block_hash: bytes) -> None:
    """Take ``block_hash``'s (group 0) block out of the node's prefix cache, as an eviction
    does, and run a step, which publishes the "removed" event as a batch of its own."""
    pool = engine.kv_cache_manager.block_pool
    pool.evict_blocks({pool.get_cached_block(block_hash, [0])[0].block_id})
    engine.step()


def test_a_batch_dropped_on_a_full_publish_queue_is_repaired_by_a_resync(node):
    # A long TTL: no registration lapses while the worker is held (that would start a resync
    # of its own); the full queue must be the only way a batch gets lost here.
    a = node("node-a", num_blocks=72, ttl_s=60.0)  # 71 usable blocks
    client = client_of(a)
    index = client.index
    old = long_prompt(40 * BLOCK_SIZE + 3)
    serve(a, "old", old)
    assert client.flush()
    assert index.node_entries("node-a") == pool_entries(a)  # 40 blocks
    old_hashes = hashes_of(a, old)[:40]
    # One queued op fills the queue (the connector's queue holds 65,536; a real node fills it
    # only when its worker is stuck for a long time, which ``_HeldPublish`` stands in for).
    client._worker.max_queued_ops = 1
    held = _HeldPublish(index)
    try:
        # (1) Batch 1 ("removed" of old block 39) is taken by the worker, whose call is held.
        evict_cached(a, old_hashes[39])
        assert held.entered.wait(timeout=30.0), "the worker never published batch 1"
        # (2) Batch 2 ("removed" of old block 38) is queued: the queue is full now.
        evict_cached(a, old_hashes[38])
        assert client.stats.publish_batches_dropped_full == 0
        # (3) The node caches a 50-block prompt (its lookup times out behind the held worker;
        # the answer is computed locally). The pool has 33 unhashed free blocks, so 18 more
        # of the old prompt's cached blocks are evicted. Those 68 events are one batch, which
        # the full queue drops.
        new = long_prompt(50 * BLOCK_SIZE + 3, salt="While the publish queue was full. ")
        assert serve(a, "new", new) == reference_greedy(new, MAX_TOKENS, hybrid=False)
        assert client.stats.publish_batches_dropped_full == 1
        assert client.stats.publish_ops_dropped_full == 50 + 18
        assert client.resync_pending
        # A full queue is not a lost backend: the set is wanted at once, and a later step of
        # the prompt read it; it waits in the queue in place of batch 2.
        assert client._worker._queue.num_whole_set_ops > 0
    finally:
        held.release()
    cached = pool_entries(a)
    new_hashes = hashes_of(a, new)[:50]
    pool = a.kv_cache_manager.block_pool
    assert sum(pool.get_cached_block(h, [0]) is not None for h in old_hashes) == 20
    assert len(cached) == 70
    # (4) Batch 1 lands, then the node's whole cached set (batch 2 never went out): the index
    # says exactly what the node holds.
    step_until_resynced(a, min_resyncs=1)
    assert client._worker.num_batches_skipped == 0
    assert index.node_entries("node-a") == pool_entries(a) == cached
    assert index.longest_prefix(new_hashes).num_blocks == 50
    assert index.longest_prefix(old_hashes).num_blocks == 20  # its tail went first (rule 7)
    assert client.stats.publish_batches_dropped_full == 1  # the queue accepts again
    # (5) Deltas flow again after the resync.
    evict_cached(a, new_hashes[30])
    assert client.flush()
    assert index.node_entries("node-a") == pool_entries(a)
    assert index.longest_prefix(new_hashes).num_blocks == 30
    assert_node_empty(a)


def _resp(*args: bytes | str | int) -> bytes:
    """One command in the Redis protocol (RESP2 array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply_line(sock: socket.socket) -> bytes:
    """The first line of the next reply on ``sock`` (its socket timeout bounds the wait)."""
    data = b""
    while not data.endswith(b"\r\n"):
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        data += chunk
    return data


class _Server(NamedTuple):
    host: str
    port: int
    db: int


def server_of_prompt(index: BlockIndex, url: str, first_hash: bytes) -> _Server:
    """The server that holds the index keys of a prompt whose block 0 has hash ``first_hash``:
    a ``redis://`` URL's one server, or on a cluster the shard of the prompt's bucket."""
    if isinstance(index, RedisClusterBlockIndex):
        name = index.shard_of_prompt(first_hash[: NAMESPACE.key_hash_bytes])
        host, _, port = name.rpartition(":")
        return _Server(host, int(port), 0)
    parsed = urllib.parse.urlparse(url)
    assert parsed.hostname is not None and parsed.port is not None, url
    return _Server(parsed.hostname, parsed.port, int(parsed.path.lstrip("/") or 0))


class _LateCopy:
    """Keeps a byte-for-byte copy of ``index``'s first PUBLISH script call that carries
    ``block_hash`` (``EVALSHA`` and its arguments, as the node's client sent it), and sends it
    later on a raw connection of the test's own (``send``), which stays open until its reply is
    read (``reply``). That is the publish that times out on the node's client and lands anyway,
    on every server: whether the server runs the command of a client that gave up and closed
    its connection is the server's business (Debian's redis-server and valkey-server differ);
    this copy's connection never gives up. ``server`` is the one that call goes to
    (``server_of_prompt``)."""

    def __init__(self, server: _Server, index: RedisBlockIndex, block_hash: bytes) -> None:
        host, port, db = server
        self.sock = socket.create_connection((host, port), timeout=30.0)
        if db:
            self.sock.sendall(_resp("SELECT", db))
            assert _read_reply_line(self.sock) == b"+OK\r\n"
        self.packed: bytes | None = None
        conns = index._lookup_conns  # a publish goes out pre-packed, on a held connection
        sha = _PUBLISH.sha.encode()
        late = self

        class KeepingACopy:
            def send(self, pool, packed):
                if late.packed is None and sha in packed and block_hash in packed:
                    late.packed = packed
                return conns.send(pool, packed)

        index._lookup_conns = KeepingACopy()

    def send(self) -> None:
        assert self.packed is not None, "no publish carried the block"
        self.sock.sendall(self.packed)

    def reply(self) -> bytes:
        """The copy's reply (it has run), and the connection closed."""
        try:
            return _read_reply_line(self.sock)
        finally:
            self.sock.close()


def test_a_publish_that_times_out_but_lands_never_resurrects_an_evicted_block(node, redis_url):
    # A long TTL: no heartbeat falls in the pause below, so the publish is the call that meets
    # the paused server (a heartbeat first would start the client's back-off instead).
    a = node("node-a", num_blocks=72, ttl_s=60.0)
    index = client_of(a).index
    warm = long_prompt(8 * BLOCK_SIZE + 3)
    serve(a, "warm", warm)
    assert client_of(a).flush()
    # (1) A schedules a prompt (its lookup answered): the blocks are hashed, not yet published.
    prompt = long_prompt(6 * BLOCK_SIZE + 4, salt="Late. ")
    hashes = hashes_of(a, prompt)[:6]
    k = NAMESPACE.key_hash_bytes
    a.add_request("late", prompt, SamplingParams(max_tokens=1))
    scheduler_output = a.scheduler.schedule()
    while not scheduler_output.num_scheduled_tokens:
        a.scheduler.update_from_output(scheduler_output, a.runner.execute_model(scheduler_output))
        time.sleep(0.001)
        scheduler_output = a.scheduler.schedule()
    # (2) The server (on a cluster: the shard of the prompt's bucket, where that publish goes)
    # holds every script call (``CLIENT PAUSE ... WRITE``; ended below by
    # ``CLIENT UNPAUSE``, which such a pause lets through): the step's publish (its "stored"
    # events) times out on the client after 0.25 s; a copy of it is kept (``_LateCopy``).
    server = server_of_prompt(index, redis_url, hashes[0])
    late = _LateCopy(server, index, hashes[3][:k])
    admin = redis.Redis(host=server.host, port=server.port, db=server.db, socket_timeout=30.0)
    unanswered = index.stats.publishes_dropped
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        a.scheduler.update_from_output(scheduler_output, a.runner.execute_model(scheduler_output))
        deadline = time.monotonic() + 30
        while index.stats.publishes_dropped == unanswered:
            assert time.monotonic() < deadline, "the publish never timed out"
            time.sleep(0.01)
        # (3) While the server still holds script calls, the node evicts block 3 of that
        # prompt (its "removed" batch waits behind the unanswered call, which the node holds
        # to make again); then the timed-out batch reaches the server (the copy, queued behind
        # the pause like the node's own calls), and runs when the pause ends.
        pool = a.kv_cache_manager.block_pool
        pool.evict_blocks({pool.get_cached_block(hashes[3], [0])[0].block_id})
        a.step()
        late.send()
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    # The late publish did land: it ran, not refused.
    reply = late.reply()
    assert not reply.startswith(b"-"), reply
    # (4) The node makes its held call again, the same batch numbers: applied, or "replayed"
    # where a copy ran first (the server ran them in some order); the removal follows it,
    # and no copy that runs later applies again. No resync was needed, nor an engine step.
    assert client_of(a).flush(timeout_s=10.0)
    entries = index.node_entries("node-a")
    assert entries == pool_entries(a)
    assert hashes[3][:k] not in {key for _, key, _ in entries}
    assert index.longest_prefix(hashes).num_blocks == 3
    assert client_of(a).num_resyncs == 0 and not client_of(a).resync_pending
    # (5) The timed-out batch replayed once more is ignored: it was applied already.
    replay = BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BLOCK_SIZE,
        lora_name=None, medium=None, group_id=0, block_ids=list(range(1, 7)),
    )
    incarnation = client_of(a).incarnation
    assert index.publish("node-a", incarnation, [replay], seq=(1, 1)).status == "replayed"
    assert index.node_entries("node-a") == pool_entries(a)
    assert index.longest_prefix(hashes).num_blocks == 3
    assert_node_empty(a)


# ---------------------------------------------------------------------------- the hit metric


def test_a_remote_hit_is_counted_once_when_the_request_waited_many_steps_for_room():
    network = LoopbackNetwork()
    url = "memory"
    config_b = EngineConfig(num_blocks=80, block_size=BLOCK_SIZE, max_model_len=600,
                            max_num_batched_tokens=600)
    config_c = EngineConfig(num_blocks=40, block_size=BLOCK_SIZE, max_model_len=600,
                            max_num_batched_tokens=600)
    extra = {"transport": "loopback", "index_url": url, "model_name": "hit-metric",
             "index_ttl_s": 5.0, "load_timeout_s": 5.0}
    b, c = (
        create_engine(
            tiny_model(hybrid=False), config,
            {"kv_role": "kv_both", "engine_id": engine_id, "kv_connector_extra_config": extra},
            loopback_network=network,
        )
        for engine_id, config in (("node-b", config_b), ("node-c", config_c))
    )
    try:
        prompt = long_prompt(16 * BLOCK_SIZE + 5)
        serve(b, "warm", prompt)
        assert client_of(b).flush()
        # (1) C runs a request that keeps 25 to 28 of its 39 blocks while it decodes 60 tokens,
        # so req-0 (17 blocks, 16 of them found on B through the index) waits for room.
        hog = long_prompt(24 * BLOCK_SIZE, salt="hog")
        c.add_request("hog", hog, SamplingParams(max_tokens=60))
        while not any(c.kv_cache_manager.get_block_ids("hog")):  # its own lookup answered
            c.step()
        c.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS))
        num_waiting_steps = 0  # steps in which req-0 had no block yet
        tokens: list[int] = []
        deadline = time.monotonic() + 60
        while not tokens:
            assert time.monotonic() < deadline, "req-0 never finished"
            if not any(c.kv_cache_manager.get_block_ids("req-0")):
                num_waiting_steps += 1
            for output in c.step():
                if output.request_id == "req-0" and output.finished:
                    tokens = output.token_ids
        assert num_waiting_steps >= 20  # it matched on every one of them
        assert tokens == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
        stats = c.scheduler.connector.stats.snapshot()
        # (2) Counted once, when its blocks were allocated: 16 blocks, not 16 per step waited.
        # Its answer is handed out again while it waits (ANSWER_REUSE_S), not looked up again
        # each step: the hog's lookup, req-0's, and one more per ANSWER_REUSE_S waited at most.
        assert 2 <= stats["num_index_lookups"] < num_waiting_steps
        assert (stats["num_index_hits"], stats["num_loads"]) == (1, 1)
        assert stats["remote_hit_tokens"] == 16 * BLOCK_SIZE
        assert_node_empty(b)
        assert_node_empty(c)
    finally:
        b.shutdown()
        c.shutdown()


def _chain_hash(i: int) -> bytes:
    """Distinct hashes for long chains (``_hash`` has 255)."""
    return hashlib.sha256(f"chain/{i}".encode()).digest()


def test_a_resync_of_a_large_cached_set_lands_in_calls_the_server_runs_in_time(redis_url):
    # 40,000 cached blocks. As one script call the resync ran past the 0.25 s socket timeout
    # (16k blocks already did here): the node saw it fail, asked for it again, forever, while
    # each try held the server for the whole script. Sent in calls of 1,024 ops, it lands and
    # the index lists every block again.
    num_blocks = 40_000
    index, directory = open_index(redis_url, NAMESPACE)
    hashes = [_chain_hash(i) for i in range(num_blocks)]
    cached = [CachedBlock(h, 0, i + 1) for i, h in enumerate(hashes)]
    client = IndexClient(index, directory, node_id="A", incarnation=1, group_ids=(0,),
                         ttl_s=5.0)  # a busy host must not let it lapse
    client.set_resync_source(lambda: cached)
    client.start("127.0.0.1", 1)
    try:
        for k in range(0, num_blocks, 4000):  # cached as deltas, each in time
            client.publish([BlockStored(
                block_hashes=hashes[k:k + 4000], parent_block_hash=hashes[k - 1] if k else None,
                token_ids=[], block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=0,
                block_ids=list(range(k + 1, k + 4001)))])
            assert client.flush(10)
        redis.Redis.from_url(redis_url).flushall()  # Redis restarted empty
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
            client.num_resyncs and not client.resync_pending and client.flush(5)
        ):
            client.publish([])  # an engine step: the resync's set is read here when asked
            time.sleep(0.02)
        assert client.num_resyncs >= 1 and not client.resync_pending
        assert client.flush(10)
        assert len(_keys(index, "A")) == num_blocks
        assert index.longest_prefix(hashes).num_blocks == num_blocks
    finally:
        client.close()


class _ScriptedIndex(InMemoryBlockIndex):
    """An in-memory index whose publishes fail, take time, wait or are recorded on demand:
    ``fail_next`` refuses the next one (``"gap"``: as if a batch before it had been lost);
    ``unanswered`` answers the next that many ``"unavailable"`` (as a timed-out call, never
    applied); each takes ``delay_s``; the first call for which ``hold_when(calls)`` is true
    waits for ``release`` (``held`` is set once it is inside); ``calls`` records each call's
    (ops, resync) and ``seqs`` every call's ``seq``, answered or not. ``heartbeat_answer``:
    what heartbeats answer while set ("unavailable", or "fenced" once)."""

    def __init__(self, *, delay_s: float = 0.0) -> None:
        super().__init__(NAMESPACE)
        self.fail_next = False
        self.unanswered = 0
        self.delay_s = delay_s
        self.calls: list[tuple[int, bool]] = []
        self.seqs: list[tuple[int, int] | None] = []
        self.hold_when: Callable[[list[tuple[int, bool]]], bool] | None = None
        self.held, self.release = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.heartbeat_answer: str | None = None
        self.num_heartbeats_unanswered = 0

    def heartbeat(self, node_id, incarnation, *, ttl_s):
        answer = self.heartbeat_answer
        if answer is None:
            return super().heartbeat(node_id, incarnation, ttl_s=ttl_s)
        if answer == "fenced":
            self.heartbeat_answer = None
        else:
            self.num_heartbeats_unanswered += 1
        return answer

    def publish(self, node_id, incarnation, events, **kwargs):
        events = list(events)
        self.seqs.append(kwargs.get("seq"))
        if self.fail_next:
            self.fail_next = False
            return PublishResult("gap", 1)
        if self.unanswered:
            self.unanswered -= 1
            return PublishResult("unavailable", 1)
        self.calls.append((len(events_to_ops(events, "device")), bool(kwargs.get("resync"))))
        if self.hold_when is not None and not self.held.is_set() and self.hold_when(self.calls):
            self.held.set()
            self.release.wait(10)
        time.sleep(self.delay_s)
        with self.lock:
            return super().publish(node_id, incarnation, events, **kwargs)

    def node_entries(self, node_id: str):
        with self.lock:
            return super().node_entries(node_id)


def pool_client(index: BlockIndex, pool: dict[bytes, int], **kwargs) -> IndexClient:
    """A started client of node ``A`` (group 0; ``kwargs``: ``ttl_s`` and the rest) whose
    cached set, read for a resync, is ``pool`` (block hash -> block id) as it is then."""
    client = IndexClient(index, InMemoryNodeDirectory(), node_id="A", incarnation=1,
                         group_ids=(0,), **kwargs)
    client.set_resync_source(lambda: [CachedBlock(h, 0, b) for h, b in list(pool.items())])
    client.start("127.0.0.1", 1)
    return client


def test_a_batch_dropped_while_a_resync_is_in_flight_gets_a_resync_of_its_own():
    # The resync's set was read before the drop, so it lacks the dropped batch: its success
    # must not end resync mode (before the fix it did, and block 3 was never indexed).
    index = _ScriptedIndex()
    index.hold_when = lambda calls: calls[-1][1]  # the resync's call
    pool: dict[bytes, int] = {}  # what the node caches: block hash -> block id
    client = pool_client(index, pool, ttl_s=5.0, max_queued_ops=1)
    try:
        pool[_hash(1)] = 1
        index.fail_next = True  # (1) one publish lost: resync mode
        client.publish([_stored(1, 1)])
        deadline = time.monotonic() + 5
        while not index.held.is_set() and time.monotonic() < deadline:
            client.publish([])  # (2) an engine step: the resync's set is read here when asked
            time.sleep(0.01)
        assert index.held.wait(5)
        # (3) While it is in the backend two more blocks are cached; the queue (1 op) takes
        # the first batch and drops the second.
        pool[_hash(2)] = 2
        client.publish([_stored(2, 2, parent=1)])
        pool[_hash(3)] = 3
        client.publish([_stored(3, 3, parent=2)])
        assert client.stats.publish_batches_dropped_full == 1
        index.release.set()
        assert client.flush(5)
        deadline = time.monotonic() + 5  # (4) the resync probe (50 ms): a second resync
        while time.monotonic() < deadline and client.num_resyncs < 2:
            client.publish([])
            time.sleep(0.05)
        assert client.flush(5) and not client.resync_pending
        assert _keys(index, "A") == {(0, _hash(i)[:8], i) for i in (1, 2, 3)}
    finally:
        client.close()


def test_a_pool_that_builds_its_own_resync_batch_gives_it_and_the_client_keeps_no_parents():
    # vLLM's pool follower files every block's parent itself (PrefixCacheMirror.resync_events):
    # the client resyncs from that batch and keeps no parent table of its own, which every
    # publish fed before (a Python loop per block on the engine thread, after each step).
    index = _ScriptedIndex()
    made: list[int] = []

    class Pool:
        def resync_events(self) -> list:
            made.append(1)
            return [AllBlocksCleared(medium=None), _stored(1, 1), _stored(2, 2, parent=1)]

        def snapshot_cached_blocks(self) -> list:
            raise AssertionError("a pool that builds its resync batch is not read otherwise")

    client = IndexClient(index, InMemoryNodeDirectory(), node_id="A", incarnation=1,
                         group_ids=(0,), ttl_s=5.0)
    client.resync_from(Pool())
    client.start("127.0.0.1", 1)
    try:
        index.fail_next = True  # the first publish is lost: resync mode
        client.publish([_stored(1, 1), _stored(2, 2, parent=1)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            made and not client.resync_pending and client.flush(5)
        ):
            client.publish([])  # an engine step: the resync's batch is made here when asked
            time.sleep(0.01)
        assert made and not client.resync_pending
        assert _keys(index, "A") == {(0, _hash(i)[:8], i) for i in (1, 2)}
        assert index.longest_prefix([_hash(1), _hash(2)]).num_blocks == 2  # parents kept
        assert len(client._parents) == 0
    finally:
        client.close()


def test_a_resync_larger_than_the_queue_lands_while_the_engine_keeps_publishing():
    # 16,000 cached blocks against a queue bound of 8,192 ops, and a step every 5 ms caching
    # one more block. The resync's queued batches once counted against the bound, so each
    # step's batch was dropped as "queue full" while they waited; each drop restarted the
    # resync, which cleared the node's entries again: it stayed listed with 4,095 blocks.
    num_blocks, max_queued_ops = 16_000, 8_192
    index = _ScriptedIndex(delay_s=0.02)  # a round trip with a server script
    pool: dict[bytes, int] = {}  # the node's cached set: block hash -> block id
    client = pool_client(index, pool, ttl_s=5.0, max_queued_ops=max_queued_ops)

    def cache(first: int, count: int) -> None:  # an engine step caching blocks first..+count
        hashes = [_chain_hash(i) for i in range(first, first + count)]
        pool.update((h, first + 1 + k) for k, h in enumerate(hashes))
        client.publish([BlockStored(
            block_hashes=hashes, parent_block_hash=_chain_hash(first - 1) if first else None,
            token_ids=[], block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=0,
            block_ids=[first + 1 + k for k in range(count)])])

    try:
        for first in range(0, num_blocks, 4000):
            cache(first, 4000)
            assert client.flush(10)
        index.fail_next = True  # (1) one batch lost: resync mode
        cache(num_blocks, 1)
        assert client.flush(5) and client.resync_pending
        nxt = num_blocks + 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and client.resync_pending:  # (2) steps go on
            cache(nxt, 1)
            nxt += 1
            time.sleep(0.005)
        assert not client.resync_pending and client.stats.publish_batches_dropped_full == 0
        assert client.flush(5)
        assert _keys(index, "A") == {(0, h[:NAMESPACE.key_hash_bytes], b) for h, b in pool.items()}
    finally:
        client.close()


def test_a_resyncs_calls_keep_their_size_and_it_stays_pending_until_the_last_lands():
    index = _ScriptedIndex()
    index.hold_when = lambda calls: len(calls) == 2 and calls[0][1]  # the set's second call
    pool: dict[bytes, int] = {}
    client = pool_client(index, pool, ttl_s=5.0)
    hashes = [_chain_hash(i) for i in range(3000)]
    try:
        pool.update((h, i + 1) for i, h in enumerate(hashes))
        index.fail_next = True  # (1) the node caches 3,000 blocks; the batch is lost
        client.publish([BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                    block_size=BLOCK_SIZE, lora_name=None, medium=None,
                                    group_id=0, block_ids=list(range(1, 3001)))])
        index.calls.clear()
        deadline = time.monotonic() + 5
        while not index.held.is_set() and time.monotonic() < deadline:
            client.publish([])  # (2) steps: the resync's set is read when asked
            time.sleep(0.01)
        # (3) Its first call landed, the second is in the backend: not done yet.
        assert index.held.is_set() and client.resync_pending
        assert len(_keys(index, "A")) == 1023  # the clear and 1,023 stores
        index.release.set()
        assert client.flush(5) and not client.resync_pending
        # A clear plus 3,000 stores in calls of at most 1,024 ops, the first one the resync.
        assert index.calls == [(1024, True), (1024, False), (953, False)]
        assert len(_keys(index, "A")) == 3000
    finally:
        index.release.set()
        client.close()


def _wait_for(done: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_an_unanswered_call_is_made_again_the_same_ahead_of_later_batches_without_a_step():
    """A publish call that goes unanswered (Redis past its socket timeout: CI saw it on a
    loaded host) is made again as the same call, with its batch numbers, once the backend
    answers; the batches published meanwhile follow it, in order. No resync: that would wait
    for an engine step to read the cached set, and an engine idle by then stays unlisted."""
    index = _ScriptedIndex()
    snapshots: list[int] = []
    client = IndexClient(index, InMemoryNodeDirectory(), node_id="A", incarnation=1,
                         group_ids=(0,), ttl_s=5.0)
    client.set_resync_source(lambda: snapshots.append(1) or [])
    client.start("127.0.0.1", 1)
    try:
        index.unanswered = 3  # (1) the call that stores block 1, and its next two tries
        client.publish([_stored(1, 1)])
        _wait_for(lambda: index.seqs, "the first call was never made")
        # (2) Meanwhile the engine caches block 2, then evicts it: both wait behind the call.
        client.publish([_stored(2, 2, parent=1)])
        client.publish([_removed(2, 2)])
        assert client.flush(5)
        assert index.seqs[:4] == [(1, 1)] * 4
        assert index.seqs[4:] in ([(2, 3)], [(2, 2), (3, 3)])
        assert _keys(index, "A") == {(0, _hash(1)[:8], 1)}
        assert snapshots == [] and client.num_resyncs == 0 and not client.resync_pending
    finally:
        client.close()


def test_a_call_unanswered_past_the_hold_limit_is_lost_and_repaired_by_a_resync(monkeypatch):
    """A backend down, not slow: the held call is given up once its first try is
    ``_MAX_HOLD_S`` old (on a cluster one dead shard would otherwise hold every call of the
    node), and the node resyncs its whole cached set once the backend answers."""
    monkeypatch.setattr(worker_module, "_MAX_HOLD_S", 0.3)
    index = _ScriptedIndex()
    pool: dict[bytes, int] = {}
    client = pool_client(index, pool, ttl_s=5.0)
    try:
        index.unanswered = 10**9
        pool[_hash(1)] = 1
        client.publish([_stored(1, 1)])
        _wait_for(lambda: client.resync_pending, "the held call was never given up")
        assert len(index.seqs) >= 2 and set(index.seqs) == {(1, 1)}  # made again, then lost
        index.unanswered = 0  # (the backend answers again)
        pool[_hash(2)] = 2
        client.publish([_stored(2, 2, parent=1)])
        deadline = time.monotonic() + 5
        while client.resync_pending or not client.flush(0.1):
            assert time.monotonic() < deadline, "the resync never landed"
            client.publish([])  # engine steps: the resync's set is read when asked
            time.sleep(0.01)
        assert _keys(index, "A") == {(0, _hash(i)[:8], i) for i in (1, 2)}
        assert client.num_resyncs == 1
    finally:
        client.close()


def test_a_held_call_is_made_again_only_after_a_heartbeat_is_answered(monkeypatch):
    """Heartbeats unanswered (on a cluster: one shard down, while lookups in the others are
    answered, so "the backend answers" cannot be read off the last call): a held call gets no
    second try until a heartbeat is answered; when the hold runs out it is made once more and
    then counted lost (not sent every probe for 3 s: the review found 60 tries)."""
    monkeypatch.setattr(worker_module, "_MAX_HOLD_S", 0.5)
    index = _ScriptedIndex()
    client = IndexClient(index, InMemoryNodeDirectory(), node_id="A", incarnation=1,
                         group_ids=(0,), ttl_s=5.0)
    client.set_resync_source(lambda: [])
    client.start("127.0.0.1", 1)
    try:
        index.unanswered, index.heartbeat_answer = 10**9, "unavailable"
        client.publish([_stored(1, 1)])
        _wait_for(lambda: client.resync_pending, "the held call was never given up")
        assert index.seqs == [(1, 1), (1, 1)]
    finally:
        client.close()


@pytest.mark.parametrize("outage_first", [False, True])
def test_a_fenced_heartbeat_warns_unless_an_outage_said_so(outage_first, caplog):
    """A heartbeat fenced with no outage before it (a pause past the TTL, Redis flushed or
    restarted between two heartbeats) says in one WARNING that the node resyncs; after an
    unanswered heartbeat the outage's own line said it already (one line per outage)."""
    caplog.set_level(logging.WARNING, logger="kvbridge")
    index = _ScriptedIndex()
    client = IndexClient(index, InMemoryNodeDirectory(), node_id="A", incarnation=1,
                         group_ids=(0,), ttl_s=0.3)  # a heartbeat every 0.1 s
    client.set_resync_source(lambda: [])
    client.start("127.0.0.1", 1)
    try:
        if outage_first:
            index.heartbeat_answer = "unavailable"
            _wait_for(lambda: index.num_heartbeats_unanswered > 0, "no heartbeat went unanswered")
        index.heartbeat_answer = "fenced"
        _wait_for(lambda: client.resync_pending, "the fenced heartbeat started no resync")
        warned = [r for r in caplog.records if "may be lost" in r.getMessage()]
        assert len(warned) == (0 if outage_first else 1)
    finally:
        client.close()
