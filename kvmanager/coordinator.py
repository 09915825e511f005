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

``PrefixHitRule`` is that rule on its own, over any source of cached blocks with
``BlockPool``'s lookup methods: the cross-node block index applies it to what one holder
publishes, so a remote hit obeys exactly the local coordinator's rule.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from .block_hash import BlockHash, BlockHashListWithBlockSize
from .block_pool import BlockPool
from .kv_cache_block import KVCacheBlock
from .kv_cache_spec import KVCacheConfig, KVCacheSpec
from .request import Request
from .single_type_managers import (
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    manager_class_for_spec,
)

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "PrefixHitRule",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
]

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


class CachedBlockSource(Protocol):
    """What a hit search reads of a ``BlockPool`` (the managers' ``find_longest_cache_hit``)."""

    null_block: KVCacheBlock

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None: ...

    def get_cached_prefix(
        self, block_hashes: Sequence[BlockHash], kv_cache_group_ids: Sequence[int], max_blocks: int
    ) -> tuple[list[KVCacheBlock], ...]: ...


class _GroupSearch(NamedTuple):
    """One caching group's part of a hit search: its manager class (whose classmethod
    ``find_longest_cache_hit`` is the group's rule), spec, id, and a hashes view."""

    manager_class: type[SingleTypeKVCacheManager]
    kv_cache_spec: KVCacheSpec
    kv_cache_group_id: int
    hashes_for_group: object  # Callable[[Sequence[BlockHash]], Sequence[BlockHash]]


def _find_longest_common_hit(
    search_order: Sequence[_GroupSearch],
    num_groups: int,
    block_hashes: Sequence[BlockHash],
    max_cache_hit_length: int,
    block_pool: CachedBlockSource,
    alignment_tokens: int,
) -> tuple[BlocksPerGroup, int]:
    """The longest length every group of ``search_order`` restores (shrink the candidate until
    all agree), and each group's blocks for it; groups not searched get empty lists. Pure."""
    result: BlocksPerGroup = tuple([] for _ in range(num_groups))
    if not search_order:
        return result, 0
    hit_length = max_cache_hit_length // alignment_tokens * alignment_tokens
    found: dict[int, list[KVCacheBlock]] = {}
    while True:
        candidate = hit_length
        for group in search_order:
            blocks = group.manager_class.find_longest_cache_hit(
                group.hashes_for_group(block_hashes),  # type: ignore[operator]
                candidate,
                (group.kv_cache_group_id,),
                block_pool,  # type: ignore[arg-type]
                group.kv_cache_spec,
                alignment_tokens,
            )[0]
            found[group.kv_cache_group_id] = blocks
            candidate = min(candidate, len(blocks) * group.kv_cache_spec.block_size)
        if candidate == hit_length:
            break
        hit_length = candidate  # some group cannot restore this far: ask everyone again
    for group in search_order:
        blocks = found[group.kv_cache_group_id]
        del blocks[hit_length // group.kv_cache_spec.block_size :]
        result[group.kv_cache_group_id].extend(blocks)
    return result, hit_length


def _search_order_of(groups: Sequence[_GroupSearch]) -> tuple[_GroupSearch, ...]:
    """Caching groups, full attention first (downward-closed hits prune fastest)."""
    searchable = [g for g in groups if g.manager_class.supports_prefix_caching]
    searchable.sort(key=lambda g: not issubclass(g.manager_class, FullAttentionManager))
    return tuple(searchable)


class PrefixHitRule:
    """The hybrid coordinator's hit rule for a KV cache configuration, over any
    ``CachedBlockSource`` (a ``BlockPool``, or one holder's entries in a block index).

    Args:
        kv_cache_config: the node's groups (their specs decide each group's rule).
        hash_block_size: granularity of the hashes passed in (default: the gcd of the groups'
            block sizes); divides every group's block size (ValueError otherwise).

    Attributes: ``alignment_tokens`` (the lcm of the caching groups' block sizes; hit lengths
    are multiples of it), ``full_attention_group_ids`` (groups whose hit is every block from
    block 0), ``only_full_attention`` (every caching group is full attention: the hit is the
    longest run held from block 0 in every group). Immutable; safe from any thread.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, hash_block_size: int | None = None) -> None:
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ValueError("kv_cache_config has no KV cache group")
        hash_block_size = hash_block_size or math.gcd(*(g.kv_cache_spec.block_size for g in groups))
        self.num_groups = len(groups)
        order: list[_GroupSearch] = []
        for group_id, group in enumerate(groups):
            spec = group.kv_cache_spec
            if spec.block_size % hash_block_size:
                raise ValueError(
                    f"group {group_id}: block size {spec.block_size} is not a multiple of the "
                    f"hash block size {hash_block_size}"
                )
            order.append(_GroupSearch(
                manager_class_for_spec(spec), spec, group_id,
                _hashes_view(hash_block_size, spec.block_size),
            ))
        self._search_order = _search_order_of(order)
        sizes = [g.kv_cache_spec.block_size for g in self._search_order]
        self.alignment_tokens = math.lcm(*sizes) if sizes else 1
        self.full_attention_group_ids = tuple(
            g.kv_cache_group_id
            for g in self._search_order
            if issubclass(g.manager_class, FullAttentionManager)
        )
        self.only_full_attention = len(self.full_attention_group_ids) == len(self._search_order)

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        block_pool: CachedBlockSource,
    ) -> tuple[BlocksPerGroup, int]:
        """Hit blocks per group and the hit length in tokens, as
        ``HybridKVCacheCoordinator.find_longest_cache_hit`` finds them in ``block_pool``
        (null blocks where a group needs no block). Pure."""
        return _find_longest_common_hit(
            self._search_order, self.num_groups, block_hashes, max_cache_hit_length,
            block_pool, self.alignment_tokens,
        )


def _hashes_view(hash_block_size: int, block_size: int) -> object:
    if hash_block_size == block_size:
        return lambda block_hashes: block_hashes
    return lambda hashes: BlockHashListWithBlockSize(hashes, hash_block_size, block_size)


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
        self._search_order = _search_order_of([
            _GroupSearch(type(m), m.kv_cache_spec, m.kv_cache_group_id, m.block_hashes_for_group)
            for m in self.single_type_managers
        ])
        sizes = [g.kv_cache_spec.block_size for g in self._search_order]
        self.alignment_tokens = math.lcm(*sizes) if sizes else 1

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        return _find_longest_common_hit(
            self._search_order, len(self.single_type_managers), block_hashes,
            max_cache_hit_length, self.block_pool, self.alignment_tokens,
        )


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
