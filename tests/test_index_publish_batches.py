"""A publish of many events in one call: the ops' arguments packed in one pass
(``redis_publish.pack_ops``) are the bytes redis-py would write, and the ``PUBLISH``
script's batch-wide shortcuts (a run remembered along a chain, one ``SADD`` of the new entry
keys, hole lookups only where holes may be) leave Redis exactly as one op per call does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

import pytest
import redis
from _identity_builders import BASE_IDENTITY
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbridge.connector.index import IndexNamespace, InMemoryBlockIndex, RedisBlockIndex
from kvbridge.connector.index.protocol import IndexOp, events_to_ops
from kvbridge.connector.index.redis_direct import PackedArgs, ScriptHead
from kvbridge.connector.index.redis_publish import ARGS_PER_OP, pack_ops
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from redis.connection import Connection

_NS = IndexNamespace(identity=BASE_IDENTITY)
_TTL_S = 30.0
_SHA = "cd" * 20
_MEDIA = (None, "cpu", "store")  # tiers device (the default), host, store


def _plain_args(op: IndexOp, key_len: int) -> list[bytes | str | int]:
    """The five ``PUBLISH`` arguments of ``op`` as redis_scripts.py documents them, written out
    here on their own (the reference ``pack_ops`` must agree with)."""
    code = {"device": b"d", "host": b"h", "store": b"s"}[op.tier]
    if op.kind == "S":
        data = op.block_id.to_bytes(4, "big") + code
    elif op.block_id < 0:
        data = code
    else:
        data = code + op.block_id.to_bytes(4, "big")
    return [op.kind, op.group_id, op.block_hash[:key_len], op.parent_hash[:key_len], data]


_ops = st.lists(st.builds(
    IndexOp,
    kind=st.sampled_from("SRC"),
    tier=st.sampled_from(("device", "host", "store")),
    group_id=st.integers(0, 300),
    block_hash=st.binary(max_size=40),
    block_id=st.integers(0, 2**32 - 1),
    parent_hash=st.binary(max_size=40),
), max_size=12).map(lambda ops: [op._replace(block_id=-1) if op.kind == "R" and
                                 op.block_id % 3 == 0 else op for op in ops])


@settings(max_examples=200, deadline=None)
@given(ops=_ops, key_len=st.sampled_from((4, 8, 32)), route=st.sampled_from((None, "{p:b1.0}")))
def test_packed_ops_are_the_command_redis_py_would_send(ops, key_len, route) -> None:
    head_args = ("kvbridge:bi:m", "node-a", "0" * 20, 7, 9, b"0")
    plain = [arg for op in ops for arg in _plain_args(op, key_len)]
    packed = pack_ops(ops, key_len)
    assert packed.count == ARGS_PER_OP * len(ops)
    command = ["EVALSHA", _SHA, 0] if route is None else ["EVALSHA", _SHA, 1, route]
    expected = b"".join(Connection().pack_command(*command, *head_args, *plain))
    assert ScriptHead(_SHA, route).pack(head_args, packed) == expected
    # The generic path reads the same arguments back, as bytes.
    assert packed.unpacked() == [a if isinstance(a, bytes) else str(a).encode() for a in plain]


def test_packed_arguments_that_do_not_parse_are_refused() -> None:
    good = pack_ops([IndexOp("C", "device")], 8)
    for bad in (PackedArgs(good.resp, good.count + 1), PackedArgs(b"x" + good.resp, good.count),
                PackedArgs(good.resp[:-3], good.count), PackedArgs(b"$9\r\nab\r\n", 1)):
        with pytest.raises(ValueError, match="packed arguments"):
            bad.unpacked()


def test_an_op_that_cannot_be_written_raises_before_anything_is_sent() -> None:
    for op, error in ((IndexOp("S", "device", 0, b"h", -1), OverflowError),
                      (IndexOp("S", "device", 0, b"h", 2**32), OverflowError),
                      (IndexOp("S", "disk", 0, b"h", 1), KeyError),  # type: ignore[arg-type]
                      (IndexOp("X", "device"), KeyError)):  # type: ignore[arg-type]
        with pytest.raises(error):
            pack_ops([IndexOp("C", "device"), op], 8)


def _hashes(num_blocks: int, prompt: str) -> list[bytes]:
    return [hashlib.sha256(f"{prompt}/{i}".encode()).digest() for i in range(num_blocks)]


def _random_batch(rng: random.Random, prompts: list[list[bytes]],
                  held: dict[int, dict[bytes, tuple[int, str | None]]],
                  next_id: list[int]) -> list[object]:
    """One publish's events: chains stored after a held (or no) parent, or after one not held
    (removed or cleared, perhaps earlier in the same batch), removals of anything held (often
    of a block stored earlier in the same batch, making holes under held descendants), a chain
    stored again, and now and then a clear, in random order."""
    events: list[object] = []
    touched: list[tuple[int, list[bytes], int]] = []  # (group, prompt, position) this batch
    for _ in range(rng.randrange(1, 9)):
        group_id = rng.choice((0, 1))
        node_held = held[group_id]
        roll = rng.random()
        if roll < 0.55:
            prompt = rng.choice(prompts)
            start = 0
            while start < len(prompt) and prompt[start] in node_held and rng.random() < 0.85:
                start += 1
            if rng.random() < 0.15:
                start = max(0, start - rng.randrange(1, 4))  # stored again, as vLLM may
            elif touched and rng.random() < 0.3:
                # after a block this batch stored or removed (since removed or cleared, or
                # not): its run comes from what the batch did to it
                group_id, prompt, position = rng.choice(touched)
                node_held, start = held[group_id], min(position + 1, len(prompt) - 1)
            elif rng.random() < 0.1:
                start = rng.randrange(len(prompt))  # after a parent held or not
            end = min(len(prompt), start + rng.randrange(1, 12))
            ids = list(range(next_id[0], next_id[0] + end - start))
            next_id[0] += end - start
            medium = rng.choice(_MEDIA)
            events.append(BlockStored(
                block_hashes=prompt[start:end], parent_block_hash=prompt[start - 1] if start
                else None, token_ids=[], block_size=16, lora_name=None, medium=medium,
                group_id=group_id, block_ids=ids))
            for position, (block_hash, block_id) in enumerate(
                    zip(prompt[start:end], ids, strict=True), start):
                node_held[block_hash] = (block_id, medium)  # a store again moves the entry
                touched.append((group_id, prompt, position))
        elif roll < 0.93 and node_held:
            medium = rng.choice(_MEDIA)  # a remove names the tier it removes from
            held_there = sorted(h for h, (_, m) in node_held.items() if m == medium)
            if rng.random() < 0.5:  # often a block this batch stored: later stores follow it
                recent = {p[i] for g, p, i in touched if g == group_id}
                held_there = [h for h in held_there if h in recent] or held_there
            victims = rng.sample(held_there, min(len(held_there), rng.randrange(1, 5)))
            exact = rng.random() < 0.5  # with the block ids, or "whatever block holds it"
            events.append(BlockRemoved(
                block_hashes=victims, medium=medium, group_id=group_id,
                block_ids=[node_held[h][0] for h in victims] if exact else []))
            for victim in victims:
                del node_held[victim]
        elif roll >= 0.93:
            events.append(AllBlocksCleared(medium=None))
            held[0].clear()
            held[1].clear()
    return events


def _one_op_per_event(events: list[object]) -> list[object]:
    """``events`` cut to one block each (a stored chain's parents spelled out): published one
    per call, the script reads every parent entry and hole hash as it did before its batch-wide
    shortcuts."""
    single: list[object] = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                single.append(BlockStored(
                    block_hashes=[block_hash], parent_block_hash=parent, token_ids=[],
                    block_size=16, lora_name=None, medium=event.medium, group_id=event.group_id,
                    block_ids=[block_id]))
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            ids = event.block_ids or [None] * len(event.block_hashes)
            single += [BlockRemoved(block_hashes=[h], medium=event.medium, group_id=event.group_id,
                                    block_ids=[] if i is None else [i])
                       for h, i in zip(event.block_hashes, ids, strict=True)]
        else:
            single.append(event)
    return single


def _dump(admin: redis.Redis, prefix: str) -> dict[bytes, object]:
    """Every key under ``prefix`` but the node's TTL key, its value read by type, with
    ``prefix`` cut from key names (in values too: sets of key names)."""
    cut = prefix.encode()

    def plain(value: bytes) -> bytes:
        return value.replace(cut, b"P")

    out: dict[bytes, object] = {}
    for key in admin.scan_iter(f"{prefix}:*"):
        kind = admin.type(key)
        if kind == b"hash":
            value: object = {plain(k): v for k, v in admin.hgetall(key).items()}
        elif kind == b"set":
            value = {plain(m) for m in admin.smembers(key)}
        elif kind == b"zset":
            value = [(plain(m), s) for m, s in admin.zrange(key, 0, -1, withscores=True)]
        else:
            value = admin.get(key)
        out[plain(key)] = value
    return out


def _pair(redis_url: str) -> tuple[RedisBlockIndex, RedisBlockIndex]:
    """Node A registered in two namespaces on one server: one for whole batches, one for the
    same ops one per call."""
    other = IndexNamespace(identity=dataclasses.replace(BASE_IDENTITY, model_name="one-by-one"))
    pair = (RedisBlockIndex(_NS, redis_url, retry_interval_s=0.0),
            RedisBlockIndex(other, redis_url, retry_interval_s=0.0))
    for index in pair:
        index.register_node("A", 1, ttl_s=_TTL_S)
    return pair


def _publish_both(pair: tuple[RedisBlockIndex, RedisBlockIndex], events: list[object],
                  admin: redis.Redis) -> dict[bytes, object]:
    """``events`` published whole and one op per call; asserts both left the same keys and
    values, and that the node's key set names exactly the entry keys holding a field of it.
    Returns the batched namespace's keys and values."""
    batched, one_by_one = pair
    assert batched.publish("A", 1, events).status == "ok"
    for event in _one_op_per_event(events):
        assert one_by_one.publish("A", 1, [event]).status == "ok"
    dumped = _dump(admin, batched.namespace.key_prefix)
    assert dumped == _dump(admin, one_by_one.namespace.key_prefix)
    listed = dumped.get(b"P:keys:A", set())
    assert {k for k in listed if b"A" in dumped[k]} == listed  # type: ignore[operator]
    return dumped


def _stored_run(dumped: dict[bytes, object], block_hash: bytes, group_id: int = 0) -> int:
    """The run in node A's entry for ``block_hash`` (redis_scripts.py: bytes 26-29)."""
    entry = dumped[b"P:e:%d:%s" % (group_id, block_hash[:_NS.key_hash_bytes])]
    return int.from_bytes(entry[b"A"][25:29], "big")  # type: ignore[index]


def _s(hashes: list[bytes], parent: bytes | None = None, medium: str | None = None,
       first_id: int = 1) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[],
                       block_size=16, lora_name=None, medium=medium, group_id=0,
                       block_ids=list(range(first_id, first_id + len(hashes))))


