"""``KVCacheBlock`` metadata and the intrusive ``FreeKVCacheBlockQueue``.

Block objects are created once per pool and carry their own free-list links, so allocating and
freeing create no Python objects and a cached block sitting in the middle of the free queue is
taken out in O(1) when a request hits it (seed 000, "为什么不用 Python deque";
vllm/v1/core/kv_cache_utils.py). The queue has a fake head and a fake tail so no operation
branches on an empty list. A block is on at most one queue; only the queue touches its links.

Queue order is the eviction order: ``popleft`` takes the next victim, ``append`` puts a block
last (kept longest), ``prepend`` puts it first (reused first).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .block_hash import BlockHashWithGroupId

__all__ = ["FreeKVCacheBlockQueue", "KVCacheBlock"]


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical KV block id and its bookkeeping.

    ``block_id`` indexes the KV tensors (``pool.blocks[i].block_id == i``); ``ref_cnt`` counts the
    requests holding it; ``block_hash`` is its prefix-cache key (``BlockHashWithGroupId``: block
    hash plus 4-byte group id) or None; the two links are owned by ``FreeKVCacheBlockQueue``;
    ``is_null`` marks the pool's placeholder block 0. Identity equality (``eq=False``).
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The block's prefix-cache key, or None. Setting it on a block that already has one
        raises RuntimeError (``reset_hash`` first)."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise RuntimeError(
                f"block {self.block_id} already has a hash; reset_hash() before re-hashing"
            )
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the prefix-cache identity (the caller also removes the map entry)."""
        self._block_hash = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self._block_hash is not None}, prev={prev_id}, next={next_id}"
            f"{', null' if self.is_null else ''})"
        )


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Built from ``blocks`` in the given order (block id order at pool start). All operations are
    O(1) per block. Corrupt use (removing a block that is not queued, queueing a queued block,
    popping more than ``num_free_blocks``) raises: ValueError for the count, RuntimeError naming
    the block for link corruption.
    """

    __slots__ = ("fake_free_list_head", "fake_free_list_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels carry block_id -1 so they can never be mistaken for a pool block.
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first block. Raises ValueError when empty."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise ValueError("no free blocks")
        nxt = block.next_free_block
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks in queue order. ValueError if n > free."""
        if n > self.num_free_blocks or n < 0:
            raise ValueError(f"cannot pop {n} blocks: {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        append = out.append
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            append(block)  # type: ignore[arg-type]
            nxt = block.next_free_block  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None  # type: ignore[union-attr]
            block = nxt
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits. RuntimeError if it is not queued."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue (ref_cnt="
                               f"{block.ref_cnt})")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` last (evicted last). RuntimeError if it is already queued."""
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` last, keeping their order. RuntimeError naming a block already queued."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        count = 0
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise RuntimeError(f"block {block.block_id} is already in the free queue")
            block.prev_free_block = last
            last.next_free_block = block  # type: ignore[union-attr]
            last = block
            count += 1
        last.next_free_block = tail  # type: ignore[union-attr]
        tail.prev_free_block = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` first, keeping their order (``blocks[0]`` is popped next).
        RuntimeError if a block is already linked into the queue."""
        head = self.fake_free_list_head
        first = head.next_free_block
        prev = head
        count = 0
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise RuntimeError(f"block {block.block_id} is already in the free queue")
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev  # type: ignore[union-attr]
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every queued block, first to last (O(n); for tests and integrity checks)."""
        out: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not None and block is not tail:
            out.append(block)
            block = block.next_free_block
        return out
