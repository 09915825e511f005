"""KV cache events a ``BlockPool`` records for a cross-node block index.

Shapes follow vLLM's ``vllm/distributed/kv_events.py`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), plus ``group_id`` and ``block_ids`` so that an index can record which block
of which KV cache group holds a hash. Hashes here are plain ``BlockHash`` values (no group id
suffix); the group is the separate ``group_id`` field.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Blocks became findable in the prefix cache.

    ``block_hashes[i]`` is held by ``block_ids[i]``; ``token_ids`` are those blocks' tokens in
    order (``len == len(block_hashes) * block_size``); ``parent_block_hash`` is the hash that
    precedes ``block_hashes[0]`` in the chain (None for the first block of a request).
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    medium: str | None
    group_id: int
    block_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    """Blocks lost their prefix-cache identity (evicted for reuse or by ``evict_blocks``)."""

    block_hashes: list[bytes]
    medium: str | None
    group_id: int
    block_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared:
    """The whole prefix cache of this pool was dropped (``reset_prefix_cache``)."""

    medium: str | None


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
