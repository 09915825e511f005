"""Block index: both backends behave the same (docs/architecture.md, "The block index"; issue 6
parts 1-3, 5).

Redis cases run against a real ``redis-server`` started by ``tests/_redis_fixture.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from _identity_builders import BASE_IDENTITY, IDENTITY_FIELDS, OTHER_VALUE, one_field_apart
from kvbridge.connector.block_events import with_removals_of
from kvbridge.connector.index import (
    NO_HIT,
    BlockIndex,
    IndexNamespace,
    InMemoryBlockIndex,
    PrefixHit,
    RedisBlockIndex,
    open_index,
)
from kvbridge.connector.index.node_directory import NodeAddress, RedisNodeDirectory
from kvbridge.connector.index.redis_direct import HeldConnections
from kvbridge.connector.index.redis_scripts import LOOKUP_SAMPLE_HOLDERS
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.transport import BlockIdentity

_NS = IndexNamespace(identity=BASE_IDENTITY)
_TTL_S = 30.0


def _hashes(num_blocks: int, *, prompt: str = "p") -> list[bytes]:
    """A chain of distinct 32-byte block hashes (stand-ins for a prompt's block hashes)."""
    return [hashlib.sha256(f"{prompt}/{i}".encode()).digest() for i in range(num_blocks)]


def _stored(
    block_hashes: list[bytes], *, first_block_id: int = 1, group_id: int = 0,
    medium: str | None = None, parent_block_hash: bytes | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=[],
        block_size=_NS.block_size,
        lora_name=None,
        medium=medium,
        group_id=group_id,
        block_ids=list(range(first_block_id, first_block_id + len(block_hashes))),
    )


def _removed(block_hashes: list[bytes], *, group_id: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=None, group_id=group_id, block_ids=[])


def _make_index(kind: str, request: pytest.FixtureRequest, namespace: IndexNamespace) -> BlockIndex:
    if kind == "memory":
        return InMemoryBlockIndex(namespace)
    url = request.getfixturevalue("redis_url")
    return RedisBlockIndex(namespace, url, retry_interval_s=0.0)


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[BlockIndex]:
    idx = _make_index(request.param, request, _NS)
    yield idx
    idx.close()


def _runs(hit: PrefixHit) -> list[tuple[str, int]]:
    return [(h.node_id, h.num_blocks) for h in hit.holders]


def test_stored_adds_and_removed_removes(index: BlockIndex) -> None:
    prompt = _hashes(10)
    assert index.register_node("A", 1, ttl_s=_TTL_S) == "ok"
    assert index.publish("A", 1, [_stored(prompt[:8], first_block_id=5)]).status == "ok"
    hit = index.longest_prefix(prompt)
    # A stored blocks 0..7 in block ids 5..12.
    assert hit.num_blocks == 8
    assert index.get_block_ids("A", 1, prompt[:8]) == [list(range(5, 13))]
    assert hit.holders[0].tier == "device"
    # Evicting block 7 (the tail, as LRU does) shortens the run to 7; evicting block 3 cuts it
    # to 3, because a run must be contiguous from block 0.
    index.publish("A", 1, [_removed([prompt[7]])])
    assert index.longest_prefix(prompt).num_blocks == 7
    index.publish("A", 1, [_removed([prompt[3]])])
    assert _runs(index.longest_prefix(prompt)) == [("A", 3)]
    # Storing block 3 again closes the hole: blocks 4..6 were held all along.
    index.publish("A", 1, [_stored([prompt[3]], first_block_id=40)])
    assert _runs(index.longest_prefix(prompt)) == [("A", 7)]
    assert index.stats.publishes == 4 and index.stats.publish_ops == 11


def test_a_failed_loads_blocks_removed_after_their_store_leave_the_chain_after_them_findable(
        index: BlockIndex) -> None:
    # A step cached blocks 0..9 of a prompt in one chain; the loads of blocks 4..6 failed. Its
    # publish ends with their removal (``with_removals_of``), so once 4..6 are cached again the
    # whole chain is found. (Cutting them out of the chain instead left 7..9 stored under a
    # parent never stored: on Redis such blocks never join a run, even after 4..6 return.)
    prompt = _hashes(10)
    index.register_node("A", 1, ttl_s=_TTL_S)
    step = [_stored(prompt, first_block_id=11)]  # block ids 11..20
    failed = [15, 16, 17]
    assert index.publish("A", 1, with_removals_of(step, failed)).status == "ok"
    assert _runs(index.longest_prefix(prompt)) == [("A", 4)]
    index.publish("A", 1, [_stored(prompt[4:7], first_block_id=40, parent_block_hash=prompt[3])])
    assert _runs(index.longest_prefix(prompt)) == [("A", 10)]
    assert index.get_block_ids("A", 1, prompt) == [[11, 12, 13, 14, 40, 41, 42, 18, 19, 20]]


def test_block_stored_without_its_parent_does_not_extend_a_run(index: BlockIndex) -> None:
    prompt = _hashes(4)
    index.register_node("A", 1, ttl_s=_TTL_S)
    orphan = _stored([prompt[3]], first_block_id=9, parent_block_hash=prompt[2])
    index.publish("A", 1, [_stored(prompt[:1]), orphan])
    # A holds blocks 0 and 3, not 1 and 2: the run is 1, even for the prompt ending on block 3.
    assert _runs(index.longest_prefix(prompt)) == [("A", 1)]
    assert _runs(index.longest_prefix(prompt, all_holders=True)) == [("A", 1)]


def test_cleared_drops_only_that_nodes_entries(index: BlockIndex) -> None:
    prompt = _hashes(6)
    for node_id in ("A", "B"):
        index.register_node(node_id, 1, ttl_s=_TTL_S)
        index.publish(node_id, 1, [_stored(prompt)])
    index.publish("A", 1, [AllBlocksCleared(medium=None)])
    assert _runs(index.longest_prefix(prompt)) == [("B", 6)]


def test_restart_drops_old_entries_and_fences_the_old_incarnation(index: BlockIndex) -> None:
    prompt = _hashes(12)
    index.register_node("A", 100, ttl_s=_TTL_S)
    index.publish("A", 100, [_stored(prompt)])
    # (1) A restarts as incarnation 101: every entry of 100 is gone at once.
    assert index.register_node("A", 101, ttl_s=_TTL_S) == "ok"
    assert index.longest_prefix(prompt) == NO_HIT
    # (2) A zombie of incarnation 100 keeps publishing and heart-beating: refused.
    assert index.publish("A", 100, [_stored(prompt)]).status == "fenced"
    assert index.heartbeat("A", 100, ttl_s=_TTL_S) == "fenced"
    assert index.register_node("A", 100, ttl_s=_TTL_S) == "fenced"
    assert index.longest_prefix(prompt) == NO_HIT
    # (3) The new incarnation's entries count.
    index.publish("A", 101, [_stored(prompt[:4])])
    hit = index.longest_prefix(prompt)
    assert (hit.num_blocks, hit.holders[0].incarnation) == (4, 101)
    assert index.stats.publishes_fenced == 1


def test_node_that_stops_heart_beating_expires(index: BlockIndex) -> None:
    prompt = _hashes(5)
    ttl_s = 0.3
    index.register_node("A", 1, ttl_s=ttl_s)
    index.register_node("B", 1, ttl_s=ttl_s)
    index.publish("A", 1, [_stored(prompt)])
    index.publish("B", 1, [_stored(prompt[:2])])
    # Only B heart-beats (with a long TTL); after A's TTL, A's entries are gone, B's stay.
    assert index.heartbeat("B", 1, ttl_s=_TTL_S) == "ok"
    time.sleep(ttl_s + 0.15)
    assert _runs(index.longest_prefix(prompt)) == [("B", 2)]
    # A's late heartbeat is fenced; registering again starts it empty.
    assert index.heartbeat("A", 1, ttl_s=_TTL_S) == "fenced"
    assert index.register_node("A", 1, ttl_s=_TTL_S) == "ok"
    assert _runs(index.longest_prefix(prompt)) == [("B", 2)]


def test_longest_prefix_prefers_the_deepest_holder(index: BlockIndex) -> None:
    prompt = _hashes(80)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.register_node("B", 1, ttl_s=_TTL_S)
    index.register_node("C", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt[:40], first_block_id=1)])
    index.publish("B", 1, [_stored(prompt[:60], first_block_id=200, medium="CPU")])
    hit = index.longest_prefix(prompt)
    # A holds the first 40 blocks, B the first 60: B wins with 60; C holds nothing.
    assert hit.num_blocks == 60
    assert _runs(hit) == [("B", 60)]
    assert hit.best_holder is not None and hit.best_holder.tier == "host"  # medium "CPU"
    assert _runs(index.longest_prefix(prompt, all_holders=True)) == [("B", 60), ("A", 40)]
    assert index.get_block_ids("B", 1, prompt[:60]) == [list(range(200, 260))]
    assert index.get_block_ids("A", 1, prompt[:41]) is None  # A does not hold block 40
    assert index.get_block_ids("B", 2, prompt[:1]) is None  # not B's incarnation
    # Node C asking for remote holders only, excluding B: A's 40; also for a prompt both A and
    # B hold whole.
    assert _runs(index.longest_prefix(prompt, exclude_node_ids=["B"])) == [("A", 40)]
    assert _runs(index.longest_prefix(prompt[:40], exclude_node_ids=["B"])) == [("A", 40)]
    assert index.stats.lookup_hits == 4


