"""``PrefixCacheMirror``: vLLM's prefix-cache changes as kvbridge block events (no vLLM needed).

A stand-in map (key -> block ids, first one first, as vLLM's ``BlockHashToBlockMap``) is
changed the way vLLM's pool changes it, each change recorded as the pool follower records it;
the events must bring the last report exactly up to the map, removals first, stores parents
first, one block per key. Most tests compare the events block by block (``_per_block``: a
``BlockStored``'s hashes are one chain); how they are grouped into events has tests of its own.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from kvbridge.connector.holder import HeldBlockHashes
from kvbridge.connector.vllm.prefix_cache_mirror import PrefixCacheMirror
from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlock
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id

BLOCK_SIZE = 32


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _key(i: int, group_id: int = 0) -> bytes:
    return make_block_hash_with_group_id(_hash(i), group_id)


class _Map:
    """vLLM's prefix-cache map, reduced to what the follower reads, recording into ``mirror``
    as ``pool_follower._JournaledMap`` does."""

    def __init__(self, mirror: PrefixCacheMirror) -> None:
        self.mirror = mirror
        self.blocks: dict[bytes, list[int]] = {}

    def insert(self, key: bytes, block_id: int) -> None:
        self.blocks.setdefault(key, []).append(block_id)
        self.mirror.record_insert(key, block_id)

    def pop(self, key: bytes, block_id: int) -> None:
        held = self.blocks.get(key, [])
        if block_id in held:
            held.remove(block_id)
            if not held:
                del self.blocks[key]
            self.mirror.record_pop(key, block_id)

    def holds(self, key: bytes, block_id: int) -> bool:
        return block_id in self.blocks.get(key, ())

    def block_of(self, key: bytes) -> int | None:
        held = self.blocks.get(key)
        return held[0] if held else None

    def take_events(self) -> list:
        return self.mirror.take_events(self.holds, self.block_of)

    def take(self) -> list[tuple]:
        return _per_block(self.take_events())


def _per_block(events: list) -> list[tuple]:
    """The events as one fact per block, in order: ``("S", hash, block id, parent, group)``,
    ``("R", hash, block id, group)``, ``("C",)``."""
    facts: list[tuple] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            assert event.medium is None
            facts.append(("C",))
        elif isinstance(event, BlockRemoved):
            assert event.medium is None
            facts += [("R", h, b, event.group_id)
                      for h, b in zip(event.block_hashes, event.block_ids, strict=True)]
        else:
            assert isinstance(event, BlockStored)
            assert (event.token_ids, event.block_size, event.lora_name, event.medium) == (
                [], BLOCK_SIZE, None, None)
            parent = event.parent_block_hash
            for h, b in zip(event.block_hashes, event.block_ids, strict=True):
                facts.append(("S", h, b, parent, event.group_id))
                parent = h
    return facts


def _stored(i: int, block_id: int, parent: int | None, group_id: int = 0) -> tuple:
    return ("S", _hash(i), block_id, None if parent is None else _hash(parent), group_id)


def _removed(i: int, block_id: int, group_id: int = 0) -> tuple:
    return ("R", _hash(i), block_id, group_id)


@pytest.fixture
def pool() -> _Map:
    return _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))


def _cache_request(pool: _Map, hashes: list[int], block_ids: list[int], start: int = 0,
                   group_id: int = 0) -> None:
    """``cache_full_blocks`` of blocks ``start..`` of a request: parents noted, then inserted
    in position order."""
    pool.mirror.record_parents([_hash(h) for h in hashes], start, len(hashes), group_id)
    for i in range(start, len(hashes)):
        pool.insert(_key(hashes[i], group_id), block_ids[i])


def test_a_request_s_blocks_are_stored_in_order_each_with_its_parent(pool):
    _cache_request(pool, [10, 11, 12], [5, 6, 7])
    assert pool.take() == [_stored(10, 5, None), _stored(11, 6, 10), _stored(12, 7, 11)]
    assert pool.take() == []  # reported once
    # The request grows by one block: its parent is the last block of the chain (start=3).
    _cache_request(pool, [10, 11, 12, 13], [5, 6, 7, 9], start=3)
    assert pool.take() == [_stored(13, 9, 12)]
    assert sorted(pool.mirror.snapshot_cached_blocks()) == sorted(
        [CachedBlock(_hash(h), 0, b) for h, b in [(10, 5), (11, 6), (12, 7), (13, 9)]])


def test_groups_are_kept_apart(pool):
    _cache_request(pool, [10, 11], [1, 2], group_id=0)
    _cache_request(pool, [10, 11], [3, 4], group_id=1)
    assert pool.take() == [_stored(10, 1, None, 0), _stored(11, 2, 10, 0),
                           _stored(10, 3, None, 1), _stored(11, 4, 10, 1)]


def test_evicted_blocks_are_removed_with_their_block_id_before_any_store(pool):
    _cache_request(pool, [10, 11], [5, 6])
    pool.take()
    # One step: block 6 is evicted and reused for another request's first block.
    pool.pop(_key(11), 6)
    _cache_request(pool, [20], [6])
    assert pool.take() == [_removed(11, 6), _stored(20, 6, None)]
    assert pool.mirror.snapshot_cached_blocks() == [CachedBlock(_hash(10), 0, 5),
                                                    CachedBlock(_hash(20), 0, 6)]


def test_a_block_cached_and_evicted_within_one_step_is_never_reported(pool):
    _cache_request(pool, [10], [5])
    pool.pop(_key(10), 5)
    assert pool.take() == []
    assert len(pool.mirror) == 0


def test_evicted_and_recached_in_one_step_is_removed_then_stored_again(pool):
    # The bytes of block 5 are rewritten by this step's forward: the holder must stop vouching
    # for it before the forward (removal) and vouch again after it (store).
    _cache_request(pool, [10], [5])
    pool.take()
    pool.pop(_key(10), 5)
    _cache_request(pool, [10], [5])
    assert pool.take() == [_removed(10, 5), _stored(10, 5, None)]


def test_a_copy_on_write_move_reports_the_new_block_under_the_old_parent(pool):
    _cache_request(pool, [10, 11], [5, 6])
    pool.take()
    # vLLM's move_block_hashes: the entry leaves block 6 for block 8, with no cache_full_blocks
    # call (no parents noted): the parent is the one reported before.
    pool.pop(_key(11), 6)
    pool.insert(_key(11), 8)
    assert pool.take() == [_removed(11, 6), _stored(11, 8, 10)]


def test_one_block_per_key_and_a_second_holder_takes_over_when_the_first_goes(pool):
    _cache_request(pool, [10], [5])
    _cache_request(pool, [10], [7])  # vLLM does not de-duplicate: two blocks hold hash 10
    assert pool.take() == [_stored(10, 5, None)]
    pool.pop(_key(10), 7)  # the unreported one goes: nothing to say
    assert pool.take() == []
    _cache_request(pool, [10], [7])
    pool.take()
    pool.pop(_key(10), 5)  # the reported one goes: block 7 still holds the hash
    assert pool.take() == [_removed(10, 5), _stored(10, 7, None)]


def test_a_clear_comes_first_and_supersedes_what_was_recorded_before(pool):
    _cache_request(pool, [10, 11], [5, 6])
    pool.take()
    _cache_request(pool, [12], [7])  # recorded, then the map is emptied (reset_prefix_cache)
    pool.blocks.clear()
    pool.mirror.record_clear()
    _cache_request(pool, [30], [9])  # cached after the reset, in the same step
    assert pool.take() == [("C",), _stored(30, 9, None)]
    assert pool.mirror.snapshot_cached_blocks() == [CachedBlock(_hash(30), 0, 9)]


def test_parents_noted_for_blocks_never_inserted_are_forgotten(pool):
    # vLLM skips null and masked blocks (sliding window): parents were noted, nothing inserted.
    pool.mirror.record_parents([_hash(10), _hash(11)], 0, 2, 0)
    assert pool.take() == []
    pool.insert(_key(11), 4)  # later cached without a cache_full_blocks call: no parent known
    assert pool.take() == [_stored(11, 4, None)]


@pytest.mark.parametrize(("start", "stop", "expected"), [
    (0, 0, []),            # nothing to cache
    (0, 1, [(10, None)]),  # block 0 has no parent
    (1, 3, [(11, 10), (12, 11)]),
    (2, 9, [(12, 11)]),    # stop past the hashes the request has: clipped
])
def test_record_parents_ranges(pool, start, stop, expected):
    pool.mirror.record_parents([_hash(10), _hash(11), _hash(12)], start, stop, 0)
    for h, _ in expected:
        pool.insert(_key(h), h)
    assert pool.take() == [_stored(h, h, parent) for h, parent in expected]


def test_a_resync_names_every_block_held_with_its_parent_parents_first(pool):
    # The index client's resync batch comes from the mirror (no parent table of its own): the
    # clear, then one store per block held, each block after its parent.
    _cache_request(pool, [10, 11, 12], [5, 6, 7])
    _cache_request(pool, [10, 11, 12, 13], [5, 6, 7, 9], start=3)
    _cache_request(pool, [10, 11], [1, 2], group_id=1)
    pool.take()
    pool.pop(_key(11), 6)  # a middle block evicted: its child keeps its parent
    _cache_request(pool, [20, 21], [6, 3])
    pool.mirror.take_step(pool.holds, pool.block_of)  # the step's batch (build_connector_meta)
    assert _per_block(pool.mirror.resync_events()) == [
        ("C",), _stored(10, 5, None), _stored(10, 1, None, 1), _stored(20, 6, None),
        _stored(11, 2, 10, 1), _stored(21, 3, 20), _stored(12, 7, 11), _stored(13, 9, 12)]
    # the resync describes the batches taken (as a publish does): later records come after it
    pool.pop(_key(21), 3)
    assert pool.take() == [_removed(21, 3)]


def test_a_key_lost_without_a_recorded_pop_is_removed(pool):
    _cache_request(pool, [10], [5])
    pool.take()
    pool.blocks[_key(10)] = [8]  # changed behind the mirror's back, then touched
    pool.mirror.record_insert(_key(10), 8)
    assert pool.take() == [_removed(10, 5), _stored(10, 8, None)]


def test_a_run_of_stores_is_one_event_and_the_removals_one_per_group(pool):
    _cache_request(pool, [10, 11, 12], [5, 6, 7])
    _cache_request(pool, [20, 21], [8, 9])  # another request: a chain of its own
    _cache_request(pool, [10, 11], [1, 2], group_id=1)
    assert pool.take_events() == [
        BlockStored(block_hashes=[_hash(10), _hash(11), _hash(12)], parent_block_hash=None,
                    token_ids=[], block_size=BLOCK_SIZE, lora_name=None, medium=None,
                    group_id=0, block_ids=[5, 6, 7]),
        BlockStored(block_hashes=[_hash(20), _hash(21)], parent_block_hash=None, token_ids=[],
                    block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=0,
                    block_ids=[8, 9]),
        BlockStored(block_hashes=[_hash(10), _hash(11)], parent_block_hash=None, token_ids=[],
                    block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=1,
                    block_ids=[1, 2]),
    ]
    for key, block_id in [(_key(11), 6), (_key(20), 8), (_key(10, 1), 1), (_key(12), 7)]:
        pool.pop(key, block_id)
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[_hash(11), _hash(20), _hash(12)], medium=None, group_id=0,
                     block_ids=[6, 8, 7]),
        BlockRemoved(block_hashes=[_hash(10)], medium=None, group_id=1, block_ids=[1]),
    ]


def test_keys_that_only_gained_blocks_are_not_looked_up_in_the_map(pool):
    # A step's work is proportional to what changed, with no map look-up per new block: the
    # journal alone says which block a new key has.
    asked: list[bytes] = []

    def holds(key: bytes, block_id: int) -> bool:
        asked.append(key)
        return pool.holds(key, block_id)

    def block_of(key: bytes) -> int | None:
        asked.append(key)
        return pool.block_of(key)

    _cache_request(pool, list(range(10, 74)), list(range(100, 164)))
    events = pool.mirror.take_events(holds, block_of)
    assert asked == []
    assert _per_block(events) == [_stored(10, 100, None)] + [
        _stored(h, h + 90, h - 1) for h in range(11, 74)]
    pool.pop(_key(11), 101)  # a key that lost a block is checked against the map
    pool.insert(_key(11), 7)
    assert _per_block(pool.mirror.take_events(holds, block_of)) == [
        _removed(11, 101), _stored(11, 7, 10)]
    assert asked == [_key(11)]


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        PrefixCacheMirror(block_size=0)


def _a_step_of_new_chains(pool: _Map) -> None:
    """What a burst's step caches: requests' new blocks, chains cut where a request starts
    (a prompt sharing a cached prefix, one from block 0, one continuing its own chain), a
    parent noted for a block never inserted, a block inserted without a noted parent."""
    _cache_request(pool, [1, 2, 3], [11, 12, 13])
    _cache_request(pool, [1, 2, 3, 4, 5], [11, 12, 13, 14, 15], start=3)  # extends 1-2-3
    _cache_request(pool, [20, 21], [30, 31])
    _cache_request(pool, [40, 41, 42], [50, 51, 52], start=1)  # 40 cached earlier elsewhere
    pool.mirror.record_parents([_hash(60), _hash(61)], 0, 2, 0)  # never inserted


@pytest.mark.parametrize("take_fast_path", [True, False])
def test_a_step_that_only_caches_new_chains_gives_the_events_of_the_general_path(
    take_fast_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The usual step (nothing popped, only new keys) is taken with list operations
    # (``_take_new_keys``) instead of the loop over keys; both must give the same events, in
    # the same chains, and leave the same state behind (the next step's events, the snapshot).
    if not take_fast_path:
        monkeypatch.setattr(PrefixCacheMirror, "_only_new_keys", lambda *args: False)
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _a_step_of_new_chains(pool)
    events = pool.take_events()
    assert [(len(e.block_hashes), e.parent_block_hash) for e in events] == [
        (5, None), (2, None), (2, _hash(40))]  # one BlockStored per chain
    assert _per_block(events) == [
        _stored(1, 11, None), _stored(2, 12, 1), _stored(3, 13, 2), _stored(4, 14, 3),
        _stored(5, 15, 4), _stored(20, 30, None), _stored(21, 31, 20), _stored(41, 51, 40),
        _stored(42, 52, 41)]
    # what was reported, and the parents kept for it, as the general path keeps them
    assert sorted(pool.mirror.snapshot_cached_blocks()) == sorted(
        CachedBlock(_hash(h), 0, b) for h, b in
        [(1, 11), (2, 12), (3, 13), (4, 14), (5, 15), (20, 30), (21, 31), (41, 51), (42, 52)])
    pool.pop(_key(5), 15)
    pool.insert(_key(61), 70)  # its parent noted last step is forgotten: none
    assert pool.take() == [_removed(5, 15), _stored(61, 70, None)]
    assert pool.mirror._parent_of_key == {
        _key(h): None if p is None else _hash(p) for h, p in
        [(1, None), (2, 1), (3, 2), (4, 3), (20, None), (21, 20), (41, 40), (42, 41),
         (61, None)]}


def _a_step_of_noted_stores(pool: _Map) -> None:
    """A burst's usual step: each request caches exactly the blocks it noted, nothing else is
    stored; one request's two calls continue one chain, two groups, a prefix cached earlier."""
    _cache_request(pool, [1, 2], [11, 12])
    _cache_request(pool, [1, 2, 3, 4], [11, 12, 13, 14], start=2)  # joins the chain 1-2
    _cache_request(pool, [7, 8], [17, 18], group_id=1)
    _cache_request(pool, [1, 2, 3, 4, 9], [11, 12, 13, 14, 19], start=4)  # another request
    _cache_request(pool, [20], [30])


