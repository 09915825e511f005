"""``BlockPool``: the fixed set of physical KV blocks, their free queue and the prefix-cache map.

Free and evict are different things (seed 001, section 5; vllm/v1/core/block_pool.py):

* *free* is ownership: ``free_blocks`` drops a reference; at zero the block joins the free queue.
  A hashed block stays findable while it waits there (lazy invalidation).
* *evict* is discoverability: the hash entry is dropped, when ``get_new_blocks`` hands the block
  out again (always before it is handed out) or when ``evict_blocks`` is asked to.

Free queue order is the eviction order: unhashed blocks go to the front (reused first, they can
never hit), hashed blocks to the tail (kept longest, LRU-like). Block 0 is the null block: taken
out at start, never hashed, never queued, its ref count never kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from .block_hash import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from .block_hash_map import BlockHashToBlockMap
from .kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .request import Request

__all__ = ["BlockPool", "CachedBlock", "ColdCachedBlock"]


class CachedBlock(NamedTuple):
    """One prefix-cache entry: ``block_hash`` (without the group id) cached in KV cache group
    ``group_id`` by block ``block_id``."""

    block_hash: BlockHash
    group_id: int
    block_id: int


class ColdCachedBlock(NamedTuple):
    """A cached block no request holds (ref_cnt 0, in the free queue, still findable by its
    hash): ``block_id`` and its prefix-cache key (block hash plus group id)."""

    block_id: int
    block_hash_with_group_id: BlockHashWithGroupId


class BlockPool:
    """``num_gpu_blocks`` blocks shared by every KV cache group of one node.

    Args:
        num_gpu_blocks: total block ids including the null block 0 (>= 1).
        enable_caching: keep a prefix-cache map (otherwise hashes are never stored).
        hash_block_size: token granularity of ``request.block_hashes`` (informational here;
            ``cache_full_blocks`` receives hashes already at the group's block size).
        enable_kv_cache_events: record events for ``take_events``.
        kv_event_medium: the ``medium`` field of recorded events.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int | None = None,
        enable_kv_cache_events: bool = False,
        kv_event_medium: str | None = None,
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1 (block 0 is the null block), "
                             f"got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_medium = kv_event_medium
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # key -> cached block(s); two requests that computed the same block at the same time
        # each hold a copy with the same hash, and either serves a hit.
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []

    # -- lookup -------------------------------------------------------------------------------
    def get_block(self, block_id: int) -> KVCacheBlock:
        """The block with id ``block_id``. ValueError when out of range."""
        if not 0 <= block_id < self.num_gpu_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_gpu_blocks})")
        return self.blocks[block_id]

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group in ``kv_cache_group_ids`` for ``block_hash``, or None if
        any group misses (every requested group must hit; seed 001, section 2). Pure."""
        found: list[KVCacheBlock] = []
        get_one_block = self.cached_block_hash_to_block.get_one_block
        for group_id in kv_cache_group_ids:
            block = get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            found.append(block)
        return found

    def get_cached_prefix(
        self, block_hashes: Sequence[BlockHash], kv_cache_group_ids: Sequence[int], max_blocks: int
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest run ``block_hashes[0:k]`` (k <= ``max_blocks``) cached in every group, as
        one block list per group: ``get_cached_block`` in a loop that stops at the first miss,
        with the group suffixes built once (the full-attention hit search). Pure."""
        get_one_block = self.cached_block_hash_to_block.get_one_block
        suffixes = [make_block_hash_with_group_id(b"", gid) for gid in kv_cache_group_ids]
        found: tuple[list[KVCacheBlock], ...] = tuple([] for _ in suffixes)
        limit = min(max_blocks, len(block_hashes))
        if len(suffixes) == 1:
            (suffix,), (out,) = suffixes, found
            append = out.append
            for i in range(limit):
                block = get_one_block(block_hashes[i] + suffix)
                if block is None:
                    break
                append(block)
            return found
        for i in range(limit):
            hits = [get_one_block(block_hashes[i] + suffix) for suffix in suffixes]
            if None in hits:
                break
            for out, block in zip(found, hits, strict=True):
                out.append(block)  # type: ignore[arg-type]
        return found

    def iter_cold_cached_blocks(self, max_scan: int) -> Iterator[ColdCachedBlock]:
        """The hashed blocks of the free queue, from its head: the block evicted next comes
        first (the free queue is the LRU eviction order, seed 000 "回收顺序"; offload writes
        blocks out in this order before ``get_new_blocks`` drops their hashes). At most
        ``max_scan`` queue entries are looked at, unhashed ones included (they are skipped).

        Does not mutate. Engine thread only (the pool's owner, which is also the only thread
        that may change the pool); do not change the pool before the iterator is exhausted or
        dropped. ValueError if ``max_scan < 0``.
        """
        if max_scan < 0:
            raise ValueError(f"max_scan must be >= 0, got {max_scan}")
        return self._walk_cold_cached_blocks(max_scan)

    def _walk_cold_cached_blocks(self, max_scan: int) -> Iterator[ColdCachedBlock]:
        tail = self.free_block_queue.fake_free_list_tail
        block = self.free_block_queue.fake_free_list_head.next_free_block
        for _ in range(max_scan):
            if block is None or block is tail:
                return
            if block._block_hash is not None:
                yield ColdCachedBlock(block.block_id, block._block_hash)
            block = block.next_free_block

    # -- caching ------------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes[i]``.

        ``block_hashes`` are at this group's ``block_size``. Null blocks (window padding) are
        skipped; a block already carrying the same key is left alone; a block carrying a
        different key raises RuntimeError (it would make the map lie). Mutates the blocks'
        hashes and the map; records one ``BlockStored`` when events are on. ValueError when
        ``num_full_blocks`` exceeds ``len(blocks)`` or ``len(block_hashes)``, or on a bad group id.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"request {request.request_id}: {num_full_blocks} full blocks but "
                f"{len(blocks)} blocks and {len(block_hashes)} hashes"
            )
        suffix = make_block_hash_with_group_id(b"", kv_cache_group_id)  # ValueError if bad id
        cache = self.cached_block_hash_to_block
        setdefault = cache._entries.setdefault
        # Positions stored by this call, only when events are on (nothing is built otherwise).
        stored_positions: list[int] | None = [] if self.enable_kv_cache_events else None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            key = block_hashes[i] + suffix
            if block._block_hash is not None:
                if block._block_hash != key:
                    raise RuntimeError(
                        f"block {block.block_id} already cached under another hash "
                        f"(request {request.request_id}, position {i})"
                    )
                continue
            block._block_hash = key
            if setdefault(key, block) is not block:  # the key is held already: several blocks
                cache.insert(key, block)
            if stored_positions is not None:
                stored_positions.append(i)
        if stored_positions:
            self._record_stored(request, blocks, block_hashes, stored_positions, block_size,
                                kv_cache_group_id)

    def _record_stored(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        stored_positions: list[int],
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Append one ``BlockStored`` for the blocks at ``stored_positions`` (ascending)."""
        first_stored_pos = stored_positions[0]
        all_token_ids = request.all_token_ids
        stored_tokens: list[int] = []
        for i in stored_positions:
            stored_tokens.extend(all_token_ids[i * block_size : (i + 1) * block_size])
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=[block_hashes[i] for i in stored_positions],
                parent_block_hash=block_hashes[first_stored_pos - 1] if first_stored_pos > 0
                else None,
                token_ids=stored_tokens,
                block_size=block_size,
                lora_name=request.lora_name,
                medium=self.kv_event_medium,
                group_id=kv_cache_group_id,
                block_ids=[blocks[i].block_id for i in stored_positions],
            )
        )

    # -- allocation ---------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, ref_cnt 0 -> 1.

        A block that still has a hash is evicted first (its map entry removed, a BlockRemoved
        recorded) so no later lookup can find content about to be overwritten (seed 000,
        "正确顺序三"). ValueError if fewer blocks are free (the caller checks capacity first);
        RuntimeError if a queued block has references or its hash is missing from the map.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: {self.free_block_queue.num_free_blocks} free"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        pop_entry = None
        for block in ret:
            key = block._block_hash
            if key is not None:
                if pop_entry is None:
                    pop_entry = self.cached_block_hash_to_block._entries.pop
                # One dict operation when the key lists this block alone (the common case).
                entry = pop_entry(key, None)
                if entry is not block:
                    self._evict_from_shared_entry(key, block, entry)
                block._block_hash = None
                if self.enable_kv_cache_events:
                    self._record_removed(key, block.block_id)
            if block.ref_cnt != 0:
                raise RuntimeError(
                    f"block {block.block_id} was in the free queue with ref_cnt {block.ref_cnt}"
                )
            block.ref_cnt = 1
        return ret

    def _evict_from_shared_entry(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, entry: object
    ) -> None:
        """Slow path of ``get_new_blocks``: ``entry`` (popped for ``key``) was not ``block``
        alone; put it back and remove ``block`` from it. RuntimeError if it is not listed."""
        cache = self.cached_block_hash_to_block
        if entry is not None:
            cache._entries[key] = entry  # type: ignore[assignment]
        if cache.pop(key, block.block_id) is None:
            raise RuntimeError(
                f"block {block.block_id} carries a hash the prefix-cache map does not list"
            )

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s hash from the map and the block. True if it had one."""
        key = block._block_hash
        if key is None:
            return False
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            raise RuntimeError(
                f"block {block.block_id} carries a hash the prefix-cache map does not list"
            )
        block._block_hash = None
        if self.enable_kv_cache_events:
            self._record_removed(key, block.block_id)
        return True

    def _record_removed(self, key: BlockHashWithGroupId, block_id: int) -> None:
        """Append one ``BlockRemoved`` for ``block_id`` losing ``key``."""
        self.kv_event_queue.append(
            BlockRemoved(
                block_hashes=[get_block_hash(key)],
                medium=self.kv_event_medium,
                group_id=get_group_id(key),
                block_ids=[block_id],
            )
        )

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each (hit) block; a ref_cnt-0 block leaves the free queue.

        Null blocks are ignored. Source: seed 001, section 3.
        """
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given (eviction) order.

        Blocks reaching ref_cnt 0 join the free queue: unhashed ones at the front, hashed ones at
        the tail, each set keeping ``ordered_blocks`` order (seed 000, "回收顺序"). Null blocks are
        ignored. RuntimeError naming the block if a ref count would go below zero (freed twice).
        """
        without_hash: list[KVCacheBlock] = []
        with_hash: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0:
                raise RuntimeError(
                    f"block {block.block_id} freed with ref_cnt {ref_cnt} (double free)"
                )
            block.ref_cnt = ref_cnt - 1
            if ref_cnt == 1:
                if block._block_hash is None:
                    without_hash.append(block)
                else:
                    with_hash.append(block)
        if without_hash:
            self.free_block_queue.prepend_n(without_hash)
        if with_hash:
            self.free_block_queue.append_n(with_hash)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove the prefix-cache identity of the given blocks, whatever their ref_cnt.

        Ownership and queue position are unchanged (an evicted free block stays where it is;
        it now simply cannot hit). Unhashed blocks are skipped. ValueError on a bad id.
        """
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.get_block(block_id))

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, only when no block is in use (all but the null block free).

        Returns False, changing nothing, when any block is held; True after clearing (records
        ``AllBlocksCleared``). Free queue order is unchanged.
        """
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared(medium=self.kv_event_medium))
        return True

    # -- accounting ---------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks on the free queue (cached-but-unreferenced blocks count as free)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests, in [0, 1]."""
        total = self.num_gpu_blocks - 1
        if total <= 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def snapshot_cached_blocks(self) -> list[CachedBlock]:
        """Every prefix-cache entry (a key held by two blocks is listed once per block).

        Thread-safe: callable from any thread while the owner thread changes the pool (the map
        is read at one moment, ``BlockHashToBlockMap.snapshot_block_ids``). On the owner thread
        between steps it is the state that the events taken so far describe; from another
        thread it may include blocks hashed by a step whose forward has not run yet. Does not
        mutate. O(cached blocks).
        """
        return [
            CachedBlock(get_block_hash(key), get_group_id(key), block_id)
            for key, block_id in self.cached_block_hash_to_block.snapshot_block_ids()
        ]

    def take_events(self) -> list[KVCacheEvent]:
        """Return the recorded events, oldest first, and clear the record."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