def test_equal_runs_report_every_holder_for_the_caller_to_break_ties(index: BlockIndex) -> None:
    prompt = _hashes(20)
    for node_id in ("B", "A", "C"):
        index.register_node(node_id, 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt[:12])])
    index.publish("B", 1, [_stored(prompt[:12])])
    index.publish("C", 1, [_stored(prompt[:11])])
    # A and B tie at 12 (sorted by node id); C's 11 is shorter and left out by default.
    assert _runs(index.longest_prefix(prompt)) == [("A", 12), ("B", 12)]
    # A one-block prompt and a prompt that is exactly the held run.
    assert _runs(index.longest_prefix(prompt[:1])) == [("A", 1), ("B", 1), ("C", 1)]
    assert _runs(index.longest_prefix(prompt[:12])) == [("A", 12), ("B", 12)]


def test_unknown_and_empty_prompts_have_no_hit(index: BlockIndex) -> None:
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(_hashes(4))])
    assert index.longest_prefix(_hashes(4, prompt="other")) == NO_HIT
    assert index.longest_prefix([]) == NO_HIT
    # A prompt whose block 0 differs shares nothing, even if later blocks match.
    assert index.longest_prefix([b"\0" * 32, *_hashes(4)[1:]]) == NO_HIT


def test_every_requested_group_must_be_held(index: BlockIndex) -> None:
    prompt = _hashes(10)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt, group_id=0), _stored(prompt[:6], group_id=1)])
    # Group 0 holds 10 blocks, group 1 only 6: the run for both is 6.
    hit = index.longest_prefix(prompt, group_ids=(0, 1))
    assert hit.num_blocks == 6
    # Both groups' blocks were stored in block ids 1..: group 0 from 1, group 1 from 1.
    assert index.get_block_ids("A", 1, prompt[:6], (0, 1)) == [[1, 2, 3, 4, 5, 6]] * 2
    assert index.longest_prefix(prompt, group_ids=(0,)).num_blocks == 10
    assert index.longest_prefix(prompt, group_ids=(2,)) == NO_HIT