def _slow_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.connector.vllm.pool_changes import PoolChanges
    monkeypatch.setattr(PoolChanges, "noted_runs", lambda self: None)


@pytest.mark.parametrize("slice_path", [True, False])
def test_a_step_of_noted_stores_gives_the_events_and_parents_of_the_key_by_key_path(
    slice_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step whose stores are exactly its noted slices builds its parents and events slice by
    # slice (``PoolChanges.noted_runs``); key by key must give the same, and the same state.
    if not slice_path:
        _slow_path(monkeypatch)
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _a_step_of_noted_stores(pool)
    changes = pool.mirror.take_changes(pool.holds, pool.block_of)
    assert (changes.noted_runs() is not None) is slice_path
    events = changes.events()
    pool.mirror.settle()
    assert [(len(e.block_hashes), e.parent_block_hash, e.group_id) for e in events] == [
        (4, None, 0), (2, None, 1), (1, _hash(4), 0), (1, None, 0)]  # one per chain
    assert _per_block(events) == [
        _stored(1, 11, None), _stored(2, 12, 1), _stored(3, 13, 2), _stored(4, 14, 3),
        _stored(7, 17, None, 1), _stored(8, 18, 7, 1), _stored(9, 19, 4), _stored(20, 30, None)]
    assert changes.parents() == [None, _hash(1), _hash(2), _hash(3), None, _hash(7), _hash(4),
                                 None]
    assert pool.mirror._parent_of_key == {
        _key(1): None, _key(2): _hash(1), _key(3): _hash(2), _key(4): _hash(3),
        _key(7, 1): None, _key(8, 1): _hash(7), _key(9): _hash(4), _key(20): None}
    # the next step reads the parents filed for a moved key, whichever path filed them
    pool.pop(_key(3), 13)
    pool.insert(_key(3), 40)
    assert pool.take() == [_removed(3, 13), _stored(3, 40, 2)]


@pytest.mark.parametrize("case", ["noted, never inserted", "inserted, never noted",
                                  "one left out, another in", "a key noted twice",
                                  "other keys that join alike", "noted hashes that join alike",
                                  "noted slices that join alike"])
def test_stores_that_are_not_the_noted_slices_are_worked_out_key_by_key(case: str) -> None:
    # A null or masked block is noted but not inserted; a copy-on-write move inserts without a
    # note; two requests can cache one hash in one step (vLLM does not de-duplicate): the
    # stores are then not the noted slices end to end, and the key-by-key path decides.
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _cache_request(pool, [1, 2], [11, 12])
    if case == "noted, never inserted":
        pool.mirror.record_parents([_hash(1), _hash(2), _hash(3)], 2, 3, 0)
        expected = [_stored(1, 11, None), _stored(2, 12, 1)]
    elif case == "inserted, never noted":
        pool.insert(_key(5), 15)
        expected = [_stored(1, 11, None), _stored(2, 12, 1), _stored(5, 15, None)]
    elif case == "one left out, another in":  # as many keys as noted, not the same ones
        pool.mirror.record_parents([_hash(3)], 0, 1, 0)
        pool.insert(_key(5), 15)
        expected = [_stored(1, 11, None), _stored(2, 12, 1), _stored(5, 15, None)]
    elif case == "a key noted twice":
        _cache_request(pool, [1], [21])
        expected = [_stored(1, 11, None), _stored(2, 12, 1)]
    elif case in ("noted hashes that join alike", "noted slices that join alike"):
        a, b = _hash(256), _hash(5)  # hashes of 31 and 33 bytes, keys of 36 (a ends in a zero
        noted = [a[:31], b"\0" + b]  # byte, as the group suffix does), in one slice or two
        if case == "noted hashes that join alike":
            pool.mirror.record_parents(noted, 0, 2, 0)
        else:
            pool.mirror.record_parents(noted[:1], 0, 1, 0)
            pool.mirror.record_parents(noted[1:], 0, 1, 0)
        pool.insert(_key(256), 13)
        pool.insert(_key(5), 14)
        expected = [_stored(1, 11, None), _stored(2, 12, 1), _stored(256, 13, None),
                    _stored(5, 14, None)]
    else:  # keys of other lengths whose bytes join as the noted ones do: not the same keys
        joined = _key(3) + _key(4)
        pool.mirror.record_parents([_hash(3), _hash(4)], 0, 2, 0)
        pool.insert(joined[:35], 13)  # (its last 4 bytes read as group 3 << 24)
        pool.insert(joined[35:], 14)
        expected = [_stored(1, 11, None), _stored(2, 12, 1), ("S", joined[:31], 13, None, 3 << 24),
                    ("S", joined[35:-4], 14, None, 0)]
    changes = pool.mirror.take_changes(pool.holds, pool.block_of)
    assert changes.noted_runs() is None
    assert _per_block(changes.events()) == expected


def _a_step_of_evictions(pool: _Map) -> None:
    """A full cache's step: reported blocks evicted for reuse (one key held by a second block
    too, one evicted and cached again in the step), new chains in two groups cached into the
    freed blocks, an unreported second holder popped."""
    _cache_request(pool, [1, 2, 3], [11, 12, 13])
    _cache_request(pool, [1], [19])  # a second block holds hash 1 (vLLM does not de-duplicate)
    _cache_request(pool, [7, 8], [17, 18], group_id=1)
    pool.take()
    pool.pop(_key(1), 11)  # block 19 still holds it: reported there now, under no parent
    pool.pop(_key(2), 12)
    pool.pop(_key(8, 1), 18)
    pool.pop(_key(3), 13)
    _cache_request(pool, [3], [12], start=0)  # hash 3 back, in block 12 (noted parent: none)
    _cache_request(pool, [20, 21], [11, 13])
    _cache_request(pool, [30, 31], [18, 40], group_id=1)


@pytest.mark.parametrize("take_fast_path", [True, False])
def test_a_step_of_evictions_gives_the_events_of_the_general_path(
    take_fast_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full cache's step evicts a block for each it caches: the removals and the new keys are
    # taken with list operations unless a new key was popped too (here: hash 3, re-cached), then
    # key by key; both give the same events and leave the same state.
    if not take_fast_path:
        monkeypatch.setattr(PrefixCacheMirror, "_only_new_keys", lambda *args: False)
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _a_step_of_evictions(pool)
    assert pool.take() == [
        _removed(1, 11), _removed(2, 12), _removed(3, 13), _removed(8, 18, 1),
        _stored(3, 12, None), _stored(20, 11, None), _stored(21, 13, 20),
        _stored(30, 18, None, 1), _stored(31, 40, 30, 1), _stored(1, 19, None)]
    assert sorted(pool.mirror.snapshot_cached_blocks()) == sorted(
        [CachedBlock(_hash(1), 0, 19), CachedBlock(_hash(7), 1, 17), CachedBlock(_hash(3), 0, 12),
         CachedBlock(_hash(20), 0, 11), CachedBlock(_hash(21), 0, 13),
         CachedBlock(_hash(30), 1, 18), CachedBlock(_hash(31), 1, 40)])
    # Without the re-cached key the new keys take the list path; same events either way.
    pool.pop(_key(20), 11)
    pool.pop(_key(31, 1), 40)
    _cache_request(pool, [50, 51], [11, 40])
    assert pool.take() == [_removed(20, 11), _removed(31, 40, 1), _stored(50, 11, None),
                           _stored(51, 40, 50)]
    pool.pop(_key(1), 19)
    pool.insert(_key(1), 23)  # a move: the parent reported before (none) is kept
    pool.pop(_key(21), 13)
    pool.insert(_key(21), 24)
    assert pool.take() == [_removed(1, 19), _removed(21, 13), _stored(1, 23, None),
                           _stored(21, 24, 20)]


def _step_delta(pool: _Map):
    """The holder's delta of the step so far, taken as the step takes it: the map is not
    looked up until the delta is out."""
    in_step = [True]

    def looked_up(read):
        def read_after_the_step(*args):
            assert not in_step[0], "the step's delta looked up the map"
            return read(*args)
        return read_after_the_step

    batch = pool.mirror.take_step(looked_up(pool.holds), looked_up(pool.block_of),
                                  looked_up(lambda key: pool.block_of(key) is not None))
    delta = batch.hash_delta()
    in_step[0] = False
    return batch, (delta.cleared, delta.removed_block_ids,
                   dict(zip(delta.stored_block_ids, delta.stored_hashes, strict=True)))


def test_the_step_s_delta_is_its_records_and_its_changes_come_after():
    # The holder's delta goes with the step's orders: every popped block removed before the
    # forward, every new key's block stored after it; the exact changes are taken later.
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _cache_request(pool, [10, 11], [5, 6])
    _, delta = _step_delta(pool)
    assert delta == (False, [], {5: _key(10), 6: _key(11)})
    pool.pop(_key(11), 6)
    _cache_request(pool, [20], [6], group_id=1)
    batch, delta = _step_delta(pool)
    assert delta == (False, [6], {6: _key(20, 1)})
    # the exact changes, taken after the forward (the step before's first), against the map
    assert _per_block(batch.events()) == [_removed(11, 6), _stored(20, 6, None, 1)]
    assert pool.mirror.snapshot_cached_blocks() == [CachedBlock(_hash(10), 0, 5),
                                                    CachedBlock(_hash(20), 1, 6)]


def test_a_block_cached_and_taken_back_in_one_step_is_never_stored_for_the_holder():
    # Cached, freed by a preemption and reused within one schedule(): the block's forward writes
    # another request's KV, so the holder must not list it for the key it lost.
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _cache_request(pool, [10, 11], [5, 6])
    pool.pop(_key(11), 6)
    pool.pop(_key(10), 5)
    _cache_request(pool, [10], [7])  # re-cached elsewhere after the pop: left out (safe side)
    _cache_request(pool, [30], [5])
    batch, delta = _step_delta(pool)
    assert delta == (False, [6, 5], {5: _key(30)})
    assert _per_block(batch.events()) == [_stored(10, 7, None), _stored(30, 5, None)]


def test_a_key_lost_behind_the_follower_s_back_is_removed_with_the_next_delta():
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _cache_request(pool, [10], [5])
    pool.take()
    pool.blocks[_key(10)] = [8]  # changed behind the mirror's back, then touched
    pool.mirror.record_insert(_key(10), 8)
    assert pool.take() == [_removed(10, 5), _stored(10, 8, None)]
    assert _step_delta(pool)[1] == (False, [5], {})
    pool.mirror.record_clear()
    assert _step_delta(pool)[1] == (True, [], {})


def test_a_step_leaves_the_parents_to_be_worked_out_off_it():
    # Inside the step a take lists keys and blocks only; the parents (what the index needs to
    # extend a run) are worked out when the events are built, after the forward.
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _cache_request(pool, [10, 11, 12], [5, 6, 7])
    changes = pool.mirror.take_changes(pool.holds, pool.block_of)
    assert changes.stored_keys == [_key(10), _key(11), _key(12)]
    assert not changes.has_parents()
    assert changes.parents() == [None, _hash(10), _hash(11)]
    assert pool.mirror._parent_of_key == {_key(10): None, _key(11): _hash(10),
                                          _key(12): _hash(11)}


def test_asking_a_later_batch_for_its_parents_settles_the_earlier_ones_first():
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _cache_request(pool, [10, 11], [5, 6])
    first = pool.mirror.take_changes(pool.holds, pool.block_of)
    _cache_request(pool, [10, 11, 12], [5, 6, 7], start=2)
    second = pool.mirror.take_changes(pool.holds, pool.block_of)
    assert _per_block(second.events()) == [_stored(12, 7, 11)]
    assert first.has_parents() and first.parents() == [None, _hash(10)]
    assert pool.mirror._parent_of_key == {_key(10): None, _key(11): _hash(10),
                                          _key(12): _hash(11)}
    # After a reset the mirror knows no parents: a key cached again without a noted one has none.
    pool.mirror.record_clear()
    pool.blocks.clear()
    pool.insert(_key(11), 9)
    assert pool.take() == [("C",), _stored(11, 9, None)]


def _take_step(pool: _Map):
    return pool.mirror.take_step(pool.holds, pool.block_of,
                                 lambda key: pool.block_of(key) is not None)


@pytest.mark.parametrize("step_n2_taken", [False, True])
def test_a_key_cached_again_after_a_late_batch_s_records_keeps_its_parent(step_n2_taken):
    # vLLM's async scheduling: step N+1 is scheduled (its batch taken) before step N's output
    # is processed, so a batch's exact changes are taken against a map that later steps have
    # changed already. Hash 11 (parent 10) is reported at block 6 and also held by block 7.
    pool = _Map(PrefixCacheMirror(block_size=BLOCK_SIZE))
    _cache_request(pool, [10, 11], [5, 6])
    _cache_request(pool, [10, 11], [5, 7], start=1)
    pool.take()
    pool.pop(_key(11), 7)  # step N: the second holder is evicted
    step_n = _take_step(pool)
    pool.pop(_key(11), 6)  # step N+1 (scheduled before step N's output): the first goes too
    step_n1 = _take_step(pool)
    # step N's output: hash 11 is gone from the map (its removal is reported there)
    assert _per_block(step_n.events()) == [_removed(11, 6)]
    _cache_request(pool, [10, 11], [5, 8], start=1)  # step N+2: a request caches 11 again
    step_n2 = _take_step(pool) if step_n2_taken else None
    # step N+1's output: the map holds 11 in block 8, so it is reported there (a batch's
    # changes bring the report up to the map as it is); its parent is still 10, noted by the
    # step that cached it, not by step N+1.
    assert _per_block(step_n1.events()) == [_stored(11, 8, 10)]
    assert (step_n2.events() if step_n2 else pool.take_events()) == []
    pool.mirror.settle()
    assert pool.mirror._parent_of_key[_key(11)] == _hash(10)


def _true_parent(block_hash: bytes) -> bytes | None:
    """In the interleavings below, hash ``100 * chain + position``'s parent is the one before."""
    value = int.from_bytes(block_hash, "big")
    return None if value % 100 == 0 else _hash(value - 1)


@pytest.mark.parametrize("seed", range(150))
def test_random_interleavings_keep_the_index_exact_and_the_holder_safe(seed):
    # Steps of caching (evicting the block reused), evict_blocks, copy-on-write moves and
    # resets; each step's batch taken at once (its delta to a real HeldBlockHashes) and its
    # exact changes taken any number of steps later, after more changes (async scheduling,
    # evict_blocks before the publish). The holder must never list a block for a key whose KV
    # its bytes do not hold; the events, applied in order, must remove only what they stored,
    # never store a key twice, name every parent, and end at the map.
    rng = random.Random(seed)
    mirror = PrefixCacheMirror(block_size=BLOCK_SIZE)
    pool = _Map(mirror)
    holder, untaken = HeldBlockHashes(), deque()
    index: dict[bytes, int] = {}  # what the events told the index
    key_of_block: dict[int, bytes] = {}  # vLLM's block -> its hash (one per block)
    kv_of_block: dict[int, bytes | None] = {}  # whose KV the block's bytes hold
    writes: dict[int, Any] = {}  # what this step's forward writes (None: another request's)

    def evict(block_id: int) -> None:  # get_new_blocks: the block's hash popped, bytes reused
        old = key_of_block.pop(block_id, None)
        if old is not None:
            pool.pop(old, block_id)
        writes[block_id] = None

    def publish() -> None:
        for fact in _per_block(untaken.popleft().events()):
            if fact[0] == "C":
                index.clear()
            elif fact[0] == "R":
                assert index.pop(make_block_hash_with_group_id(fact[1], fact[3])) == fact[2]
            else:
                key = make_block_hash_with_group_id(fact[1], fact[4])
                assert key not in index and fact[3] == _true_parent(fact[1])
                index[key] = fact[2]

    for _ in range(rng.randrange(5, 30)):
        writes.clear()
        for _ in range(rng.randrange(6)):
            kind, olds = rng.random(), sorted(set(key_of_block) - set(writes))
            if kind < 0.55:  # a request caches blocks start..stop-1 of chain c
                chain, group, start = rng.randrange(4), rng.randrange(2), rng.randrange(3)
                hashes = [_hash(100 * chain + p) for p in range(start + rng.randrange(1, 4))]
                mirror.record_parents(hashes, start, len(hashes), group)
                for block_hash in hashes[start:]:
                    key, block_id = make_block_hash_with_group_id(block_hash, group), \
                        rng.randrange(12)
                    evict(block_id)
                    pool.insert(key, block_id)
                    key_of_block[block_id] = writes[block_id] = key
            elif kind < 0.75 and key_of_block:  # evict_blocks: popped, bytes left as they are
                block_id = rng.choice(sorted(key_of_block))
                pool.pop(key_of_block.pop(block_id), block_id)
            elif kind < 0.93 and olds:  # move_block_hashes: copied before src is written
                src, dst = rng.choice(olds), rng.randrange(12)
                if dst != src:
                    evict(dst)
                    key = key_of_block.pop(src)
                    pool.pop(key, src)
                    pool.insert(key, dst)
                    key_of_block[dst], writes[dst], writes[src] = key, ("copy", src), None
            elif kind >= 0.93:  # reset_prefix_cache: a new map; the old one stays as it was
                pool = _Map(mirror)
                mirror.record_clear()
                key_of_block.clear()
        untaken.append(_take_step(pool))
        delta = untaken[-1].hash_delta()
        holder.apply_removals(delta)
        for block_id, key in holder._block_to_hash.items():
            assert kv_of_block.get(block_id) == key and block_id not in writes
        before = dict(kv_of_block)
        kv_of_block.update((b, before.get(w[1]) if isinstance(w, tuple) else w)
                           for b, w in writes.items())
        holder.apply_stores(delta)
        for block_id, key in holder._block_to_hash.items():
            assert kv_of_block.get(block_id) == key
        for _ in range(rng.randrange(3)):  # evict_blocks before this step's publish
            if key_of_block and rng.random() < 0.5:
                block_id = rng.choice(sorted(key_of_block))
                pool.pop(key_of_block.pop(block_id), block_id)
        while untaken and rng.random() < 0.6:
            publish()
        if rng.random() < 0.1:  # the index lost everything: a resync in place of the publishes
            untaken.clear()
            index.clear()
            resync = _per_block(mirror.resync_events())
            assert resync[0] == ("C",)
            for fact in resync[1:]:  # every block with its true parent, parents first
                key = make_block_hash_with_group_id(fact[1], fact[4])
                assert fact[0] == "S" and key not in index and fact[3] == _true_parent(fact[1])
                assert fact[3] is None or not any(
                    later[1] == fact[3] for later in resync[resync.index(fact):])
                index[key] = fact[2]
        if rng.random() < 0.2:
            mirror.settle()
    untaken.append(_take_step(pool))
    while untaken:
        publish()
    assert index.keys() == pool.blocks.keys()  # one block per key the map holds, held
    assert all(pool.holds(key, block_id) for key, block_id in index.items())