def _r(hashes: list[bytes]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=None, group_id=0, block_ids=[])


def test_each_shortcut_of_a_batch_meets_its_case(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    pair = _pair(redis_url)
    p, q, r = _hashes(4, "p"), _hashes(4, "q"), _hashes(2, "r")
    # A chain's remembered run is forgotten when the batch removes the block...
    dumped = _publish_both(pair, [_s(p[:3]), _r([p[2]]), _s([p[3]], parent=p[2])], admin)
    assert _stored_run(dumped, p[1]) == 2 and _stored_run(dumped, p[3]) == 0
    # ... or clears the node.
    dumped = _publish_both(pair, [_s(q[:2]), AllBlocksCleared(medium=None),
                                  _s([q[2]], parent=q[1])], admin)
    assert _stored_run(dumped, q[2]) == 0
    # A hole the batch makes (q1 removed under a held q2), then fills, in one batch.
    _publish_both(pair, [AllBlocksCleared(medium=None), _s(q)], admin)
    dumped = _publish_both(pair, [_r([q[1]]), _s([q[1]], parent=q[0], first_id=9)], admin)
    assert not any(k.startswith(b"P:holes") for k in dumped)
    # A hole left by an earlier batch, filled by the next one.
    dumped = _publish_both(pair, [_r([q[1]])], admin)
    assert any(k.startswith(b"P:holes") for k in dumped)
    dumped = _publish_both(pair, [_s([q[1]], parent=q[0], first_id=9)], admin)
    assert not any(k.startswith(b"P:holes") for k in dumped) and _stored_run(dumped, q[3]) == 4
    # The slowest tier rides along a chain within the batch.
    dumped = _publish_both(pair, [_s(r[:1], medium="store"), _s(r[1:], parent=r[0])], admin)
    assert dumped[b"P:e:0:" + r[1][:_NS.key_hash_bytes]][b"A"][29:30] == b"s"  # type: ignore
    # More new entry keys than Lua unpacks into one call (8,000): the SADD goes in parts.
    _publish_both(pair, [_s(_hashes(9000, "long"))], admin)
    for index in pair:
        index.close()
    admin.close()


def test_an_entry_not_of_this_incarnation_is_stored_as_new(redis_url: str) -> None:
    """A field of node A under a hash that is garbage, or an old incarnation's, is not A's
    entry: storing the hash counts it as new (the node's key set, its parent's children), so
    removing it later leaves nothing behind."""
    admin = redis.Redis.from_url(redis_url)
    index = RedisBlockIndex(_NS, redis_url, retry_interval_s=0.0)
    index.register_node("A", 2, ttl_s=_TTL_S)
    p = _hashes(3, "p")
    prefix = _NS.key_prefix.encode()
    index.publish("A", 2, [_s(p[:1])])
    for block, junk in ((1, b"bad"), (2, b"%020d" % 1 + bytes(10))):  # garbage, incarnation 1
        admin.hset(prefix + b":e:0:" + p[block][:_NS.key_hash_bytes], "A", junk)
    assert index.publish("A", 2, [_s(p[1:], parent=p[0], first_id=2)]).status == "ok"
    listed = admin.smembers(prefix + b":keys:A")
    assert {prefix + b":e:0:" + h[:_NS.key_hash_bytes] for h in p} == listed
    kids = admin.hgetall(prefix + b":kids:A:%020d:0" % 2)
    assert kids == {h[:_NS.key_hash_bytes]: b"1" for h in p[:2]}
    assert index.longest_prefix(p).num_blocks == 3
    assert index.publish("A", 2, [_r(p[::-1])]).status == "ok"
    leftover = [k for k in admin.scan_iter(f"{_NS.key_prefix}:*") if b":node:" not in k
                and not k.endswith((b":nodes", b":maxinc", b":aux:A"))]
    assert leftover == []
    index.close()
    admin.close()


def test_batches_of_mixed_events_leave_redis_as_one_op_per_call_would(redis_url: str) -> None:
    """Random batches published whole and one op per call: the same keys and values (runs,
    slowest tiers, key sets, hole records), the same entries as the in-memory reference, and
    the same lookups."""
    rng = random.Random(31)
    reference = InMemoryBlockIndex(_NS)
    reference.register_node("A", 1, ttl_s=_TTL_S)
    pair = batched, one_by_one = _pair(redis_url)
    stem = _hashes(24, "stem")
    prompts = [stem[: rng.randrange(0, 24)] + _hashes(20, f"q{k}") for k in range(5)]
    held: dict[int, dict[bytes, tuple[int, str | None]]] = {0: {}, 1: {}}
    next_id = [1]
    admin = redis.Redis.from_url(redis_url)
    num_ops = 0
    for batch in range(150):
        events = _random_batch(rng, prompts, held, next_id)
        num_ops += len(events_to_ops(events))
        assert reference.publish("A", 1, events).status == "ok"
        _publish_both(pair, events, admin)
        assert batched.node_entries("A") == reference.node_entries("A"), batch
        for probe in prompts + [p[: rng.randrange(1, len(p) + 1)] for p in prompts]:
            for group_ids in ((0,), (1,), (0, 1)):
                got = batched.longest_prefix(probe, group_ids, all_holders=True)
                expected = one_by_one.longest_prefix(probe, group_ids, all_holders=True)
                assert [(h.node_id, h.num_blocks) for h in got.holders] == \
                    [(h.node_id, h.num_blocks) for h in expected.holders], (batch, group_ids)
    assert num_ops > 1500
    assert batched.stats.garbage_entries == 0 and batched.stats.publishes == 150
    # Everything removed: no entry, hole record or key-set member of the node is left.
    events = [BlockRemoved(block_hashes=sorted(h for h, (_, m) in held[g].items() if m == medium),
                           medium=medium, group_id=g, block_ids=[])
              for g in (0, 1) for medium in _MEDIA]
    assert batched.publish("A", 1, events).status == "ok"
    assert batched.node_entries("A") == set()
    leftover = [k for k in admin.scan_iter(f"{_NS.key_prefix}:*") if b":node:" not in k
                and not k.endswith((b":nodes", b":maxinc", b":aux:A"))]
    assert leftover == []
    for index in pair:
        index.close()
    admin.close()