def test_bad_arguments_raise_value_error(index: BlockIndex) -> None:
    with pytest.raises(ValueError):
        index.longest_prefix([b"\1" * 32, b"\2" * 16])  # mixed hash lengths
    with pytest.raises(ValueError):
        index.longest_prefix(_hashes(2), group_ids=())
    with pytest.raises(ValueError):
        index.register_node("a:b", 1, ttl_s=_TTL_S)


def _open_shared(kind: str, request: pytest.FixtureRequest, identity: BlockIdentity) -> BlockIndex:
    """The index a node of ``identity`` opens: ``open_index`` shares one in-process backend per
    namespace ("memory"); Redis keeps every namespace's keys on the one server."""
    if kind == "memory":
        return open_index("memory", IndexNamespace(identity=identity))[0]
    return _make_index(kind, request, IndexNamespace(identity=identity))


def test_every_identity_field_has_a_case() -> None:
    # A field added to BlockIdentity needs another value here, or no test below covers it.
    assert set(OTHER_VALUE) == set(IDENTITY_FIELDS)


@pytest.mark.parametrize("field", IDENTITY_FIELDS)
@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_nodes_one_identity_field_apart_never_see_each_others_blocks(
    kind: str, field: str, request: pytest.FixtureRequest
) -> None:
    # Issue 28 item 7: two nodes that differ in the KV cache dtype alone (or the model revision,
    # the KV layout, ...) hold blocks whose bytes differ under one block hash; the index must
    # never name one to the other. Before, the namespace held the model, block size and hash
    # function only: the dtype, revision and layout cases found the writer's 8 blocks.
    base = dataclasses.replace(BASE_IDENTITY, model_name=f"ns-{uuid.uuid4().hex[:8]}")
    other = one_field_apart(field, base)
    assert IndexNamespace(identity=base).key_prefix != IndexNamespace(identity=other).key_prefix
    prompt = _hashes(8)
    writer, reader = _open_shared(kind, request, base), _open_shared(kind, request, other)
    writer.register_node("A", 1, ttl_s=_TTL_S)
    writer.publish("A", 1, [_stored(prompt)])
    reader.register_node("B", 1, ttl_s=_TTL_S)
    reader.publish("B", 1, [_stored(prompt[:3])])
    assert _runs(writer.longest_prefix(prompt)) == [("A", 8)]  # B's 3 blocks are not here
    assert _runs(reader.longest_prefix(prompt)) == [("B", 3)]  # nor A's 8 there
    # The same identity again (another node's view of it) shares the writer's entries.
    twin = _open_shared(kind, request, dataclasses.replace(base))
    assert _runs(twin.longest_prefix(prompt)) == [("A", 8)]


def test_the_key_prefix_keeps_the_model_readable_and_short() -> None:
    identity = dataclasses.replace(
        BASE_IDENTITY, model_name="org/Model:v1 {x}", kv_layout="vllm:" + "x" * 300
    )
    prefix = IndexNamespace(identity=identity).key_prefix
    # The model %-quoted (no ':' or '{}' inside a segment: Redis Cluster hash tags wrap the
    # prefix), then 16 hex digits of the identity's digest, whatever the other fields' length.
    assert prefix == f"kvbridge:bi:org%2FModel%3Av1%20%7Bx%7D:{identity.digest[:16]}:k8"


