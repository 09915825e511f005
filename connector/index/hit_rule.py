"""A holder's remote hit under the local coordinator's rule (sliding window, Mamba, hybrids).

``longest_prefix`` without a rule asks for the longest run held from block 0 in every group
(full attention). A node with a sliding-window group keeps only the blocks its window reads, so
that run is often 0 where the node's own cache restores the whole prompt. With a
``kvmanager.PrefixHitRule`` the backends read which of the prompt's blocks each holder holds in
each group and hand them to :func:`hit_of_holder`, which runs the rule (the same code as
``HybridKVCacheCoordinator.find_longest_cache_hit``) over a ``CachedBlockSource`` view of those
entries. docs/architecture.md, "Hybrid hits"; vLLM: ``vllm/v1/core/kv_cache_coordinator.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvbridge.kvmanager import KVCacheBlock, PrefixHitRule

from .protocol import RANK_TO_TIER, Tier

__all__ = ["HeldEntries", "RuleHit", "hit_of_holder"]

# group id -> lookup key (block hash cut to key_hash_bytes) -> (block id, tier rank)
HeldEntries = Mapping[int, Mapping[bytes, tuple[int, int]]]


class RuleHit(NamedTuple):
    """``num_blocks`` the rule restores (0: none); ``block_ids[group][i]`` the holder's block
    for position i (0, the null block, where the rule needs none); ``tier`` the slowest tier
    among the blocks needed."""

    num_blocks: int
    block_ids: tuple[tuple[int, ...], ...]
    tier: Tier


class _HolderView:
    """``CachedBlockSource`` over one holder's entries: a held key answers a ``KVCacheBlock``
    with the holder's block id (a throwaway object: only its id and null flag are read)."""

    def __init__(self, held: HeldEntries, key_len: int) -> None:
        self._held = held
        self._key_len = key_len
        self.null_block = KVCacheBlock(block_id=0)
        self.null_block.is_null = True

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        key = block_hash[: self._key_len]
        found = []
        for group_id in kv_cache_group_ids:
            entry = self._held.get(group_id, {}).get(key)
            if entry is None:
                return None
            found.append(KVCacheBlock(block_id=entry[0]))
        return found

    def get_cached_prefix(
        self, block_hashes: Sequence[bytes], kv_cache_group_ids: Sequence[int], max_blocks: int
    ) -> tuple[list[KVCacheBlock], ...]:
        found: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for i in range(min(max_blocks, len(block_hashes))):
            blocks = self.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if blocks is None:
                break
            for out, block in zip(found, blocks, strict=True):
                out.append(block)
        return found


def hit_of_holder(
    rule: PrefixHitRule, block_hashes: Sequence[bytes], held: HeldEntries, key_len: int,
    block_size: int,
) -> RuleHit:
    """What ``rule`` restores of ``block_hashes`` (at ``block_size``) from one holder's
    ``held`` entries. Pure."""
    view = _HolderView(held, key_len)
    blocks, num_tokens = rule.find_longest_cache_hit(
        block_hashes, len(block_hashes) * block_size, view  # type: ignore[arg-type]
    )
    num_blocks = num_tokens // block_size
    if num_blocks == 0:
        return RuleHit(0, (), "device")
    worst = 0
    block_ids: list[tuple[int, ...]] = []
    for group_id, group_blocks in enumerate(blocks):
        ids = tuple(0 if b.is_null else b.block_id for b in group_blocks[:num_blocks])
        ids += (0,) * (num_blocks - len(ids))  # a group the rule does not search
        block_ids.append(ids)
        entries = held.get(group_id, {})
        for pos, block_id in enumerate(ids):
            if block_id:
                entry = entries.get(block_hashes[pos][:key_len])
                if entry is not None:
                    worst = max(worst, entry[1])
    return RuleHit(num_blocks, tuple(block_ids), RANK_TO_TIER[worst])
