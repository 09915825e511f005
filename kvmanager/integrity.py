"""Invariant checks for a ``BlockPool`` and a ``KVCacheManager`` (called by tests and debug runs).

Each violation raises ``RuntimeError`` naming the block and the numbers that disagree. The checks
walk every block, so they are O(num_blocks + table sizes): not for the hot path. Invariants are
seed 000's "六条必须一直成立的不变量" (1, 2 and the ownership rules) and
docs/architecture.md, "Invariants".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .block_hash import get_group_id

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .single_type_managers import SingleTypeKVCacheManager

__all__ = ["check_manager_integrity", "check_pool_integrity"]


def check_pool_integrity(pool: BlockPool) -> None:
    """Check ids, the null block, the free queue and the hash map of ``pool``.

    * ``blocks[i].block_id == i``; every ``ref_cnt >= 0``;
    * the null block: flagged, ref_cnt 0, no hash, not queued, and the only null block;
    * the free queue is a well-linked chain of exactly ``num_free_blocks`` distinct blocks, each
      with ref_cnt 0; every other non-null block has ref_cnt > 0 and no links;
    * the hash map (``BlockHashToBlockMap``) lists each hashed block once under its own key,
      and nothing else.

    Reads only. Raises RuntimeError at the first violation, naming the block and the numbers
    that disagree (docs/architecture.md, "Invariants"; seed 000's invariants 1 and 2).
    """
    blocks = pool.blocks
    null = pool.null_block
    if not null.is_null or null.ref_cnt != 0 or null.block_hash is not None:
        raise RuntimeError(
            f"null block {null.block_id}: is_null={null.is_null} ref_cnt={null.ref_cnt} "
            f"hashed={null.block_hash is not None}"
        )
    queue = pool.free_block_queue
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    queued: set[int] = set()
    prev = head
    block = head.next_free_block
    while block is not tail:
        if block is None:
            raise RuntimeError(f"free queue broken after block {prev.block_id}: next is None")
        if block.prev_free_block is not prev:
            raise RuntimeError(
                f"block {block.block_id}: prev link {block.prev_free_block!r} != {prev!r}"
            )
        if block.block_id in queued:
            raise RuntimeError(f"block {block.block_id} appears twice in the free queue (cycle)")
        if len(queued) > len(blocks):
            raise RuntimeError(f"free queue longer than the pool ({len(blocks)} blocks)")
        if block.is_null:
            raise RuntimeError(f"null block {block.block_id} is in the free queue")
        if block.ref_cnt != 0:
            raise RuntimeError(f"block {block.block_id} is in the free queue with ref_cnt "
                               f"{block.ref_cnt}")
        queued.add(block.block_id)
        prev = block
        block = block.next_free_block
    if tail.prev_free_block is not prev:
        raise RuntimeError("free queue tail sentinel does not point at the last block")
    if len(queued) != queue.num_free_blocks:
        raise RuntimeError(
            f"free queue holds {len(queued)} blocks but num_free_blocks is {queue.num_free_blocks}"
        )
    cache = pool.cached_block_hash_to_block
    num_hashed = 0
    for i, blk in enumerate(blocks):
        if blk.block_id != i:
            raise RuntimeError(f"pool position {i} holds block {blk.block_id}")
        if blk.ref_cnt < 0:
            raise RuntimeError(f"block {i} has ref_cnt {blk.ref_cnt} < 0")
        if blk.is_null and blk is not null:
            raise RuntimeError(f"block {i} is flagged null but the null block is {null.block_id}")
        if blk is not null and i not in queued:
            if blk.ref_cnt == 0:
                raise RuntimeError(f"block {i} has ref_cnt 0 but is not in the free queue")
            if blk.prev_free_block is not None or blk.next_free_block is not None:
                raise RuntimeError(f"block {i} has free-queue links but is not queued")
        key = blk.block_hash
        if key is not None:
            num_hashed += 1
            if not any(listed is blk for listed in cache.get_blocks(key)):
                raise RuntimeError(f"block {i} has a hash that the prefix-cache map does not list")
    num_listed = 0
    for key, blk in cache.blocks():
        num_listed += 1
        if blk.block_hash != key:
            raise RuntimeError(
                f"prefix-cache map lists block {blk.block_id} under group "
                f"{get_group_id(key)} with a hash the block does not have"
            )
        if not 0 <= blk.block_id < len(blocks) or blocks[blk.block_id] is not blk:
            raise RuntimeError(f"prefix-cache map lists a block {blk.block_id} that is not the "
                               f"pool's block of that id (pool of {len(blocks)} blocks)")
    if num_listed != num_hashed:
        raise RuntimeError(f"prefix-cache map lists {num_listed} blocks, {num_hashed} are hashed")
    if not pool.enable_caching and num_hashed:
        raise RuntimeError(f"caching is off but {num_hashed} blocks are hashed")


def check_manager_integrity(
    pool: BlockPool, single_type_managers: Sequence[SingleTypeKVCacheManager]
) -> None:
    """``check_pool_integrity`` plus: every block's ref_cnt equals the number of request tables
    (over all of a manager's groups, ``single_type_managers``) that hold it, and each request's
    cached-block count fits its table. ``KVCacheManager.check_integrity`` is the usual caller.
    Reads only; RuntimeError at the first violation, with the numbers that disagree."""
    check_pool_integrity(pool)
    holders: Counter[int] = Counter()
    for single in single_type_managers:
        for request_id, req_blocks in single.req_to_blocks.items():
            num_cached = single.num_cached_block.get(request_id, 0)
            if num_cached > len(req_blocks):
                raise RuntimeError(
                    f"request {request_id} group {single.kv_cache_group_id}: {num_cached} cached "
                    f"blocks but a table of {len(req_blocks)}"
                )
            for blk in req_blocks:
                if not blk.is_null:
                    holders[blk.block_id] += 1
    for blk in pool.blocks:
        if not blk.is_null and blk.ref_cnt != holders[blk.block_id]:
            raise RuntimeError(
                f"block {blk.block_id} has ref_cnt {blk.ref_cnt} but {holders[blk.block_id]} "
                f"request tables hold it"
            )