def check_keys_of_another_type_are_garbage_not_an_outage(index: RedisBlockIndex, raw) -> None:
    """Keys of another type in the namespace (not written by kvbridge; ``raw`` writes them): an
    entry key that is a string, and the namespace's incarnation record. Registration, publish
    (store, remove, clear) and the holder's block-id read go on without them, counted as
    garbage: no script error, no back-off, the index stays available. (Before, the scripts
    raised WRONGTYPE: the node took Redis for down, backed off every lookup for a second, and a
    publish meeting the key failed whole, every time, so the node was never listed.)"""
    k = index.namespace.key_hash_bytes
    prompt = _hashes(10, prompt="foreign")
    prefix = index._prompt_prefix(prompt[0][:k])
    raw.set(f"{prefix}:e:0:".encode() + prompt[5][:k], b"not a hash")
    raw.set(f"{prefix}:maxinc", b"not a hash")
    assert index.register_node("A", 7, ttl_s=_TTL_S) == "ok"
    assert index.publish("A", 7, [_stored(prompt)]).status == "ok"
    assert index.stats.garbage_entries == 1
    assert _runs(index.longest_prefix(prompt)) == [("A", 5)]  # the run stops at block 5
    assert index.get_block_ids("A", 7, prompt[:5]) == [[1, 2, 3, 4, 5]]
    assert index.get_block_ids("A", 7, prompt[:6]) is None  # block 5: not held
    assert index.publish("A", 7, [_removed(prompt[3:])]).status == "ok"
    assert _runs(index.longest_prefix(prompt)) == [("A", 3)]
    assert index.publish("A", 7, [AllBlocksCleared(medium=None)]).status == "ok"
    assert index.longest_prefix(prompt).num_blocks == 0
    assert index.register_node("A", 8, ttl_s=_TTL_S) == "ok"  # a new incarnation, too
    assert (index.stats.errors_by_kind, index.stats.publishes_dropped) == ({}, 0)
    assert index.available


def test_keys_of_another_type_are_garbage_not_an_outage(redis_url: str, caplog) -> None:
    index = RedisBlockIndex(_NS, redis_url)
    raw = redis.Redis.from_url(redis_url)
    try:
        check_keys_of_another_type_are_garbage_not_an_outage(index, raw)
        # The node directory: an address key of another type is garbage too, not Redis down.
        directory = RedisNodeDirectory(raw, _NS.key_prefix)
        directory.announce("B", NodeAddress("10.0.0.9", 5555, 7), ttl_s=_TTL_S)
        raw.delete(f"{_NS.key_prefix}:addr:A")
        raw.rpush(f"{_NS.key_prefix}:addr:A", "a list")
        with caplog.at_level(logging.WARNING, logger="kvbridge.connector.index.node_directory"):
            assert directory.lookup("A") is None
        assert "holds a key of another type" in caplog.text
        assert not directory.reachability.down
        assert directory.lookup("B") == NodeAddress("10.0.0.9", 5555, 7)
    finally:
        raw.close()
        index.close()


def test_garbage_entries_are_skipped_and_counted(redis_url: str, caplog) -> None:
    index = RedisBlockIndex(_NS, redis_url)
    prompt = _hashes(10)
    index.register_node("A", 7, ttl_s=_TTL_S)
    index.register_node("B", 7, ttl_s=_TTL_S)
    index.publish("A", 7, [_stored(prompt)])
    index.publish("B", 7, [_stored(prompt[:3])])
    raw = redis.Redis.from_url(redis_url)
    prefix = _NS.key_prefix

    def entry_key(block: int) -> bytes:
        return f"{prefix}:e:0:".encode() + prompt[block][: _NS.key_hash_bytes]

    # (1) A's entry for block 9 is overwritten with a 3-byte value. The lookup probes block 0,
    # then the last block (9): garbage, counted, not held; the binary search ends at 9 blocks.
    raw.hset(entry_key(9), "A", b"bad")
    # (2) Entries of block 0 from node X, whose node record is not an incarnation, and from node
    # Y, whose node record is a list.
    valid_looking = raw.hget(entry_key(0), "A")
    raw.hset(entry_key(0), mapping={"X": valid_looking, "Y": valid_looking})
    raw.set(f"{prefix}:node:X", "not-a-number")
    raw.rpush(f"{prefix}:node:Y", "a list")
    # (3) Keys of another namespace are never read.
    raw.set("kvbridge:bi:other:16:sha256:k8:e:0:x", "junk")
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.index.protocol"):
        hit = index.longest_prefix(prompt, all_holders=True)
        assert _runs(hit) == [("A", 9), ("B", 3)]
        assert index.stats.garbage_entries == 3  # A's bad entry + X + Y
        assert index.stats.lookups_failed == 0
        index.longest_prefix(prompt, all_holders=True)  # met again: counted, not said again
    assert index.stats.garbage_entries > 3
    said = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert said == ["block index: a lookup skipped 3 malformed entries (3 so far; not written by "
                    "this version of kvbridge?) and went on without them"]
    # (4) B's node record now names another incarnation (8) than its entries (7): B's entries
    # are not B's any more. A prompt both held whole (the lookup's fast path) reports A only.
    raw.set(f"{prefix}:node:B", f"{8:020d}")
    assert _runs(index.longest_prefix(prompt[:3])) == [("A", 3)]


