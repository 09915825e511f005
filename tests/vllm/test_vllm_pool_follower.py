"""``VllmPoolFollower`` on vLLM's own ``BlockPool`` (vllm/v1/core/block_pool.py), driven directly.

The pool is changed the ways vLLM's managers change it (``cache_full_blocks``, an eviction in
``get_new_blocks``, ``move_block_hashes``, ``reset_prefix_cache``); the follower's events must
name exactly those blocks. Requests are stand-ins: with vLLM's own KV events off, the pool reads
only ``request.block_hashes``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.core.block_pool")

from kvbridge.connector.errors import KVTransferConfigError
from kvbridge.connector.vllm.pool_follower import VllmPoolFollower
from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.block_pool import BlockPool

BLOCK_SIZE = 4


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


def _stored(hashes: list[int], block_ids: list[int], parent: int | None) -> BlockStored:
    """One chain of stores: ``hashes[i]`` in ``block_ids[i]``, its parent the hash before."""
    return BlockStored(block_hashes=[_hash(i) for i in hashes],
                       parent_block_hash=None if parent is None else _hash(parent), token_ids=[],
                       block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=0,
                       block_ids=block_ids)


def _removed(hashes: list[int], block_ids: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=[_hash(i) for i in hashes], medium=None, group_id=0,
                        block_ids=block_ids)


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK_SIZE)


def _cache(pool: BlockPool, hashes: list[int], *, positional: bool = False):
    """A request of ``len(hashes)`` full blocks allocated and cached, as a manager does."""
    request = SimpleNamespace(block_hashes=[_hash(h) for h in hashes])
    blocks = pool.get_new_blocks(len(hashes))
    args = (request, blocks, 0, len(hashes), BLOCK_SIZE, 0)
    if positional:
        pool.cache_full_blocks(*args)
    else:
        pool.cache_full_blocks(request=request, blocks=blocks, num_cached_blocks=0,
                               num_full_blocks=len(hashes), block_size=BLOCK_SIZE,
                               kv_cache_group_id=0)
    return blocks


@pytest.mark.parametrize("positional", [False, True])
def test_cached_blocks_are_stored_with_their_ids_and_parents(pool, positional):
    follower = VllmPoolFollower(pool, block_size=BLOCK_SIZE)
    blocks = _cache(pool, [1, 2, 3], positional=positional)
    ids = [b.block_id for b in blocks]
    assert follower.take_events() == [_stored([1, 2, 3], ids, None)]  # one chain, one event
    assert follower.take_events() == []
    assert sorted(c.block_id for c in follower.snapshot_cached_blocks()) == sorted(ids)


def _with_another_signature(pool: BlockPool) -> None:
    """``pool.cache_full_blocks`` with a parameter vLLM 0.32's lacks: the follower's generic
    wrapper (binding by name) instead of the one with vLLM's own parameters."""
    original = pool.cache_full_blocks

    def cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None, future_option=None):
        return original(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                        kv_cache_group_id, block_mask)

    pool.cache_full_blocks = cache_full_blocks


@pytest.mark.parametrize("signature", ["vllm", "another"])
@pytest.mark.parametrize("positional", [False, True])
def test_blocks_cached_over_two_steps_chain_to_the_first_steps(pool, signature, positional):
    """A prompt cached in chunks: the second call's first block names the first call's last
    hash as its parent (the noted slice's parent), whichever wrapper noted it."""
    if signature == "another":
        _with_another_signature(pool)
    follower = VllmPoolFollower(pool, block_size=BLOCK_SIZE)
    request = SimpleNamespace(block_hashes=[_hash(h) for h in (1, 2, 3, 4)])
    blocks = pool.get_new_blocks(4)
    ids = [b.block_id for b in blocks]
    for start, stop in ((0, 2), (2, 4)):
        if positional:
            pool.cache_full_blocks(request, blocks, start, stop, BLOCK_SIZE, 0)
        else:
            pool.cache_full_blocks(request=request, blocks=blocks, num_cached_blocks=start,
                                   num_full_blocks=stop, block_size=BLOCK_SIZE,
                                   kv_cache_group_id=0)
        assert follower.take_events() == [
            _stored([1, 2] if start == 0 else [3, 4], ids[start:stop], None if start == 0 else 2)]


def test_an_eviction_for_reuse_removes_the_block(pool):
    follower = VllmPoolFollower(pool, block_size=BLOCK_SIZE)
    blocks = _cache(pool, [1, 2])
    follower.take_events()
    pool.free_blocks(reversed(blocks))  # cached, unused: the cold end of the free queue
    assert follower.take_events() == []  # freeing (a finish, a preemption) changes no entry
    pool.get_new_blocks(7)  # every usable block: both cached ones are evicted for reuse
    (removed,) = follower.take_events()
    assert sorted(zip(removed.block_hashes, removed.block_ids, strict=True)) == [
        (_hash(1), blocks[0].block_id), (_hash(2), blocks[1].block_id)]
    assert (removed.medium, removed.group_id) == (None, 0)
    assert follower.snapshot_cached_blocks() == []


def test_a_copy_on_write_move_is_reported_as_a_move(pool):
    follower = VllmPoolFollower(pool, block_size=BLOCK_SIZE)
    _, child = _cache(pool, [1, 2])
    follower.take_events()
    (dst,) = pool.get_new_blocks(1)
    pool.move_block_hashes(child, dst)  # vLLM emits no KV event for this
    assert follower.take_events() == [_removed([2], [child.block_id]),
                                      _stored([2], [dst.block_id], 1)]


def test_reset_prefix_cache_clears_and_what_comes_after_is_stored(pool):
    follower = VllmPoolFollower(pool, block_size=BLOCK_SIZE)
    blocks = _cache(pool, [1, 2])
    follower.take_events()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    (block,) = _cache(pool, [5])
    assert follower.take_events() == [AllBlocksCleared(medium=None),
                                      _stored([5], [block.block_id], None)]


def test_a_finer_hash_granularity_than_the_block_is_refused():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK_SIZE)
    with pytest.raises(KVTransferConfigError, match="index_url: vLLM hashes blocks every 4"):
        VllmPoolFollower(pool, block_size=2 * BLOCK_SIZE)
