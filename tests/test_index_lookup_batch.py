"""The lookups an engine step starts reach the index together: one round trip for all of them
(docs/vllm-prefix-reuse.md, "Lookup and pull"; issue 31, "Performance": the scheduler step).

``BlockIndex.longest_prefixes`` answers as ``longest_prefix`` of each prompt; on Redis it is one
script call per server (``redis_lookup_many.py``), and ``IndexWorker`` asks it for every lookup
queued when its thread turns. A real ``redis-server`` (``tests/_redis_fixture.py``) logs each
command it runs (``SLOWLOG`` with a threshold of 0), so the round trips are counted at the server.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
import redis
from _identity_builders import BASE_IDENTITY
from kvbridge.connector.index import (
    NO_HIT,
    BlockIndex,
    IndexClient,
    IndexNamespace,
    InMemoryBlockIndex,
    RedisBlockIndex,
    new_incarnation,
)
from kvbridge.connector.index import redis_lookup_many as many
from kvbridge.connector.index.node_directory import NodeAddress, RedisNodeDirectory
from kvbridge.connector.index.redis_held_lookup import GET_BLOCK_IDS_LUA
from kvbridge.connector.index.redis_publish import PUBLISH_LUA
from kvbridge.connector.index.redis_scripts import HEARTBEAT_LUA, REGISTER_LUA
from kvbridge.kvmanager.kv_events import BlockStored

_NS = IndexNamespace(identity=BASE_IDENTITY)
_TTL_S = 30.0


def _hashes(num_blocks: int, *, prompt: str) -> list[bytes]:
    return [hashlib.sha256(f"{prompt}/{i}".encode()).digest() for i in range(num_blocks)]


def _stored(block_hashes: list[bytes], first_block_id: int) -> BlockStored:
    return BlockStored(
        block_hashes=block_hashes, parent_block_hash=None, token_ids=[],
        block_size=_NS.block_size, lora_name=None, medium=None, group_id=0,
        block_ids=list(range(first_block_id, first_block_id + len(block_hashes))),
    )


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[BlockIndex]:
    if request.param == "memory":
        backend: BlockIndex = InMemoryBlockIndex(_NS)
    else:
        backend = RedisBlockIndex(_NS, request.getfixturevalue("redis_url"), retry_interval_s=0.0)
    yield backend
    backend.close()


def _publish_holders(index: BlockIndex) -> dict[str, list[bytes]]:
    """A holds p1 whole and p3's first 3 blocks, B p2's first 5 and p3's first 7."""
    prompts = {name: _hashes(12, prompt=name) for name in ("p1", "p2", "p3", "p4")}
    for node in ("A", "B"):
        assert index.register_node(node, 1, ttl_s=_TTL_S) == "ok"
    assert index.publish("A", 1, [_stored(prompts["p1"], 1), _stored(prompts["p3"][:3], 20)])
    assert index.publish("B", 1, [_stored(prompts["p2"][:5], 1), _stored(prompts["p3"][:7], 9)])
    return prompts


def _runs(hit) -> list[tuple[str, int]]:
    return [(holder.node_id, holder.num_blocks) for holder in hit.holders]