def test_redis_stopped_gives_no_hit_then_recovers(redis_server, redis_url: str, caplog) -> None:
    index = RedisBlockIndex(_NS, redis_url, retry_interval_s=0.0)
    prompt = _hashes(20)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt)])
    assert index.longest_prefix(prompt).num_blocks == 20
    # (1) Redis dies: lookups answer NO_HIT with a warning, publishes are dropped; nothing raises.
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.index.reachability"):
        assert index.longest_prefix(prompt) == NO_HIT
        assert index.longest_prefix(prompt) == NO_HIT
        assert index.publish("A", 1, [_stored(prompt)]).status == "unavailable"
        assert index.heartbeat("A", 1, ttl_s=_TTL_S) == "unavailable"
    assert index.stats.lookups_failed == 2
    assert (index.stats.publishes_dropped, index.stats.publish_ops_dropped) == (1, 20)
    # one line for the outage (not one per call), naming the URL it tried
    assert [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()] == [
        caplog.records[0].getMessage()] and redis_url in caplog.records[0].getMessage()
    # (2) Redis is back (empty: it kept nothing): the node is fenced until it registers again,
    # then the index works as before.
    redis_server.start()
    assert index.publish("A", 1, [_stored(prompt)]).status == "fenced"
    assert index.register_node("A", 1, ttl_s=_TTL_S) == "ok"
    assert index.publish("A", 1, [_stored(prompt[:5])]).status == "ok"
    assert index.longest_prefix(prompt).num_blocks == 5
    assert index.stats.reconnects == 1


def test_redis_back_off_skips_calls_until_the_interval_passes(redis_server, redis_url) -> None:
    now = [0.0]
    index = RedisBlockIndex(_NS, redis_url, retry_interval_s=5.0, clock=lambda: now[0])
    prompt = _hashes(3)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt)])
    redis_server.stop()
    assert index.longest_prefix(prompt) == NO_HIT  # tried, failed: down until t = 5 s
    redis_server.start()
    now[0] = 4.9
    # Inside the back-off window nothing is tried, even though Redis is back.
    assert index.register_node("A", 1, ttl_s=_TTL_S) == "unavailable"
    assert index.longest_prefix(prompt) == NO_HIT
    assert index.stats.lookups_failed == 2
    now[0] = 5.0
    assert index.register_node("A", 1, ttl_s=_TTL_S) == "ok"
    index.publish("A", 1, [_stored(prompt)])
    assert index.longest_prefix(prompt).num_blocks == 3
    assert index.stats.reconnects == 1


def test_redis_runs_match_the_in_memory_reference_under_random_churn(redis_url: str) -> None:
    """Random stores (parent held, as a BlockPool caches), removals anywhere (holes in chains),
    re-stores, duplicates and clears on two nodes and two groups: the Redis lookup (O(log N)
    probes plus holes) must give exactly the in-memory linear scan's runs."""
    import random

    rng = random.Random(6)
    reference = InMemoryBlockIndex(_NS)
    index = RedisBlockIndex(_NS, redis_url)
    # Prompts share prefixes: prompt k = a stem of random length, then its own blocks.
    stem = _hashes(40, prompt="stem")
    prompts = [stem[: rng.randrange(0, 40)] + _hashes(30, prompt=f"q{k}") for k in range(6)]
    held: dict[tuple[str, int], set[bytes]] = {}
    for idx in (reference, index):
        for node_id in ("A", "B"):
            idx.register_node(node_id, 1, ttl_s=_TTL_S)
    for step in range(120):
        node_id, group_id = rng.choice("AB"), rng.choice((0, 1))
        node_held = held.setdefault((node_id, group_id), set())
        prompt = rng.choice(prompts)
        roll = rng.random()
        if roll < 0.5:
            # Cache blocks [start, end) of the prompt, start right after a held (or no) parent.
            start = 0
            while start < len(prompt) and prompt[start] in node_held and rng.random() < 0.8:
                start += 1
            end = min(len(prompt), start + rng.randrange(1, 20))
            event = BlockStored(
                block_hashes=prompt[start:end],
                parent_block_hash=prompt[start - 1] if start else None,
                token_ids=[], block_size=16, lora_name=None, medium=None, group_id=group_id,
                block_ids=list(range(step * 100, step * 100 + end - start)),
            )
            node_held.update(prompt[start:end])
        elif roll < 0.97:
            victims = rng.sample(sorted(node_held), min(len(node_held), rng.randrange(1, 6)))
            event = _removed(victims, group_id=group_id)
            node_held.difference_update(victims)
        else:
            event = AllBlocksCleared(medium=None)
            held[(node_id, 0)] = set()
            held[(node_id, 1)] = set()
        for idx in (reference, index):
            assert idx.publish(node_id, 1, [event]).status == "ok"
        # Whole prompts, and prefixes of them cut at random lengths: a prefix often ends on a
        # held block, so the lookup's path for a prompt held whole runs too (holes included).
        probes = prompts + [p[: rng.randrange(1, len(p) + 1)] for p in prompts]
        for probe_prompt in probes:
            for group_ids in ((0,), (1,), (0, 1)):
                for all_holders in (False, True):
                    expected = reference.longest_prefix(probe_prompt, group_ids,
                                                        all_holders=all_holders)
                    got = index.longest_prefix(probe_prompt, group_ids, all_holders=all_holders)
                    assert _runs(got) == _runs(expected), (step, group_ids, all_holders)
    assert index.stats.garbage_entries == 0


