"""FreeKVCacheBlockQueue and BlockPool: exact queue orders, eviction, events, corruption."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _kvmanager_builders import free_queue_ids, hashed_block_ids, pool_snapshot
from kvbridge.kvmanager import (
    AllBlocksCleared,
    BlockHashToBlockMap,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    Request,
    check_pool_integrity,
    get_request_block_hasher,
    make_block_hash_with_group_id,
)


def _queue(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def _ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def _cached_request(num_tokens: int, block_size: int = 4, salt: str | None = None) -> Request:
    return Request("req", list(range(num_tokens)), cache_salt=salt,
                   block_hasher=get_request_block_hasher(block_size))


def _cache(pool: BlockPool, req: Request, blocks: list[KVCacheBlock], group_id: int = 0) -> None:
    pool.cache_full_blocks(req, blocks, req.block_hashes, 0, len(blocks), 4, group_id)


# -- free queue ------------------------------------------------------------------------------
def test_queue_pops_in_order_and_counts() -> None:
    queue, _ = _queue(5)
    assert queue.popleft().block_id == 0
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
    assert (_ids(queue), queue.num_free_blocks) == ([3, 4], 2)
    assert queue.popleft_n(0) == []
    with pytest.raises(ValueError, match="cannot pop 3 blocks: 2 free"):
        queue.popleft_n(3)
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_queue_remove_from_the_middle_append_and_prepend() -> None:
    queue, blocks = _queue(6)
    queue.remove(blocks[3])  # O(1) unlink from the middle (a prefix hit on a cached free block)
    assert _ids(queue) == [0, 1, 2, 4, 5]
    queue.append(blocks[3])
    assert _ids(queue) == [0, 1, 2, 4, 5, 3]
    popped = queue.popleft_n(2)
    queue.prepend_n(popped)  # order kept: block 0 is popped next again
    assert _ids(queue) == [0, 1, 2, 4, 5, 3]
    queue.remove(blocks[0])
    queue.remove(blocks[3])  # head and tail positions too
    queue.append_n([blocks[3], blocks[0]])
    assert (_ids(queue), queue.num_free_blocks) == ([1, 2, 4, 5, 3, 0], 6)


def test_queue_rejects_double_remove_and_double_append() -> None:
    queue, blocks = _queue(3)
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError, match="block 1 is not in the free queue"):
        queue.remove(blocks[1])
    with pytest.raises(RuntimeError, match="block 2 is already in the free queue"):
        queue.append(blocks[2])
    with pytest.raises(RuntimeError, match="block 0 is already in the free queue"):
        queue.prepend_n([blocks[0]])


# -- pool --------------------------------------------------------------------------------------
def test_pool_takes_out_the_null_block_at_start() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_queue_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    check_pool_integrity(pool)
    with pytest.raises(ValueError, match="num_gpu_blocks must be >= 1"):
        BlockPool(0, enable_caching=True)
    assert BlockPool(1, enable_caching=True).get_usage() == 0.0  # only the null block


def test_free_puts_unhashed_blocks_first_and_hashed_last() -> None:
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # 1, 2, 3, 4
    req = _cached_request(8)
    _cache(pool, req, blocks[:2])  # 1 and 2 hashed
    pool.free_blocks(reversed(blocks))  # a request frees in reverse: 4, 3, 2, 1
    # Unhashed 4, 3 are prepended (as a batch, in the order given); hashed 2, 1 appended.
    assert free_queue_ids(pool) == [4, 3, 5, 6, 7, 2, 1]
    check_pool_integrity(pool)


def test_get_new_blocks_evicts_the_old_hash_before_handing_out() -> None:
    pool = BlockPool(3, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    req = _cached_request(8)
    _cache(pool, req, blocks)
    pool.free_blocks(blocks)  # queue [1, 2], both still findable
    assert pool.get_cached_block(req.block_hashes[0], [0])[0].block_id == 1
    pool.take_events()
    (reused,) = pool.get_new_blocks(1)
    assert reused.block_id == 1 and reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert pool.get_cached_block(req.block_hashes[1], [0])[0].block_id == 2
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[req.block_hashes[0]], medium=None, group_id=0, block_ids=[1])
    ]
    with pytest.raises(ValueError, match="cannot get 2 blocks: 1 free"):
        pool.get_new_blocks(2)
    check_pool_integrity(pool)


def test_touch_takes_a_cached_free_block_off_the_queue() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    req = _cached_request(12)
    _cache(pool, req, blocks)
    pool.free_blocks(blocks)  # all hashed -> appended: [4, 1, 2, 3]
    assert free_queue_ids(pool) == [4, 1, 2, 3]
    pool.touch([blocks[1], pool.null_block])  # null ignored
    assert free_queue_ids(pool) == [4, 1, 3]
    assert (blocks[1].ref_cnt, pool.null_block.ref_cnt) == (1, 0)
    pool.touch([blocks[1]])  # a second holder: no queue change
    assert blocks[1].ref_cnt == 2
    pool.free_blocks([blocks[1], blocks[1]])
    assert free_queue_ids(pool) == [4, 1, 3, 2]
    check_pool_integrity(pool)


def test_free_below_zero_names_the_block() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="block 1 freed with ref_cnt 0"):
        pool.free_blocks([block])


def test_get_cached_block_needs_every_group() -> None:
    pool = BlockPool(6, enable_caching=True)
    req = _cached_request(4)
    g0 = pool.get_new_blocks(1)
    g1 = pool.get_new_blocks(1)
    _cache(pool, req, g0, group_id=0)
    assert pool.get_cached_block(req.block_hashes[0], [0]) == g0
    assert pool.get_cached_block(req.block_hashes[0], [0, 1]) is None  # group 1 misses
    _cache(pool, req, g1, group_id=1)
    assert pool.get_cached_block(req.block_hashes[0], [0, 1]) == [g0[0], g1[0]]
    check_pool_integrity(pool)


def test_duplicate_blocks_with_one_hash_both_serve_and_evict_separately() -> None:
    pool = BlockPool(4, enable_caching=True)
    req = _cached_request(4)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    _cache(pool, req, first)
    _cache(pool, req, second)  # two requests computed the same block concurrently
    key = make_block_hash_with_group_id(req.block_hashes[0], 0)
    # Caching order: block 1 was cached first, so it is the one a lookup returns.
    assert [b.block_id for b in pool.cached_block_hash_to_block.get_blocks(key)] == [1, 2]
    assert pool.get_cached_block(req.block_hashes[0], [0]) == first
    pool.evict_blocks([1])
    assert pool.get_cached_block(req.block_hashes[0], [0]) == second
    check_pool_integrity(pool)


def test_get_new_blocks_evicts_one_of_two_blocks_sharing_a_hash() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    req = _cached_request(4)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    _cache(pool, req, first)
    _cache(pool, req, second)
    pool.free_blocks(first + second)
    pool.take_events()
    assert free_queue_ids(pool) == [3, 1, 2]  # unhashed 3 first, then the hashed ones
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 1]
    # Block 1 lost the shared hash; block 2 still serves it.
    assert pool.get_cached_block(req.block_hashes[0], [0]) == second
    assert [e.block_ids for e in pool.take_events()] == [[1]]
    check_pool_integrity(pool)
    assert pool.get_new_blocks(1) == second
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert [e.block_ids for e in pool.take_events()] == [[2]]
    check_pool_integrity(pool)


def test_hash_map_upgrades_to_several_blocks_and_back_to_one() -> None:
    cache = BlockHashToBlockMap()
    key, other_key = b"k" * 36, b"o" * 36
    a, b, c = (KVCacheBlock(block_id=i) for i in (1, 2, 3))
    assert (len(cache), cache.get_one_block(key), cache.get_blocks(key)) == (0, None, [])
    cache.insert(key, a)
    cache.insert(key, a)  # already listed: no change
    assert (len(cache), cache.get_one_block(key), cache.get_blocks(key)) == (1, a, [a])
    cache.insert(key, b)
    cache.insert(key, c)
    cache.insert(other_key, c)
    # Two keys; ``key`` lists 3 blocks in caching order, and a lookup returns the first cached.
    assert (len(cache), cache.get_one_block(key), cache.get_blocks(key)) == (2, a, [a, b, c])
    assert cache.pop(key, 9) is None and cache.get_blocks(key) == [a, b, c]  # 9 not listed
    assert cache.pop(key, 1) is a and cache.get_blocks(key) == [b, c]
    assert cache.pop(key, 3) is c and cache.get_blocks(key) == [b]  # back to one block
    assert cache.pop(key, 3) is None and cache.get_blocks(key) == [b]
    cache.insert(key, a)  # upgrade again: b was cached before a now
    assert cache.get_one_block(key) is b
    assert sorted((k, blk.block_id) for k, blk in cache.blocks()) == [
        (key, 1), (key, 2), (other_key, 3)]
    assert (key in cache, b"missing" in cache) == (True, False)
    assert cache.pop(key, 2) is b and cache.pop(key, 1) is a and key not in cache
    assert cache.pop(key, 1) is None
    cache.clear()
    assert (len(cache), list(cache.blocks())) == (0, [])


def test_evict_blocks_removes_identity_not_ownership() -> None:
    pool = BlockPool(5, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    req = _cached_request(8)
    _cache(pool, req, blocks)
    pool.free_blocks([blocks[1]])  # block 2 free but cached, block 1 still held
    assert free_queue_ids(pool) == [3, 4, 2]
    pool.take_events()
    pool.evict_blocks([1, 2, 3])  # 3 has no hash: skipped
    assert (blocks[0].ref_cnt, hashed_block_ids(pool)) == (1, [])
    assert free_queue_ids(pool) == [3, 4, 2]  # queue position kept
    assert [e.block_ids for e in pool.take_events()] == [[1], [2]]
    with pytest.raises(ValueError, match="block id 9 out of range"):
        pool.evict_blocks([9])
    check_pool_integrity(pool)


def test_cache_full_blocks_records_one_stored_event_and_rejects_a_rehash() -> None:
    pool = BlockPool(5, enable_caching=True, enable_kv_cache_events=True, kv_event_medium="GPU")
    req = _cached_request(10)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, req.block_hashes, 0, 1, 4, 0)
    pool.cache_full_blocks(req, blocks, req.block_hashes, 1, 2, 4, 0)
    pool.cache_full_blocks(req, blocks, req.block_hashes, 1, 2, 4, 0)  # same key: no-op
    assert pool.take_events() == [
        BlockStored(block_hashes=[req.block_hashes[0]], parent_block_hash=None,
                    token_ids=[0, 1, 2, 3], block_size=4, lora_name=None, medium="GPU",
                    group_id=0, block_ids=[1]),
        BlockStored(block_hashes=[req.block_hashes[1]], parent_block_hash=req.block_hashes[0],
                    token_ids=[4, 5, 6, 7], block_size=4, lora_name=None, medium="GPU",
                    group_id=0, block_ids=[2]),
    ]
    other = _cached_request(10, salt="other")
    with pytest.raises(RuntimeError, match="block 1 already cached under another hash"):
        pool.cache_full_blocks(other, blocks, other.block_hashes, 0, 1, 4, 0)
    check_pool_integrity(pool)


def test_reset_prefix_cache_refuses_while_blocks_are_held() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    _cache(pool, _cached_request(8), blocks)
    assert pool.reset_prefix_cache() is False and hashed_block_ids(pool) == [1, 2]
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert hashed_block_ids(pool) == [] and all(b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared(medium=None)]
    assert pool.take_events() == []  # taken once
    check_pool_integrity(pool)


def test_events_are_not_recorded_when_off() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    _cache(pool, _cached_request(8), blocks)
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)
    assert pool.take_events() == []


def test_usage_is_the_held_fraction_of_usable_blocks() -> None:
    pool = BlockPool(5, enable_caching=False)
    pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: setattr(p.blocks[2], "ref_cnt", 1), "block 2 is in the free queue with ref_cnt"),
        (lambda p: setattr(p.blocks[1], "ref_cnt", 0), "block 1 has ref_cnt 0 but is not in"),
        (lambda p: setattr(p.free_block_queue, "num_free_blocks", 9), "num_free_blocks is 9"),
        (lambda p: setattr(p.null_block, "ref_cnt", 1), "null block 0"),
        (lambda p: p.cached_block_hash_to_block.clear(), "block 1 has a hash that the prefix"),
        # Listed under a key it does not carry (block 2 is unhashed).
        (lambda p: p.cached_block_hash_to_block.insert(p.blocks[1].block_hash, p.blocks[2]),
         "lists block 2 under group 0 with a hash the block does not have"),
        # A stranger object posing as block 3, carrying block 1's key.
        (lambda p: p.cached_block_hash_to_block.insert(
            p.blocks[1].block_hash, KVCacheBlock(block_id=3, _block_hash=p.blocks[1].block_hash)),
         "lists a block 3 that is not the pool's block of that id"),
    ],
)
def test_pool_integrity_names_the_broken_block(
    corrupt: Callable[[BlockPool], object], message: str
) -> None:
    pool = BlockPool(4, enable_caching=True)
    (held,) = pool.get_new_blocks(1)
    _cache(pool, _cached_request(4), [held])
    check_pool_integrity(pool)
    corrupt(pool)
    with pytest.raises(RuntimeError, match=message):
        check_pool_integrity(pool)


def test_get_cached_prefix_stops_at_the_first_block_any_group_misses() -> None:
    pool = BlockPool(12, enable_caching=True)
    req = _cached_request(16)
    g0, g1 = pool.get_new_blocks(4), pool.get_new_blocks(2)
    _cache(pool, req, g0, group_id=0)  # positions 0-3 in group 0
    _cache(pool, req, g1, group_id=1)  # positions 0-1 in group 1
    assert pool.get_cached_prefix(req.block_hashes, [0], 9) == (g0,)
    assert pool.get_cached_prefix(req.block_hashes, [0], 3) == (g0[:3],)  # max_blocks caps it
    assert pool.get_cached_prefix(req.block_hashes, [0, 1], 9) == (g0[:2], g1)
    pool.evict_blocks([g0[0].block_id])
    assert pool.get_cached_prefix(req.block_hashes, [0, 1], 9) == ([], [])  # a miss at 0
    check_pool_integrity(pool)


# -- cold cached blocks (the offload planner's view of the pool) --------------------------------
def _pool_with_cold_blocks() -> tuple[BlockPool, Request, list[KVCacheBlock]]:
    """Blocks 1-5 taken, 1-3 cached (group 0), then freed in reverse as a request frees: the
    queue is ``[5, 4, 6, 7, 3, 2, 1]`` (unhashed 5, 4 prepended; hashed 3, 2, 1 appended)."""
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    req = _cached_request(12)
    _cache(pool, req, blocks[:3])
    pool.free_blocks(reversed(blocks))
    assert free_queue_ids(pool) == [5, 4, 6, 7, 3, 2, 1]
    return pool, req, blocks


def _cold(pool: BlockPool, max_scan: int) -> list[tuple[int, bytes]]:
    return [tuple(c) for c in pool.iter_cold_cached_blocks(max_scan)]


def test_cold_cached_blocks_come_from_the_queue_head_skipping_unhashed_ones() -> None:
    pool, req, _ = _pool_with_cold_blocks()
    keys = [make_block_hash_with_group_id(h, 0) for h in req.block_hashes]
    before = pool_snapshot(pool)
    # Queue order is eviction order: block 3 (the request's last block) goes first, then 2, 1.
    assert _cold(pool, 7) == [(3, keys[2]), (2, keys[1]), (1, keys[0])]
    assert _cold(pool, 100) == _cold(pool, 7)  # past the tail: the walk just ends
    # max_scan counts every entry looked at: 5, 4, 6, 7 (unhashed), then 3.
    assert _cold(pool, 5) == [(3, keys[2])]
    assert _cold(pool, 4) == [] and _cold(pool, 0) == []
    assert pool_snapshot(pool) == before  # looking changed nothing
    first = next(pool.iter_cold_cached_blocks(7))
    assert (first.block_id, first.block_hash_with_group_id) == (3, keys[2])
    with pytest.raises(ValueError, match="max_scan must be >= 0, got -1"):
        pool.iter_cold_cached_blocks(-1)  # raised at the call, not at the first next()
    check_pool_integrity(pool)


def test_touched_evicted_and_reused_blocks_are_no_longer_cold() -> None:
    pool, req, blocks = _pool_with_cold_blocks()
    keys = [make_block_hash_with_group_id(h, 0) for h in req.block_hashes]
    pool.touch([blocks[1]])  # a hit on block 2: ref_cnt 1, off the queue
    assert _cold(pool, 7) == [(3, keys[2]), (1, keys[0])]
    pool.evict_blocks([3])  # stays queued, unhashed
    assert _cold(pool, 7) == [(1, keys[0])]
    pool.get_new_blocks(5)  # 5, 4, 6, 7, 3: the unhashed ones; block 1 is still cold
    assert _cold(pool, 7) == [(1, keys[0])]
    pool.get_new_blocks(1)  # block 1 popped: its hash is dropped
    assert _cold(pool, 7) == []
    check_pool_integrity(pool)


def test_cold_cached_blocks_carry_their_group_id() -> None:
    pool = BlockPool(6, enable_caching=True)
    req = _cached_request(8)
    g0, g1 = pool.get_new_blocks(2), pool.get_new_blocks(2)  # 1, 2 and 3, 4
    _cache(pool, req, g0, group_id=0)
    _cache(pool, req, g1, group_id=1)
    pool.free_blocks([*g1, *g0])  # queue [5, 3, 4, 1, 2]
    hashes = req.block_hashes
    assert _cold(pool, 5) == [
        (3, make_block_hash_with_group_id(hashes[0], 1)),
        (4, make_block_hash_with_group_id(hashes[1], 1)),
        (1, make_block_hash_with_group_id(hashes[0], 0)),
        (2, make_block_hash_with_group_id(hashes[1], 0)),
    ]
