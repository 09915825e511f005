"""KV cache coordinators: one request's needs split across KV cache groups, results joined back.

All groups share one ``BlockPool``. The coordinator makes allocation atomic over groups: capacity
is predicted for every group and summed before anything changes, then every group's hit blocks
are touched before any group takes a new block, since a new block popped for group 0 could be the
not-yet-touched hit block of group 1 (seed 000, "为什么分配要对所有 group 原子化"; seed 001,
section 3; vllm/v1/core/kv_cache_coordinator.py).

* ``KVCacheCoordinatorNoPrefixCache``: caching off; never hits.
* ``UnitaryKVCacheCoordinator``: one group.
* ``HybridKVCacheCoordinator``: several groups; the hit is the longest length every group can
  restore, found by shrinking the candidate until all groups agree (not a plain minimum: sliding
  window and Mamba hits are not downward closed).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

from .block_hash import BlockHash
from .block_pool import BlockPool
from .kv_cache_block import KVCacheBlock
from .kv_cache_spec import KVCacheConfig
from .request import Request
from .single_type_managers import (
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
]

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator(ABC):
    """Fan-out of each manager operation to every group's ``SingleTypeKVCacheManager``.

    Args:
        kv_cache_config: groups and the shared ``num_blocks``.
        max_model_len: longest sequence in tokens.
        enable_caching, enable_kv_cache_events, kv_event_medium: passed to the ``BlockPool``.
        hash_block_size: granularity of ``request.block_hashes``; divides every group's block size.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        kv_event_medium: str | None = None,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            kv_event_medium=kv_event_medium,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, i, hash_block_size)
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    def _tokens_for(
        self, manager: SingleTypeKVCacheManager, num_tokens: int, num_encoder_tokens: int
    ) -> int:
        return num_encoder_tokens if isinstance(manager, CrossAttentionManager) else num_tokens

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
        num_encoder_tokens: int = 0,
    ) -> int:
        """Sum over groups of the blocks the pool must supply (new + evictable hits). Pure."""
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            total += manager.get_num_blocks_to_allocate(
                request_id,
                self._tokens_for(manager, num_tokens, num_encoder_tokens),
                new_computed_blocks[i] if new_computed_blocks else (),
                total_computed_tokens,
            )
        return total

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
    ) -> None:
        """Attach and touch every group's hit blocks (phase 1 of allocation)."""
        for i, manager in enumerate(self.single_type_managers):
            manager.add_local_computed_blocks(
                request_id, new_computed_blocks[i], total_computed_tokens
            )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        total_computed_tokens: int,
        num_encoder_tokens: int = 0,
    ) -> BlocksPerGroup:
        """Extend every group's table to ``num_tokens`` (phase 2). Returns the new blocks."""
        return tuple(
            manager.allocate_new_blocks(
                request_id,
                self._tokens_for(manager, num_tokens, num_encoder_tokens),
                total_computed_tokens,
            )
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the hashes of every group's full blocks up to ``num_computed_tokens``
        (mutates the pool's hash map; a no-op with caching off). Seed 000, "第五步：只缓存可提交的
        位置"."""
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace, in every group, blocks no attention reads again at ``num_computed_tokens``
        by the null block and free them (mutates the tables and the free queue). Seed 000,
        "第三步：先回收永远不会再读的块"."""
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Release every group's blocks of the request, each table in reverse order (mutates
        ref counts and the free queue; unknown ids are a no-op). Seed 001, section 5."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """Each group's table for the request (live lists; empty when unknown)."""
        return tuple(
            manager.req_to_blocks.get(request_id, []) for manager in self.single_type_managers
        )

    def empty_blocks(self) -> BlocksPerGroup:
        """A fresh empty list per group (no hit)."""
        return tuple([] for _ in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        """Hit blocks per group and the hit length in tokens (<= ``max_cache_hit_length``).

        Pure: nothing is touched or allocated (``add_local_computed_blocks`` does that).
        ``block_hashes`` are at ``hash_block_size``. Source: vllm/v1/core/kv_cache_coordinator.py.
        """


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: nothing is hashed into the pool and nothing ever hits."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        return self.empty_blocks(), 0

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """No-op: caching is off."""


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV cache group."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        manager = self.single_type_managers[0]
        blocks = type(manager).find_longest_cache_hit(
            manager.block_hashes_for_group(block_hashes),
            max_cache_hit_length,
            (manager.kv_cache_group_id,),
            self.block_pool,
            manager.kv_cache_spec,
        )
        return blocks, len(blocks[0]) * manager.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups of different kinds or block sizes.

    Hit lengths are multiples of ``alignment_tokens`` (the lcm of the caching groups' block
    sizes). Full-attention groups are searched first (their hits are downward closed, so they
    prune fastest); cross-attention groups are skipped.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        kv_event_medium: str | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            kv_event_medium,
        )
        searchable = [m for m in self.single_type_managers if m.supports_prefix_caching]
        searchable.sort(key=lambda m: not isinstance(m, FullAttentionManager))
        self._search_order = tuple(searchable)
        self.alignment_tokens = math.lcm(*(m.block_size for m in searchable)) if searchable else 1

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        align = self.alignment_tokens
        hit_length = max_cache_hit_length // align * align
        found: dict[int, list[KVCacheBlock]] = {}
        if not self._search_order:
            return self.empty_blocks(), 0
        while True:
            candidate = hit_length
            for manager in self._search_order:
                blocks = type(manager).find_longest_cache_hit(
                    manager.block_hashes_for_group(block_hashes),
                    candidate,
                    (manager.kv_cache_group_id,),
                    self.block_pool,
                    manager.kv_cache_spec,
                    align,
                )[0]
                found[manager.kv_cache_group_id] = blocks
                candidate = min(candidate, len(blocks) * manager.block_size)
            if candidate == hit_length:
                break
            hit_length = candidate  # some group cannot restore this far: ask everyone again
        result = self.empty_blocks()
        for manager in self._search_order:
            blocks = found[manager.kv_cache_group_id]
            del blocks[hit_length // manager.block_size :]
            result[manager.kv_cache_group_id].extend(blocks)
        return result, hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    hash_block_size: int,
    enable_kv_cache_events: bool = False,
    kv_event_medium: str | None = None,
) -> KVCacheCoordinator:
    """No-prefix-cache when caching is off, unitary for one group, hybrid otherwise."""
    if not enable_caching:
        cls: type[KVCacheCoordinator] = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_config.kv_cache_groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(
        kv_cache_config,
        max_model_len,
        enable_caching,
        hash_block_size,
        enable_kv_cache_events,
        kv_event_medium,
    )