def test_hole_records_go_when_the_holes_descendants_go(redis_url: str) -> None:
    index = RedisBlockIndex(_NS, redis_url)
    prompt = _hashes(6)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt)])
    raw = redis.Redis.from_url(redis_url)
    holes_key = f"{_NS.key_prefix}:holes:A:{1:020d}:0"
    # Removing block 2 while 3..5 are held leaves a hole at position 2.
    index.publish("A", 1, [_removed([prompt[2]])])
    assert raw.zrange(holes_key, 0, -1, withscores=True) == [
        (prompt[2][: _NS.key_hash_bytes], 2.0)
    ]
    # Evicting 5, 4, 3 (tail first) releases the hole; then 1, 0: nothing of A is left.
    index.publish("A", 1, [_removed([prompt[5], prompt[4], prompt[3]])])
    assert raw.exists(holes_key) == 0
    index.publish("A", 1, [_removed([prompt[1], prompt[0]])])
    leftover = [k for k in raw.scan_iter(f"{_NS.key_prefix}:*") if b":node:" not in k
                and not k.endswith((b":nodes", b":maxinc", b":aux:A"))]
    assert leftover == []
    assert index.longest_prefix(prompt) == NO_HIT


def test_slow_redis_times_out_to_no_hit_then_recovers(redis_url: str) -> None:
    index = RedisBlockIndex(_NS, redis_url, socket_timeout_s=0.1, retry_interval_s=0.0)
    prompt = _hashes(4)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt)])
    # Another client pauses every command for 0.4 s: the lookup gives up after 0.1 s.
    redis.Redis.from_url(redis_url).execute_command("CLIENT", "PAUSE", 400, "ALL")
    assert index.longest_prefix(prompt) == NO_HIT
    assert index.stats.lookups_failed == 1
    assert index.stats.errors_by_kind == {"TimeoutError": 1}
    time.sleep(0.4)
    assert index.longest_prefix(prompt).num_blocks == 4
    assert index.stats.reconnects == 1


def test_lookups_survive_forgotten_scripts_dropped_connections_and_pinned_clients(
    redis_url: str,
) -> None:
    """The lookups' direct path (``redis_direct``) in the cases it hands to redis-py or meets
    first: the answers are the generic path's, and none of these is Redis trouble."""
    index = RedisBlockIndex(_NS, redis_url, retry_interval_s=0.0)
    prompt = _hashes(8)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt)])
    assert index.longest_prefix(prompt).num_blocks == 8
    admin = redis.Redis.from_url(redis_url)
    # (1) The server forgot its scripts (as after a restart): EVALSHA answers NOSCRIPT, the
    # lookup and the block-id read are sent again as EVAL, once each.
    admin.script_flush()
    admin.config_resetstat()
    assert index.longest_prefix(prompt).num_blocks == 8
    assert index.get_block_ids("A", 1, prompt) == [list(range(1, 9))]
    calls = {name: s["calls"] for name, s in admin.info("commandstats").items()}
    assert (calls["cmdstat_evalsha"], calls["cmdstat_eval"]) == (2, 2)
    # (2) The server dropped the index's connection: the pool finds it closed before sending
    # and connects again.
    admin.client_kill_filter(_type="normal", skipme=True)
    assert index.longest_prefix(prompt).num_blocks == 8
    # (3) A client pinned to one connection (which its pool never hands out): the generic path.
    pinned_client = redis.Redis.from_url(redis_url, single_connection_client=True)
    pinned = RedisBlockIndex(_NS, client=pinned_client)
    assert pinned.longest_prefix(prompt).num_blocks == 8
    assert pinned.get_block_ids("A", 1, prompt) == [list(range(1, 9))]
    for idx in (index, pinned):
        assert idx.stats.errors_by_kind == {} and idx.available
        idx.close()
    admin.close()


def test_a_publish_goes_pre_packed_and_survives_a_forgotten_script(redis_url: str) -> None:
    """A step's publish (five arguments per block) goes as one pre-packed EVALSHA on the calling
    thread's held connection, as the lookups do, not through redis-py's generic packer (its
    per-argument encoding held the GIL on the index worker's thread, which the engine thread
    then waited behind); a server that forgot the script gets it as EVAL, once."""
    index = RedisBlockIndex(_NS, redis_url, retry_interval_s=0.0)
    index.register_node("A", 1, ttl_s=_TTL_S)
    prompt = _hashes(64)
    assert index.publish("A", 1, [_stored(prompt[:1])]).status == "ok"  # the script is known
    generic: list[str] = []
    execute = index._execute
    index._execute = lambda *command: generic.append(command[0]) or execute(*command)
    assert index.publish("A", 1, [_stored(prompt[1:], first_block_id=2,
                                          parent_block_hash=prompt[0])]).status == "ok"
    assert generic == []
    admin = redis.Redis.from_url(redis_url)
    admin.script_flush()
    assert index.publish("A", 1, [_removed(prompt[32:])]).status == "ok"
    assert generic == ["EVAL"]
    assert index.longest_prefix(prompt).num_blocks == 32
    assert index.stats.errors_by_kind == {} and index.available
    index.close()
    admin.close()


