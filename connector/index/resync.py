"""A node's whole cached set as one publish batch (a resync, ``protocol.py``).

After a gap in a node's publishes (Redis down or restarted empty, a batch dropped or timed out)
the index is wrong about the node until it re-publishes everything it holds. The set comes from
``BlockPool.snapshot_cached_blocks`` (the pool's documented snapshot API); what a snapshot lacks
is each hash's parent, which the Redis backend needs to keep its runs from block 0. A block's
parent hash never changes (a hash names its whole prefix), so ``ParentMirror`` learns it from
the node's ``BlockStored`` events and forgets it when the last block holding the hash is gone.
A pool that knows its blocks' parents itself (vLLM's, through ``PrefixCacheMirror``) builds
the batch with ``resync_events`` and needs no ``ParentMirror``.

Owner: the caller thread of ``IndexClient.publish`` (the engine thread); nothing here is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlock

__all__ = ["ParentMirror", "resync_events"]


class ParentMirror:
    """``block hash -> (parent hash or None, medium, number of cached entries)``, from events."""

    def __init__(self) -> None:
        self._hash_to_parent: dict[bytes, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._hash_to_parent)

    def observe(self, events: Iterable[Any]) -> None:
        """Follow a batch of ``BlockPool`` events, in order."""
        table = self._hash_to_parent
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for block_hash in event.block_hashes:
                    known = table.get(block_hash)
                    if known is None:
                        table[block_hash] = [parent, event.medium, 1]
                    else:
                        known[2] += 1
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    known = table.get(block_hash)
                    if known is not None:
                        known[2] -= 1
                        if known[2] <= 0:
                            del table[block_hash]
            elif isinstance(event, AllBlocksCleared):
                table.clear()

    def resync_events(self, cached: Sequence[CachedBlock], block_size: int) -> list[Any]:
        """``resync_events`` (the module function) with the parents and media observed."""
        table = self._hash_to_parent

        def parent_of(block_hash: bytes) -> bytes | None:
            known = table.get(block_hash)
            return None if known is None else known[0]

        def medium_of(entry: CachedBlock) -> str | None:
            known = table.get(entry.block_hash)
            return None if known is None else known[1]

        return resync_events(cached, parent_of, block_size, medium_of=medium_of,
                             max_chain=len(table) + 1)


def resync_events(cached: Sequence[CachedBlock], parent_of: Callable[[bytes], bytes | None],
                  block_size: int, *,
                  medium_of: Callable[[CachedBlock], str | None] | None = None,
                  max_chain: int) -> list[Any]:
    """The events that make an index say exactly ``cached``: ``AllBlocksCleared``, then one
    ``BlockStored`` per entry, parents before children (the Redis backend extends a run only
    from a parent it already holds). ``parent_of(block_hash)`` is the hash's parent, None when
    unknown (or block 0); an entry whose parent is unknown is published without one: a lookup
    can then meet it only at block 0, where no other block's hash appears, so it costs a miss,
    never a wrong hit. ``medium_of`` names an entry's medium (None: the device tier); a chain
    of parents longer than ``max_chain`` (a cycle, impossible for real hashes) is cut there.
    Caller's thread; nothing is kept."""
    depth: dict[bytes, int] = {}

    def depth_of(block_hash: bytes) -> int:
        chain: list[bytes] = []
        node: bytes | None = block_hash
        while node is not None and node not in depth:
            chain.append(node)
            node = parent_of(node)
            if len(chain) > max_chain:
                break  # never loop on a cycle
        base = -1 if node is None or node not in depth else depth[node]
        for i, h in enumerate(reversed(chain)):
            depth[h] = base + 1 + i
        return depth[block_hash]

    ordered = sorted(cached, key=lambda entry: depth_of(entry.block_hash))
    events: list[Any] = [AllBlocksCleared(medium=None)]
    for entry in ordered:
        events.append(
            BlockStored(
                block_hashes=[entry.block_hash],
                parent_block_hash=parent_of(entry.block_hash),
                token_ids=[],
                block_size=block_size,
                lora_name=None,
                medium=None if medium_of is None else medium_of(entry),
                group_id=entry.group_id,
                block_ids=[entry.block_id],
            )
        )
    return events
