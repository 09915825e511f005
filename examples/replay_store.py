"""The trace replay's store tier: a real ``StoreCache`` fed with the nodes' evicted blocks and
pulled from like any holder (``examples/replay_trace.py --store-blocks N``, ``pull`` policy).

DESIGN.md ("One disaggregated request", the store tier): cold cached blocks are written to a
store node before they are evicted, the index records the store as a holder, and a later
request pulls them back. The replay models the ``offload: "evict"`` writer
(``connector/store/planner.py``: it writes cold cached blocks, the free queue's head, before
``get_new_blocks`` reuses them) at the last moment it may write a block: a node's
``BlockRemoved`` of a hashed block. In the replay every ``BlockRemoved`` is such a reuse (it
never calls ``evict_blocks``, whose removals drop blocks of a failed load: not worth keeping);
``reset_prefix_cache`` records ``AllBlocksCleared``, not ``BlockRemoved``, and writes nothing.
``offload`` puts those hashes before the node's events are published, so the index lists the
store as a holder before it drops the node: it never lacks a block's last holder.

The store is what ``connector/store/node.py`` runs: a ``StoreCache`` (LRU, one layer of
float16 ``[num_store_blocks + 1, 2, block_size, 1, 1]``, written from zeros: the replay has no
KV bytes) registered in the index as its own node with its own incarnation, whose events (a
block is published once its chain back to block 0 is held, ``cache.py``) are published with
default tier ``"store"`` as the store node's ``IndexClient`` does. A put names each block's
parent, learned from the nodes' ``BlockStored`` events (the first hash's parent is the event's
``parent_block_hash``, block 0's is ``b""``, the cache's ``ROOT_PARENT``; each next hash's is
the one before). A pull from the store checks the prefix with ``block_id_of`` and reads it
through ``StoreCache.validate``, the store's real read check (it touches the blocks' LRU
order); the read guard is 0 (the simulated pull lands within the step).

Owner: the replay's one thread; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from kvbridge.connector.index import BlockIndex, new_incarnation
from kvbridge.connector.store import StoreCache
from kvbridge.kvmanager import BlockRemoved, BlockStored

__all__ = ["ReplayStore"]

_ROOT_PARENT = b""  # StoreCache's parent of block 0 (connector/store/cache.py, ROOT_PARENT)
_GROUP_ID = 0  # the replay's nodes have one KV cache group


class ReplayStore:
    """One simulated store node of ``num_store_blocks`` blocks, registered in ``index`` as
    ``node_id`` (a fresh incarnation, alive for ``ttl_s``).

    Counters: ``num_offloaded_blocks`` evicted blocks written (new to the store),
    ``num_present_blocks`` written again while still held (touched only),
    ``num_dropped_blocks`` the store's own LRU evictions, ``num_unknown_parent`` evicted blocks
    skipped because no ``BlockStored`` named their parent (none in a replay: a node caches a
    block, with its event, before it can evict it).

    Raises:
        ValueError: ``num_store_blocks`` or ``block_size`` below 1.
    """

    def __init__(
        self, index: BlockIndex, node_id: str, *, num_store_blocks: int, block_size: int,
        ttl_s: float,
    ) -> None:
        if num_store_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_store_blocks and block_size must be >= 1, got {num_store_blocks}, "
                f"{block_size}"
            )
        self.index = index
        self.node_id = node_id
        self.incarnation = new_incarnation()
        kv_cache = torch.zeros(num_store_blocks + 1, 2, block_size, 1, 1, dtype=torch.float16)
        self.cache = StoreCache([[kv_cache]], read_guard_s=0.0)
        self._zeros = torch.zeros(1, 0, 2, block_size, 1, 1, dtype=torch.float16)
        # Every hash a node cached -> its parent. A hash commits to its parent's, so one map
        # serves all nodes (the real planner keeps its own node's).
        self._parent_of: dict[bytes, bytes] = {}
        self.num_offloaded_blocks = 0
        self.num_present_blocks = 0
        self.num_dropped_blocks = 0
        self.num_unknown_parent = 0
        index.register_node(node_id, self.incarnation, ttl_s=ttl_s)

    @property
    def num_store_blocks(self) -> int:
        return self.cache.num_store_blocks

    @property
    def num_held_blocks(self) -> int:
        return self.cache.num_held()

    @property
    def num_listed_blocks(self) -> int:
        """Blocks the index lists for the store (0 if it has none or is unavailable): only
        blocks whose chain back to block 0 the store holds are published. O(entries)."""
        return len(self.index.node_entries(self.node_id) or ())

    def offload(self, events: Iterable[object]) -> None:
        """Learn parents from one node's KV ``events`` (in recorded order) and write every
        block they remove to the store, then publish the store's index events. Call it with a
        node's events before publishing them. Mutates the store and the index."""
        block_hashes: list[bytes] = []
        parent_hashes: list[bytes] = []
        for event in events:
            if isinstance(event, BlockStored):
                parent = bytes(event.parent_block_hash or _ROOT_PARENT)
                for block_hash in event.block_hashes:
                    self._parent_of[bytes(block_hash)] = parent
                    parent = bytes(block_hash)
            elif isinstance(event, BlockRemoved):
                for block_hash in map(bytes, event.block_hashes):
                    parent = self._parent_of.get(block_hash)
                    if parent is None:
                        self.num_unknown_parent += 1
                        continue
                    block_hashes.append(block_hash)
                    parent_hashes.append(parent)
        if not block_hashes:
            return
        if self._zeros.shape[1] < len(block_hashes):
            self._zeros = torch.zeros(
                1, 2 * len(block_hashes), *self._zeros.shape[2:], dtype=self._zeros.dtype
            )
        put = self.cache.put(
            _GROUP_ID, block_hashes, parent_hashes, self._zeros[:, : len(block_hashes)]
        )
        if put.refused:  # only a read guard refuses, and it is 0 here
            raise RuntimeError(f"store {self.node_id} refused {len(put.refused)} blocks")
        self.num_offloaded_blocks += put.num_stored
        self.num_present_blocks += put.num_present
        self.num_dropped_blocks += put.num_dropped
        if put.events:
            self.index.publish(self.node_id, self.incarnation, put.events, default_tier="store")

    def held_prefix(self, block_hashes: Sequence[bytes], max_blocks: int) -> int:
        """How many of ``block_hashes[:max_blocks]`` the store holds from block 0 on (what a
        pull from it may read; no LRU touch). Pure."""
        num_held = 0
        for block_hash in block_hashes[:max_blocks]:
            if self.cache.block_id_of(_GROUP_ID, block_hash) is None:
                break
            num_held += 1
        return num_held

    def read(self, block_hashes: Sequence[bytes]) -> None:
        """Serve a pull of ``block_hashes`` (all held: ``held_prefix`` said so this step): the
        store's read check, which touches them (LRU). RuntimeError if one is not held."""
        block_ids = [self.cache.block_id_of(_GROUP_ID, h) or 0 for h in block_hashes]
        bad = self.cache.validate(_GROUP_ID, block_ids, block_hashes)
        if bad:
            raise RuntimeError(
                f"store {self.node_id}: {len(bad)} of {len(block_hashes)} pulled blocks not held"
            )

    def check_integrity(self) -> None:
        """RuntimeError unless the store holds at most ``num_store_blocks`` blocks, each in its
        own block of ``[1, num_store_blocks]``. Pure (no LRU touch)."""
        block_ids = {self.cache.block_id_of(_GROUP_ID, h) for h in self.cache.lru_hashes(_GROUP_ID)}
        num_held = self.num_held_blocks
        if num_held > self.num_store_blocks or len(block_ids) != num_held or not block_ids <= set(
            range(1, self.num_store_blocks + 1)
        ):
            raise RuntimeError(
                f"store {self.node_id}: {num_held} hashes held in {len(block_ids)} distinct "
                f"blocks, capacity {self.num_store_blocks}"
            )
