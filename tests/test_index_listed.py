"""An idle node is listed again after Redis comes back empty, with no engine step: its index
worker resyncs from what it followed of the node's batches (``connector/index/listed.py``).

Before, the set came only from the engine thread at its next step, so an engine that went idle
before Redis came back stayed unlisted and other engines recomputed its prefixes."""

from __future__ import annotations

import random
import time

import pytest
from _pd_builders import assert_node_empty, long_prompt
from kvbridge.connector.index import InMemoryBlockIndex, ListedSet
from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored
from test_index_events import (
    BLOCK_SIZE,
    NAMESPACE,
    _hash,
    _keys,
    _ScriptedIndex,
    _stored,
    client_of,
    node,  # noqa: F401  (a fixture)
    pool_client,
    pool_entries,
    serve,
)


def _random_events(rng: random.Random, num_events: int) -> list:
    """Stores (chains of 1-4 hashes, two groups, a store medium now and then), removals (with
    the right block id, a wrong one, or none) and now and then a clear."""
    events: list = []
    for _ in range(num_events):
        roll = rng.random()
        group_id = rng.randrange(2)
        medium = "cpu" if rng.random() < 0.1 else None
        if roll < 0.55:
            hashes = [_hash(rng.randrange(40)) for _ in range(rng.randint(1, 4))]
            parent = _hash(rng.randrange(40)) if rng.random() < 0.7 else None
            events.append(BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=[],
                block_size=BLOCK_SIZE, lora_name=None, medium=medium, group_id=group_id,
                block_ids=[rng.randrange(1, 9) for _ in hashes]))
        elif roll < 0.97:
            hashes = [_hash(rng.randrange(40)) for _ in range(rng.randint(1, 3))]
            ids = [] if rng.random() < 0.2 else [rng.randrange(1, 9) for _ in hashes]
            events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_id=group_id,
                                       block_ids=ids))
        else:
            events.append(AllBlocksCleared(medium=None))
    return events


@pytest.mark.parametrize("seed", range(8))
def test_the_listed_set_s_resync_makes_the_index_say_what_the_node_s_batches_said(seed):
    """The same events as batches to one index and followed in a ``ListedSet``, whose resync
    goes to a second index: both say the same of the node (its entries with their tiers; the
    in-memory index applies ops as Redis does)."""
    rng = random.Random(seed)
    incremental, resynced = InMemoryBlockIndex(NAMESPACE), InMemoryBlockIndex(NAMESPACE)
    for index in (incremental, resynced):
        index.register_node("A", 1, ttl_s=60.0)
    listed = ListedSet("device", BLOCK_SIZE)
    batches = [_random_events(rng, rng.randint(1, 6)) for _ in range(40)]
    # Last, one hash in both groups, on the host tier in one (the resync names each entry's
    # tier: a medium per hash would put both on one tier).
    batches.append([_stored(50, 3), BlockStored(
        block_hashes=[_hash(50)], parent_block_hash=None, token_ids=[], block_size=BLOCK_SIZE,
        lora_name=None, medium="cpu", group_id=1, block_ids=[4])])
    for seq, batch in enumerate(batches, start=1):
        assert incremental.publish("A", 1, batch, seq=(seq, seq)).status == "ok"
        listed.follow(batch)
    assert listed.exact_at(0)
    assert resynced.publish("A", 1, listed.resync_events(), seq=(1, 1), resync=True).status == "ok"
    def entries(index: InMemoryBlockIndex) -> dict:  # group -> key -> (block id, tier)
        return {group: held for group, held in index._live_node("A").group_to_entries.items()
                if held}

    assert entries(resynced) == entries(incremental)
    assert len(listed) == len(incremental.node_entries("A"))
    assert {tier for held in entries(resynced).values() for _, tier in held.values()} == {
        "device", "host"}  # (the check sees tiers)


def test_the_listed_set_s_resync_names_each_block_s_parent_before_it():
    """A chain stored as one event: the resync has each hash's parent, parents first (the Redis
    index extends a run only from a parent it already holds)."""
    listed = ListedSet("device", BLOCK_SIZE)
    listed.follow([BlockStored(block_hashes=[_hash(3), _hash(4)], parent_block_hash=_hash(2),
                               token_ids=[], block_size=BLOCK_SIZE, lora_name=None,
                               medium=None, group_id=0, block_ids=[7, 8]),
                   _stored(2, 5, parent=1), _stored(1, 4)])
    events = listed.resync_events()
    assert isinstance(events[0], AllBlocksCleared)
    order = [(e.block_hashes[0], e.parent_block_hash, e.block_ids[0]) for e in events[1:]]
    assert order == [(_hash(1), None, 4), (_hash(2), _hash(1), 5), (_hash(3), _hash(2), 7),
                     (_hash(4), _hash(3), 8)]


