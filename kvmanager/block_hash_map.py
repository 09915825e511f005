"""``BlockHashToBlockMap``: the prefix-cache map from a block hash (with its group id) to the
cached block(s) holding it; ``BlockPool`` owns one and is its only writer."""

from __future__ import annotations

from collections.abc import Iterator

from .block_hash import BlockHashWithGroupId
from .kv_cache_block import KVCacheBlock

__all__ = ["BlockHashToBlockMap"]


class BlockHashToBlockMap:
    """Prefix-cache map: ``BlockHashWithGroupId`` key -> the cached block(s) holding it.

    Almost every key is held by exactly one block, so that block is stored as the dict value
    itself: caching a block creates no container object (a per-key inner dict would be one more
    object for the cyclic garbage collector to track and walk, which made allocate+cache+free
    with eviction several times slower; docs/architecture.md, "Design measurements"). Only while
    two or more blocks hold the
    same key (two requests computed the same block at the same time; either serves a hit) is the
    value a ``{block_id: block}`` dict, turned back into the bare block when one is left.
    Source of the behaviour: vllm/v1/core/block_pool.py (``BlockHashToBlockMap``), seed 001
    section 2; this storage is our own.

    ``len()`` is the number of keys; ``blocks()`` walks every (key, block) pair.

    ``BlockPool``'s per-block loops (``cache_full_blocks``, ``get_new_blocks``) do the one-block
    case on ``_entries`` directly (a Python call per block cost as much as the rest of those
    loops) and use ``insert`` / ``pop`` for everything else; nothing else reads ``_entries``.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any one block cached under ``key`` (the first one cached among several), or None.
        Pure."""
        entry = self._entries.get(key)
        if entry is None or entry.__class__ is KVCacheBlock:
            return entry  # type: ignore[return-value]
        return next(iter(entry.values()))  # type: ignore[union-attr]

    def get_blocks(self, key: BlockHashWithGroupId) -> list[KVCacheBlock]:
        """Every block cached under ``key``, in caching order ([] when none). Pure."""
        entry = self._entries.get(key)
        if entry is None:
            return []
        if entry.__class__ is KVCacheBlock:
            return [entry]  # type: ignore[list-item]
        return list(entry.values())  # type: ignore[union-attr]

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """List ``block`` under ``key`` (mutates the map only, not the block). Inserting a block
        already listed under ``key`` changes nothing."""
        entries = self._entries
        entry = entries.setdefault(key, block)  # one lookup in the common (new key) case
        if entry is block:
            return
        if entry.__class__ is KVCacheBlock:
            entries[key] = {entry.block_id: entry, block.block_id: block}  # type: ignore[union-attr]
        else:
            entry[block.block_id] = block  # type: ignore[index]

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id`` from ``key``'s entry and return it; None, changing
        nothing, when ``key`` does not list that block. Mutates the map only."""
        entries = self._entries
        entry = entries.pop(key, None)  # one lookup in the common (single block) case
        if entry is None:
            return None
        if entry.__class__ is KVCacheBlock:
            if entry.block_id == block_id:  # type: ignore[union-attr]
                return entry  # type: ignore[return-value]
            entries[key] = entry
            return None
        block = entry.pop(block_id, None)  # type: ignore[union-attr]
        # At least two blocks were listed; one left goes back to the bare-block form.
        entries[key] = next(iter(entry.values())) if len(entry) == 1 else entry  # type: ignore
        return block

    def clear(self) -> None:
        """Forget every key (the blocks' own hashes are the caller's to reset)."""
        self._entries.clear()

    def blocks(self) -> Iterator[tuple[BlockHashWithGroupId, KVCacheBlock]]:
        """Every (key, block) pair listed, each block once (for integrity checks; O(n))."""
        for key, entry in self._entries.items():
            if entry.__class__ is KVCacheBlock:
                yield key, entry  # type: ignore[misc]
            else:
                for block in entry.values():  # type: ignore[union-attr]
                    yield key, block

    def snapshot_block_ids(self) -> list[tuple[BlockHashWithGroupId, int]]:
        """Every (key, block id) pair at one moment, each block once. Safe from any thread:
        the map and each shared entry are copied by single C-level calls (``list(d.items())``,
        ``list(d)``) that no Python code interrupts (CPython's GIL; the free-threaded build
        locks each dict for its copy). Does not mutate. O(n)."""
        out: list[tuple[BlockHashWithGroupId, int]] = []
        for key, entry in list(self._entries.items()):
            if entry.__class__ is KVCacheBlock:
                out.append((key, entry.block_id))  # type: ignore[union-attr]
            else:
                out.extend((key, block_id) for block_id in list(entry))  # type: ignore[arg-type]
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
