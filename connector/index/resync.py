"""A node's whole cached set as one publish batch (a resync, ``protocol.py``).

After a gap in a node's publishes (Redis down or restarted empty, a batch dropped or timed out)
the index is wrong about the node until it re-publishes everything it holds. The set comes from
``BlockPool.snapshot_cached_blocks`` (the pool's documented snapshot API); what a snapshot lacks
is each hash's parent, which the Redis backend needs to keep its runs from block 0. A block's
parent hash never changes (a hash names its whole prefix), so ``ParentMirror`` learns it from
the node's ``BlockStored`` events and forgets it when the last block holding the hash is gone.

Owner: the caller thread of ``IndexClient.publish`` (the engine thread); nothing here is shared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlock

__all__ = ["ParentMirror"]


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
        """The events that make an index say exactly ``cached``: ``AllBlocksCleared``, then
        one ``BlockStored`` per entry, parents before children (the Redis backend extends a
        run only from a parent it already holds). An entry whose parent is unknown (never seen
        stored) is published without one; a lookup can then meet it only at block 0, where no
        other block's hash appears, so it costs a miss, never a wrong hit."""
        table = self._hash_to_parent
        depth: dict[bytes, int] = {}

        def depth_of(block_hash: bytes) -> int:
            chain: list[bytes] = []
            node: bytes | None = block_hash
            while node is not None and node not in depth:
                chain.append(node)
                known = table.get(node)
                node = None if known is None else known[0]
                if len(chain) > len(table) + 1:
                    break  # a cycle cannot happen for real hashes; never loop on one
            base = -1 if node is None or node not in depth else depth[node]
            for i, h in enumerate(reversed(chain)):
                depth[h] = base + 1 + i
            return depth[block_hash]

        ordered = sorted(cached, key=lambda entry: depth_of(entry.block_hash))
        events: list[Any] = [AllBlocksCleared(medium=None)]
        for entry in ordered:
            known = table.get(entry.block_hash)
            parent, medium = (None, None) if known is None else (known[0], known[1])
            events.append(
                BlockStored(
                    block_hashes=[entry.block_hash],
                    parent_block_hash=parent,
                    token_ids=[],
                    block_size=block_size,
                    lora_name=None,
                    medium=medium,
                    group_id=entry.group_id,
                    block_ids=[entry.block_id],
                )
            )
        return events