def test_an_event_the_backend_would_refuse_or_a_lost_batch_leaves_the_listed_set_inexact():
    listed = ListedSet("device", BLOCK_SIZE)
    listed.follow([BlockStored(block_hashes=[_hash(1), _hash(2)], parent_block_hash=None,
                               token_ids=[], block_size=BLOCK_SIZE, lora_name=None,
                               medium=None, group_id=0, block_ids=[1])])
    assert not listed.exact_at(0)
    listed.follow([_stored(1, 1)], whole_set_losses=0)  # a caller's whole set
    assert listed.exact_at(0)
    assert not listed.exact_at(1)  # a batch dropped since that set was read
    listed.follow([_stored(1, 1)], whole_set_losses=1)  # the next set, read after the drop
    assert listed.exact_at(1)


def _wait_for(done, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_an_idle_node_is_listed_again_after_redis_restarts_empty(node, redis_server):  # noqa: F811
    a = node("node-a", num_blocks=72)
    client = client_of(a)
    index = client.index
    prompt = long_prompt(30 * BLOCK_SIZE + 3)
    serve(a, "r", prompt)
    assert client.flush()
    cached = pool_entries(a)
    assert index.node_entries("node-a") == cached and len(cached) == 30
    redis_server.stop()
    redis_server.start()  # empty: the registration and every entry are gone
    # Nothing steps the node from here: its heartbeat is fenced, it registers again, and its
    # index thread publishes what it had listed (``_IDLE_RESYNC_S`` after the backend answered).
    _wait_for(lambda: index.node_entries("node-a") == cached, "the idle node stayed unlisted")
    assert client.num_resyncs == 1 and not client.resync_pending
    assert_node_empty(a)


def test_after_a_dropped_batch_the_idle_resync_waits_for_the_caller_s_set(monkeypatch):
    """A batch a full queue dropped never reached the worker: its listed set is wrong, so the
    worker waits for the caller's set (read at the next step) as before, and follows that set,
    which makes its listed set right again for the next outage."""
    from kvbridge.connector.index import worker as worker_module

    monkeypatch.setattr(worker_module, "_IDLE_RESYNC_S", 0.2)
    index = _ScriptedIndex()
    index.hold_when = lambda calls: True  # the first call waits for ``release``
    pool: dict[bytes, int] = {}
    client = pool_client(index, pool, ttl_s=0.6, max_queued_ops=1)
    try:
        pool[_hash(1)] = 1
        client.publish([_stored(1, 1)])
        assert index.held.wait(5)  # in the backend; the queue (1 op) takes the next batch
        pool[_hash(2)] = 2
        client.publish([_stored(2, 2, parent=1)])
        pool[_hash(3)] = 3
        client.publish([_stored(3, 3, parent=2)])  # dropped: the queue is full
        assert client.stats.publish_batches_dropped_full == 1
        index.release.set()
        _wait_for(lambda: client._worker.resync_wanted, "no resync was asked for")
        time.sleep(0.6)  # three idle deadlines: the worker must not resync from its set
        assert client.num_resyncs == 0  # (batch 2, queued, was skipped in resync mode)
        assert _keys(index, "A") == {(0, _hash(1)[:8], 1)}
        client.publish([])  # a step: the caller's set
        _wait_for(lambda: client.num_resyncs == 1 and client.flush(0.1), "no resync landed")
        assert _keys(index, "A") == {(0, _hash(i)[:8], i) for i in (1, 2, 3)}
        # The next outage (the registration lapses): the node, idle now, is listed again
        # from its index thread, its listed set exact again since it followed that set.
        index.heartbeat_answer = "fenced"
        _wait_for(lambda: client.num_resyncs == 2, "the idle node stayed unlisted")
        assert client.flush(5)
        assert _keys(index, "A") == {(0, _hash(i)[:8], i) for i in (1, 2, 3)}
    finally:
        client.close()


def test_a_caller_that_wakes_while_the_worker_reads_its_listed_set_gives_its_own(monkeypatch):
    """The worker reads the listed set off its lock; the caller steps meanwhile and gives its
    own set (newer): the worker's is dropped, and the node is resynced once, from the
    caller's."""
    from kvbridge.connector.index import worker as worker_module

    monkeypatch.setattr(worker_module, "_IDLE_RESYNC_S", 0.1)
    index = _ScriptedIndex()
    pool: dict[bytes, int] = {_hash(1): 1}
    client = pool_client(index, pool, ttl_s=0.6)
    read = ListedSet.resync_events

    def read_while_the_caller_steps(listed: ListedSet) -> list:
        events = read(listed)
        pool[_hash(2)] = 2  # (the caller's pool moved on: only its own set has block 2)
        client.publish([])  # a step: the caller gives its set
        return events

    try:
        client.publish([_stored(1, 1)])
        assert client.flush(5)
        monkeypatch.setattr(ListedSet, "resync_events", read_while_the_caller_steps)
        index.heartbeat_answer = "fenced"  # the registration lapsed: a resync is owed
        _wait_for(lambda: client.num_resyncs >= 1 and client.flush(0.1), "no resync landed")
        time.sleep(0.3)
        assert client.num_resyncs == 1
        assert _keys(index, "A") == {(0, _hash(i)[:8], i) for i in (1, 2)}
    finally:
        client.close()