def _connections_received(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_connections_received"])


def _held_by_a(index: RedisBlockIndex, num_blocks: int) -> list[bytes]:
    """Node A registered in ``index``, holding a prompt of ``num_blocks`` blocks; the prompt."""
    prompt = _hashes(num_blocks)
    index.register_node("A", 1, ttl_s=_TTL_S)
    index.publish("A", 1, [_stored(prompt)])
    return prompt


def test_lookups_from_many_threads_each_get_their_own_answer(redis_url: str) -> None:
    """Each thread sends its lookups on a connection it holds (``HeldConnections``): threads
    looking up at once never read each other's replies, and 4 threads' 800 lookups open at
    most one connection each."""
    index = RedisBlockIndex(_NS, redis_url, socket_timeout_s=5.0)
    prompts = {n: _hashes(n, prompt=f"t{n}") for n in (3, 5, 8, 13)}
    for n, prompt in prompts.items():
        index.register_node(f"N{n}", 1, ttl_s=_TTL_S)
        index.publish(f"N{n}", 1, [_stored(prompt)])
    admin = redis.Redis.from_url(redis_url)
    wrong: list[tuple[int, object]] = []

    def look_up_many(n: int) -> None:
        for _ in range(200):
            hit = index.longest_prefix(prompts[n])
            if _runs(hit) != [(f"N{n}", n)]:
                wrong.append((n, hit))

    # The first lookup loads the script (a server that lacks it gets EVAL on the generic path,
    # which takes pooled connections: threads doing that at once would open more).
    assert index.longest_prefix(prompts[3]).num_blocks == 3
    before = _connections_received(admin)  # admin is used from this thread only
    threads = [threading.Thread(target=look_up_many, args=(n,)) for n in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert _connections_received(admin) - before <= len(prompts)
    assert index.stats.errors_by_kind == {}
    index.close()
    admin.close()


def test_a_thread_that_ends_gives_its_lookup_connection_back(redis_url: str) -> None:
    index = RedisBlockIndex(_NS, redis_url, socket_timeout_s=5.0)
    prompt = _held_by_a(index, 4)
    admin = redis.Redis.from_url(redis_url)
    before = _connections_received(admin)
    for _ in range(5):  # five threads, one after another, one lookup each
        thread = threading.Thread(target=index.longest_prefix, args=(prompt,))
        thread.start()
        thread.join()
        gc.collect()
    # The first thread's connection went back to the pool when it ended; each later thread took
    # that one (the generic path's publishes share the pool; the first lookup thread may find
    # the publish's connection free as well).
    assert _connections_received(admin) - before <= 1
    index.close()
    admin.close()


def test_interrupt_ends_the_held_connection_and_the_next_lookup_connects_again(
    redis_url: str,
) -> None:
    index = RedisBlockIndex(_NS, redis_url, socket_timeout_s=5.0, retry_interval_s=0.0)
    prompt = _held_by_a(index, 6)
    admin = redis.Redis.from_url(redis_url)
    assert index.longest_prefix(prompt).num_blocks == 6
    before = _connections_received(admin)
    index.interrupt()  # closes every connection of the pool, the held one included
    assert index.longest_prefix(prompt).num_blocks == 6
    assert _connections_received(admin) - before == 1
    assert index.stats.errors_by_kind == {} and index.available
    index.close()
    admin.close()


def test_lookups_torn_by_interrupt_on_another_thread_are_redis_trouble(redis_url: str) -> None:
    # interrupt() closes sockets that lookups on other threads are using; redis-py then fails
    # the call in whatever state it was: ConnectionError mostly, but also AttributeError
    # (``None.sendall``) or TypeError (a closed socket given to ``select``), which escaped
    # ``longest_prefix`` before. Any of them is Redis trouble when an interrupt came meanwhile.
    index = RedisBlockIndex(_NS, redis_url, socket_timeout_s=5.0, retry_interval_s=0.0)
    prompt = _held_by_a(index, 600)  # a long lookup: more time inside the send and the read
    escaped: list[BaseException] = []
    stop = threading.Event()

    def look_up() -> None:
        while not stop.is_set():
            try:
                index.longest_prefix(prompt)
            except BaseException as exc:  # recorded for the assertion below
                escaped.append(exc)

    threads = [threading.Thread(target=look_up) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        index.interrupt()
        time.sleep(0.0005)
    stop.set()
    for thread in threads:
        thread.join()
    assert escaped == []
    assert index.stats.errors_by_kind  # the storm did tear calls (counted, not raised)
    assert index.longest_prefix(prompt).num_blocks == 600  # and the index works on
    index.close()


def test_an_attribute_error_without_an_interrupt_is_a_bug_and_raises(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = RedisBlockIndex(_NS, redis_url, socket_timeout_s=5.0)
    prompt = _held_by_a(index, 4)

    def broken_send(self: HeldConnections, pool: object, packed: bytes) -> None:
        raise AttributeError("a bug in the send path")

    monkeypatch.setattr(HeldConnections, "send", broken_send)
    with pytest.raises(AttributeError, match="a bug in the send path"):
        index.longest_prefix(prompt)
    assert index.stats.errors_by_kind == {}
    index.close()


def test_a_held_connection_marked_for_reconnect_is_replaced(redis_url: str) -> None:
    # redis-py marks the in-use connections of a pool whose node moved (a cluster's
    # maintenance notice) instead of closing them; the pool closes such a connection when it
    # is given back. A held one is never given back, so the lookup closes it itself.
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0)
    pool = client.connection_pool
    if not hasattr(pool, "update_active_connections_for_reconnect"):
        pytest.skip(f"redis-py {redis.__version__} marks no connection for reconnect")
    index = RedisBlockIndex(_NS, client=client)
    prompt = _held_by_a(index, 6)
    admin = redis.Redis.from_url(redis_url)
    assert index.longest_prefix(prompt).num_blocks == 6
    before = _connections_received(admin)
    pool.update_active_connections_for_reconnect()
    assert index.longest_prefix(prompt).num_blocks == 6  # on a new connection
    assert index.longest_prefix(prompt).num_blocks == 6  # and on that one again
    assert _connections_received(admin) - before == 1
    index.close()
    admin.close()


def test_a_lookup_to_an_unreachable_server_waits_one_connect_timeout(
    redis_server, redis_url: str
) -> None:
    # After interrupt() the held connection has no socket. The server's port then drops every
    # SYN (a listener whose accept queue is full): the lookup gives up after one connect
    # timeout, as the pool's hand-out did, not after two (a readiness check that connected,
    # failed, and left the send to connect again).
    index = RedisBlockIndex(_NS, redis_url, socket_timeout_s=0.25, connect_timeout_s=1.0)
    prompt = _held_by_a(index, 8)
    assert index.longest_prefix(prompt).num_blocks == 8
    index.interrupt()
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    redis_server.stop()
    hole = socket.socket()
    hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hole.bind(("127.0.0.1", port))
    hole.listen(0)
    fillers = []
    for _ in range(4):  # fill the accept queue; later SYNs are dropped
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.2)
    try:
        start = time.monotonic()
        assert index.longest_prefix(prompt) == NO_HIT
        waited_s = time.monotonic() - start
    finally:
        for sock in (*fillers, hole):
            sock.close()
    assert index.stats.errors_by_kind == {"TimeoutError": 1}
    assert waited_s < 1.7, f"one lookup waited {waited_s:.2f} s (connect timeout 1.0 s)"
    index.close()


def test_a_packed_lookup_is_the_command_redis_py_would_send() -> None:
    from kvbridge.connector.index.redis_direct import ScriptHead
    from redis.connection import Connection

    args = ("kvbridge:bi:m:16:sha256:k8", 8, bytes(range(256)) * 20, b"", "node-é", 0, -3, 2**40)
    sha = "ab" * 20
    connection = Connection()  # not connected: only its packer is used
    for route in (None, "{p:b1.0}"):
        head = ["EVALSHA", sha, 0] if route is None else ["EVALSHA", sha, 1, route]
        assert ScriptHead(sha, route).pack(args) == b"".join(connection.pack_command(*head, *args))
    # Anything redis-py would write some other way is refused, not guessed.
    for bad in (True, 1.5, None):
        with pytest.raises(TypeError):
            ScriptHead(sha, None).pack((bad,))


def test_a_deepest_run_lookup_reads_a_bounded_sample_of_a_popular_blocks_holders(
    redis_url: str,
) -> None:
    """Twelve nodes hold the same prompt whole (a shared system prompt): a lookup for the deepest
    run reads at most ``LOOKUP_SAMPLE_HOLDERS`` of each block's holders, so its cost and its
    answer stay the same size however many nodes hold it; every holder it names is a real one
    with the whole run. A lookup of every holder still reads them all."""
    index = RedisBlockIndex(_NS, redis_url, retry_interval_s=0.0)
    try:
        prompt = _hashes(5, prompt="system")
        nodes = [f"n{i:02d}" for i in range(12)]
        for node_id in nodes:
            index.register_node(node_id, 1, ttl_s=_TTL_S)
            index.publish(node_id, 1, [_stored(prompt)])
        for _ in range(5):  # random samples: each must hold
            runs = _runs(index.longest_prefix(prompt))
            assert 1 <= len(runs) <= LOOKUP_SAMPLE_HOLDERS < len(nodes)
            assert len({node for node, _ in runs}) == len(runs)
            assert all(node in nodes and num_blocks == 5 for node, num_blocks in runs)
            # a prompt that goes on past the shared part: the deepest run is still found
            runs = _runs(index.longest_prefix(prompt + _hashes(3, prompt="user")))
            assert 1 <= len(runs) <= LOOKUP_SAMPLE_HOLDERS
            assert all(num_blocks == 5 for _, num_blocks in runs)
        assert sorted(_runs(index.longest_prefix(prompt, all_holders=True))) == [
            (node, 5) for node in nodes
        ]
    finally:
        index.close()
