"""A step's block-pool events as the holder's ``BlockHashDelta`` (scheduler half -> worker half).

The worker half cannot read the scheduler half's block pool; it mirrors the prefix-cache identity
of its blocks from these deltas (``holder.HeldBlockHashes``), so a pull found through the block
index is served only while the block still holds the hash the requester expects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .metadata import BlockHashDelta

__all__ = ["hash_delta_of"]


def hash_delta_of(events: Iterable[Any]) -> BlockHashDelta:
    """The prefix-cache identity changes a step's block events describe. Every block that lost
    a hash this step is in ``removed`` (applied before the forward); a block whose last event is
    a store is in ``stored`` with that hash (applied after the forward), its group kept: the
    holder compares ``BlockHashWithGroupId`` values."""
    cleared = False
    removed: list[int] = []
    stored: dict[int, bytes] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            cleared, removed, stored = True, [], {}
        elif isinstance(event, BlockRemoved):
            removed.extend(event.block_ids)
            for block_id in event.block_ids:
                stored.pop(block_id, None)
        elif isinstance(event, BlockStored):
            suffix = make_block_hash_with_group_id(b"", event.group_id)  # once per event
            stored.update(zip(event.block_ids, [h + suffix for h in event.block_hashes],
                              strict=True))
    return BlockHashDelta(
        cleared=cleared,
        removed_block_ids=removed,
        stored_block_ids=list(stored),
        stored_hashes=list(stored.values()),
    )