@pytest.mark.parametrize("max_key_bytes", [many.MAX_KEY_BYTES_PER_CALL, 1])
def test_many_prompts_at_once_are_answered_as_each_alone(
    index: BlockIndex, max_key_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_key_bytes 1: every prompt in a call of its own (the cut that bounds a call's size).
    monkeypatch.setattr(many, "MAX_KEY_BYTES_PER_CALL", max_key_bytes)
    prompts = _publish_holders(index)
    asked = [prompts["p1"], prompts["p2"], [], prompts["p3"], prompts["p4"], prompts["p2"][:3]]
    hits = index.longest_prefixes(asked, (0,), exclude_node_ids=("C",))
    assert [_runs(hit) for hit in hits] == [
        [("A", 12)], [("B", 5)], [], [("B", 7)], [], [("B", 3)]]
    assert hits == [index.longest_prefix(hashes, exclude_node_ids=("C",)) for hashes in asked]
    # A node never finds its own blocks: B excluded, p3 is A's 3 blocks.
    hits = index.longest_prefixes([prompts["p3"], prompts["p2"]], (0,), exclude_node_ids=("B",))
    assert [_runs(hit) for hit in hits] == [[("A", 3)], []]
    assert hits[1] == NO_HIT


_NOT_LOOKUPS = {hashlib.sha1(source.encode()).hexdigest().encode()
                for source in (REGISTER_LUA, HEARTBEAT_LUA, PUBLISH_LUA, GET_BLOCK_IDS_LUA)}


def _lookup_calls(server: redis.Redis, since_id: int) -> list[list[bytes]]:
    """The lookup script calls the server ran after log entry ``since_id`` (every script call
    but registers, heartbeats, publishes and a hit's block-id read)."""
    calls = []
    for entry in server.slowlog_get(10000):
        command = entry["command"].split()
        if entry["id"] > since_id and command[0].upper() == b"EVALSHA" \
                and command[1] not in _NOT_LOOKUPS:
            calls.append(command)
    return calls


def test_the_lookups_queued_together_cost_one_round_trip(redis_url: str) -> None:
    server = redis.Redis.from_url(redis_url)
    index = RedisBlockIndex(_NS, redis_url, retry_interval_s=0.0)
    prompts = _publish_holders(index)
    directory = RedisNodeDirectory(redis.Redis.from_url(redis_url), _NS.key_prefix)
    for port, node in enumerate(("A", "B"), start=7001):  # their addresses: a hit is pullable
        directory.announce(node, NodeAddress("127.0.0.1", port, 1), ttl_s=_TTL_S)
    client = IndexClient(index, directory, node_id="C", incarnation=new_incarnation(),
                         group_ids=(0,), ttl_s=_TTL_S, lookup_timeout_s=30.0)
    server.config_set("slowlog-max-len", 10000)
    server.config_set("slowlog-log-slower-than", 0)
    try:
        # 16 requests of one engine step (as in a burst): their lookups are queued before the
        # worker thread turns, as a step's are while the thread waits on Redis.
        asked = {f"req-{i}": _hashes(12, prompt=f"new-{i}") for i in range(14)}
        asked |= {"req-p1": prompts["p1"], "req-p3": prompts["p3"]}
        for key, hashes in asked.items():
            client.start_lookup(key, hashes, num_local_blocks=0, min_gain_blocks=1)
        since_id = max((entry["id"] for entry in server.slowlog_get(1)), default=-1)
        client.start("127.0.0.1", 7003)
        answers = {}
        deadline_s = time.monotonic() + 10.0
        while len(answers) < len(asked) and time.monotonic() < deadline_s:
            for key in asked.keys() - answers.keys():
                result = client.poll_lookup(key)
                if result.done:
                    answers[key] = result
            time.sleep(0.002)
        calls = _lookup_calls(server, since_id)
    finally:
        server.config_set("slowlog-log-slower-than", 10000)
        client.close()
        server.close()
    assert {key: result.status for key, result in answers.items()} == {
        **{f"req-{i}": "no_hit" for i in range(14)}, "req-p1": "hit", "req-p3": "hit"}
    assert (answers["req-p1"].prefix.holder.node_id, answers["req-p1"].prefix.num_blocks) == \
        ("A", 12)
    assert answers["req-p1"].prefix.block_ids == [list(range(1, 13))]
    assert (answers["req-p3"].prefix.holder.node_id, answers["req-p3"].prefix.num_blocks) == \
        ("B", 7)
    # One script call answered all 16 lookups (the register and announce came before it).
    assert len(calls) == 1, f"{len(calls)} lookup calls for 16 lookups"
