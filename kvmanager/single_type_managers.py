"""Single-type KV cache managers: one per KV cache group, one class per attention kind.

Each manager keeps ``req_to_blocks[request_id]``, the request's logical block table in its group,
and translates token counts into block counts under its own rules (seed 000, "第三层";
vllm/v1/core/single_type_kv_cache_manager.py):

* full attention keeps every block from position 0;
* sliding window keeps only the blocks the window can still read; the others become the null
  block, so table positions stay stable;
* Mamba keeps only the state block at the last block boundary (plus the running block);
* cross attention allocates its encoder blocks once and never caches them.

A request's table in one group, positions in blocks::

    | skipped (null) | owned or hit | external computed | new | lookahead |
    0          num_skipped_blocks                              cdiv(num_tokens, block_size)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from .block_hash import BlockHash, BlockHashListWithBlockSize
from .block_pool import BlockPool
from .kv_cache_block import KVCacheBlock
from .kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from .request import Request

__all__ = [
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (``b >= 1``): blocks needed for ``a`` tokens."""
    return -(-a // b)


class SingleTypeKVCacheManager(ABC):
    """Contract shared by every manager.

    Args:
        kv_cache_spec: the group's spec (its ``block_size`` is the table granularity).
        block_pool: the pool shared by all groups.
        kv_cache_group_id: this group's id (part of every cache key).
        hash_block_size: granularity of ``request.block_hashes`` in tokens; must divide
            ``block_size`` (hashes are merged when it is smaller).
    """

    supports_prefix_caching: bool = True

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        hash_block_size: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.hash_block_size = hash_block_size or self.block_size
        if self.block_size % self.hash_block_size:
            raise ValueError(
                f"group {kv_cache_group_id}: block_size {self.block_size} is not a multiple of "
                f"hash_block_size {self.hash_block_size}"
            )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks [0, num_cached_block[id]) of a request are already in the prefix cache (or
        # null); cache_blocks() starts after them.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    # -- geometry ----------------------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future step reads once ``num_computed_tokens`` are computed."""
        return 0

    def block_hashes_for_group(self, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """``block_hashes`` (at ``hash_block_size``) seen at this group's ``block_size``."""
        if self.hash_block_size == self.block_size:
            return block_hashes
        return BlockHashListWithBlockSize(block_hashes, self.hash_block_size, self.block_size)

    # -- capacity ------------------------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
    ) -> int:
        """Blocks the pool must supply so the request has slots for ``num_tokens`` tokens.

        New blocks for uncovered, non-skipped positions, plus the hit blocks that ``touch`` will
        take off the free queue (ref_cnt 0), since they consume free capacity too (seed 000,
        "第二步"). Pure. ValueError if the request already holds blocks and hits are offered
        (hits attach at first allocation only).
        """
        num_required = cdiv(num_tokens, self.block_size)
        num_owned = len(self.req_to_blocks.get(request_id, ()))
        if num_owned and new_computed_blocks:
            raise ValueError(
                f"request {request_id} already holds {num_owned} blocks in group "
                f"{self.kv_cache_group_id}; prefix hits are only attached at first allocation"
            )
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_covered = max(num_owned + len(new_computed_blocks), num_skipped_blocks)
        num_new = max(num_required - num_covered, 0)
        num_evictable = 0
        for block in new_computed_blocks[num_skipped_blocks:]:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return num_new + num_evictable

    # -- allocation ----------------------------------------------------------------------------
    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
    ) -> None:
        """Attach prefix-hit blocks (first allocation only) and ``touch`` them.

        Hits that fall before the window of ``total_computed_tokens`` are replaced by the null
        block and not touched. Mutates ``req_to_blocks``, ``num_cached_block``, ref counts.
        ValueError if the request already holds blocks in this group.
        """
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        if not new_computed_blocks:
            return
        if req_blocks:
            raise ValueError(
                f"request {request_id} already holds blocks in group {self.kv_cache_group_id}"
            )
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        null = self._null_block
        attached = [
            null if i < num_skipped_blocks else block for i, block in enumerate(new_computed_blocks)
        ]
        self.block_pool.touch(attached)
        req_blocks.extend(attached)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, total_computed_tokens: int = 0
    ) -> list[KVCacheBlock]:
        """Extend the table to ``cdiv(num_tokens, block_size)`` positions; positions before the
        window of ``total_computed_tokens`` get the null block, the rest new pool blocks.

        Returns the new (non-null) blocks in position order. The caller has checked capacity.
        """
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_required = cdiv(num_tokens, self.block_size)
        num_owned = len(req_blocks)
        if num_required <= num_owned:
            return []
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_null = max(min(num_skipped_blocks, num_required) - num_owned, 0)
        if num_null:
            req_blocks.extend([self._null_block] * num_null)
        new_blocks = self.block_pool.get_new_blocks(num_required - num_owned - num_null)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks up to ``num_tokens`` tokens (only those with a
        hash; a request without a block hasher caches nothing)."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        block_hashes = self.block_hashes_for_group(request.block_hashes)
        req_blocks = self.req_to_blocks.get(request_id, [])
        num_full = min(num_tokens // self.block_size, len(block_hashes), len(req_blocks))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=req_blocks,
            block_hashes=block_hashes,
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Return blocks no future step reads, measured from committed ``num_computed_tokens``.

        They become null in the table and are freed last-position first, so the block nearest
        the window is evicted first among them. No-op for full attention.
        """
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        req_blocks = self.req_to_blocks.get(request_id)
        if not req_blocks or num_skipped_blocks == 0:
            return
        null = self._null_block
        removed: list[KVCacheBlock] = []
        for i in range(min(num_skipped_blocks, len(req_blocks)) - 1, -1, -1):
            block = req_blocks[i]
            if block.is_null:
                break  # everything before an already-null position is null too
            removed.append(block)
            req_blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def free(self, request_id: str) -> None:
        """Drop the request's table; blocks are freed in reverse position order (the tail of a
        long prefix is evicted before the head more requests share; seed 000)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # -- prefix hits ---------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Longest restorable prefix of at most ``max_length`` tokens, a multiple of
        ``alignment_tokens`` (default: the block size), as one block list per group id.

        ``block_hashes`` are at ``kv_cache_spec.block_size``. Pure (no touch).
        """


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block from position 0 is kept; a hit is the longest run of cached blocks from the
    start (a miss ends it, later hits do not count: seed 001, section 2)."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        block_size = kv_cache_spec.block_size
        computed = block_pool.get_cached_prefix(
            block_hashes, kv_cache_group_ids, max_length // block_size
        )
        align_blocks = (alignment_tokens or block_size) // block_size
        if align_blocks > 1:
            keep = len(computed[0]) // align_blocks * align_blocks
            for blocks in computed:
                del blocks[keep:]
        return computed


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Only the last ``sliding_window`` tokens are read; earlier blocks become null.

    A hit ending at block ``e`` needs the ``cdiv(sliding_window - 1, block_size)`` blocks before
    ``e`` cached; the search runs from the right and pads everything before with the null block
    (vLLM's rule). With block size 2 and window 4 (2 blocks needed), cached patterns give
    ``TT`` -> 2, ``TTF`` -> 2, ``TTT`` -> 3, ``TTFTFFTTFTTT`` -> 12 blocks.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        hash_block_size: int | None = None,
    ) -> None:
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise ValueError(f"SlidingWindowManager needs a SlidingWindowSpec, got {kv_cache_spec}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, hash_block_size)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token (position num_computed_tokens) reads positions
        # [num_computed_tokens - sliding_window + 1, num_computed_tokens].
        return max(num_computed_tokens - self.sliding_window + 1, 0)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise ValueError(f"needs a SlidingWindowSpec, got {kv_cache_spec}")
        block_size = kv_cache_spec.block_size
        num_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        align_blocks = (alignment_tokens or block_size) // block_size
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        computed = tuple([null] * max_num_blocks for _ in kv_cache_group_ids)
        get_cached_block = block_pool.get_cached_block
        run = 0  # cached blocks in a row ending at run_end (exclusive)
        run_end = max_num_blocks
        for i in range(max_num_blocks - 1, -1, -1):
            cached = get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run, run_end = 0, i
                continue
            for blocks, block in zip(computed, cached, strict=True):
                blocks[i] = block
            run += 1
            if run >= num_needed:
                # Any end e in [i + num_needed, run_end] has a full window cached before it.
                end = run_end // align_blocks * align_blocks
                if end >= i + num_needed:
                    # Positions before i were never visited, so they still hold the null block.
                    for blocks in computed:
                        del blocks[end:]
                    return computed
        # No full window anywhere: the run starting at block 0 is a plain prefix hit.
        end = run // align_blocks * align_blocks if run_end == run else 0
        for blocks in computed:
            del blocks[end:]
        return computed


class MambaManager(SingleTypeKVCacheManager):
    """State blocks: block ``j`` holds the recurrent state after token ``(j + 1) * block_size``.

    Only the block with the state the next step reads is kept (the others become null); a hit
    needs a cached state exactly at its end boundary.
    """

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Keep the block holding token num_computed_tokens - 1 (its state is read next).
        if num_computed_tokens <= 0:
            return 0
        return (num_computed_tokens - 1) // self.block_size * self.block_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        block_size = kv_cache_spec.block_size
        align_blocks = (alignment_tokens or block_size) // block_size
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        for i in range(max_num_blocks - 1, -1, -1):
            if (i + 1) % align_blocks:
                continue
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is not None:
                return tuple([null] * i + [block] for block in cached)
        return tuple([] for _ in kv_cache_group_ids)


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder K/V for cross attention: ``cdiv(num_encoder_tokens, block_size)`` blocks taken
    at the first allocation and kept until the request is freed; never prefix cached."""

    supports_prefix_caching = False

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """No-op: encoder K/V depends on the encoder input, not on a token prefix."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Always empty (coordinators skip this group when searching)."""
        return tuple([] for _ in kv_cache_group_ids)


_SPEC_TO_MANAGER: tuple[tuple[type[KVCacheSpec], type[SingleTypeKVCacheManager]], ...] = (
    (SlidingWindowSpec, SlidingWindowManager),
    (CrossAttentionSpec, CrossAttentionManager),
    (FullAttentionSpec, FullAttentionManager),
    (MambaSpec, MambaManager),
)


def manager_class_for_spec(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for ``kv_cache_spec``'s type. ValueError for an unknown spec."""
    for spec_type, manager_type in _SPEC_TO_MANAGER:
        if isinstance(kv_cache_spec, spec_type):
            return manager_type
    raise ValueError(f"no KV cache manager for spec {kv_cache_spec!r}")


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    block_pool: BlockPool,
    kv_cache_group_id: int,
    hash_block_size: int | None = None,
) -> SingleTypeKVCacheManager:
    """Build the manager that fits ``kv_cache_spec``."""
    cls = manager_class_for_spec(kv_cache_spec)
    return cls(kv_cache_spec, block_pool, kv_cache_group_id, hash_block_size)
