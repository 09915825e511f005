"""The trace replay's store tier: a real ``StoreCache`` fed with the nodes' evicted blocks and
pulled from like any holder (``kvbridge-replay --store-blocks N``, ``pull`` policy).

docs/architecture.md, "Life of a store offload and restore": cold cached blocks are written to
a store node before they are evicted, the index records the store as a holder, and a later
request pulls them back. The replay models the ``offload: "evict"`` writer
(``connector/store/planner.py``: it writes cold cached blocks, the free queue's head, before
``get_new_blocks`` reuses them) at the last moment it may write a block: a node's
``BlockRemoved`` of a hashed block. In the replay every ``BlockRemoved`` is such a reuse (it
never calls ``evict_blocks``, whose removals drop blocks of a failed load: not worth keeping);
``reset_prefix_cache`` records ``AllBlocksCleared``, not ``BlockRemoved``, and writes nothing.
``offload`` puts those hashes before the node's events are published, so the index lists the
store as a holder before it drops the node: it never lacks a block's last holder.

What a node writes is decided by a real ``OffloadPlanner`` per node (policy ``evict``), fed
with that node's KV events in order: ``plan_evicted`` names an evicted block's ancestors that
the store is not known to hold and the node still caches, root first, then the block (a chain's
head, such as the trace's shared first block, is hot and never evicted, and the store publishes
only chains it holds back to block 0), with the planner's memory: a block this node wrote
(reported held) is not written again by it while remembered (its last ``num_remembered``
writes: ``replay_trace.py``'s default is the store's blocks / nodes, each writer's share, as a
node configured with that ``offload_remember_blocks``; and any write of a block it has cached
ever since), unless a later put's reply names
it as a missing ancestor (the store dropped it since: ``GroupPutResult.missing_ancestors``), as
on a real node, whose planner then writes it in its next step if the node still caches it
(``OffloadPlanner.plan_due``, ``num_rewritten_blocks``: here in the node's next ``offload``
call, one round per call, so a chain whose d nearest ancestors the store dropped takes d
calls). The replay has no ``blocks_per_step`` limit: a block and its ancestors go in the put of
the eviction's step. Parents come
from the planner (``BlockStored`` events: the first hash's parent is the event's
``parent_block_hash``, block 0's is ``b""``, the cache's ``ROOT_PARENT``; each next hash's is
the one before).

The store is what ``connector/store/node.py`` runs: a ``StoreCache`` (LRU keeping a chain's
head at least as recent as its descendants, one layer of float16 ``[num_store_blocks + 1, 2,
block_size, 1, 1]``, written from zeros: the replay has no KV bytes) registered in the index as
its own node with its own incarnation, whose events (a block is published once its chain back
to block 0 is held, ``cache.py``) are published with default tier ``"store"`` as the store
node's ``IndexClient`` does. A pull from the store checks the prefix with ``block_id_of`` and
reads it through ``StoreCache.validate``, the store's real read check (it touches the blocks'
LRU order and their ancestors'); the read guard is 0 (the simulated pull lands within the
step).

Owner: the replay's one thread; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from kvbridge.connector.index import BlockIndex, new_incarnation
from kvbridge.connector.store import OffloadItem, OffloadOutcome, OffloadPlanner, StoreCache
from kvbridge.kvmanager import BlockPool, BlockRemoved

from .report import ReplayResult

__all__ = ["ReplayStore"]

_GROUP_ID = 0  # the replay's nodes have one KV cache group


class ReplayStore:
    """One simulated store node of ``num_store_blocks`` blocks, registered in ``index`` as
    ``node_id`` (a fresh incarnation, alive for ``ttl_s``); each writer's planner remembers its
    last ``num_remembered`` writes as held (``offload_remember_blocks``, connector/config.py).

    Counters: ``num_offloaded_blocks`` blocks written that were new to the store (evicted
    blocks and their ancestors), of which ``num_ancestor_blocks`` ancestors;
    ``num_present_blocks`` written again while still held (touched only);
    ``num_dropped_blocks`` the store's own LRU evictions; ``num_rewritten_blocks`` blocks a
    put's reply named as missing ancestors that the node wrote again (with their own
    ancestors); ``num_unknown_parent`` evicted blocks
    skipped because no ``BlockStored`` named their parent (none in a replay: a node caches a
    block, with its event, before it can evict it).

    Raises:
        ValueError: ``num_store_blocks``, ``block_size`` or ``num_remembered`` below 1.
    """

    def __init__(
        self, index: BlockIndex, node_id: str, *, num_store_blocks: int, block_size: int,
        ttl_s: float, num_remembered: int,
    ) -> None:
        if min(num_store_blocks, block_size, num_remembered) < 1:
            raise ValueError(
                f"num_store_blocks, block_size and num_remembered must be >= 1, got "
                f"{num_store_blocks}, {block_size}, {num_remembered}"
            )
        self.num_remembered = num_remembered
        self.index = index
        self.node_id = node_id
        self.incarnation = new_incarnation()
        kv_cache = torch.zeros(num_store_blocks + 1, 2, block_size, 1, 1, dtype=torch.float16)
        self.cache = StoreCache([[kv_cache]], read_guard_s=0.0)
        self._zeros = torch.zeros(1, 0, 2, block_size, 1, 1, dtype=torch.float16)
        self._planners: dict[str, OffloadPlanner] = {}  # node id -> its writer's planner
        self.num_offloaded_blocks = 0
        self.num_ancestor_blocks = 0
        self.num_present_blocks = 0
        self.num_dropped_blocks = 0
        self.num_rewritten_blocks = 0
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

    def offload(self, node_id: str, block_pool: BlockPool, events: Iterable[object]) -> None:
        """Feed node ``node_id``'s KV ``events`` (in recorded order) to its planner and write
        what it plans for every block they remove (``OffloadPlanner.plan_evicted``, against
        the node's ``block_pool`` as it is after the events) and what is due (named missing by
        an earlier put: ``OffloadPlanner.plan_due``), then publish the store's index events and
        report the outcomes to the planner. Call it with a node's events before
        publishing them. Mutates the planner, the store and the index."""
        planner = self._planners.get(node_id)
        if planner is None:  # the per-step limits do not apply here (see the module docstring)
            planner = OffloadPlanner(policy="evict", blocks_per_step=1, scan_blocks=1,
                                     max_offloaded=self.num_remembered)
            self._planners[node_id] = planner
        items: list[OffloadItem] = []
        for event in events:
            if isinstance(event, BlockRemoved):  # planned before its removal is observed
                for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                    block_hash = bytes(block_hash)
                    if planner.parent_of(_GROUP_ID, block_hash) is None:
                        self.num_unknown_parent += 1
                        continue
                    chain = planner.plan_evicted(block_pool, block_id, _GROUP_ID, block_hash)
                    self.num_ancestor_blocks += sum(
                        self.cache.block_id_of(_GROUP_ID, item.block_hash) is None
                        for item in chain[:-1]
                    )
                    items.extend(chain)
            planner.observe((event,))
        # What earlier puts named missing (and the node still caches), in this put as a real
        # planner's next step plans it before anything else: one round a step.
        due = planner.plan_due(block_pool)
        self.num_rewritten_blocks += len(due)
        items += due
        if items:
            self._put(planner, items)

    def _put(self, planner: OffloadPlanner, items: list[OffloadItem]) -> None:
        """Write ``items`` (one put), report the outcomes to ``planner`` as the worker does
        (the missing ancestors named, marked ``missing``), publish the store's events."""
        if self._zeros.shape[1] < len(items):
            self._zeros = torch.zeros(
                1, 2 * len(items), *self._zeros.shape[2:], dtype=self._zeros.dtype
            )
        put = self.cache.put(
            _GROUP_ID, [item.block_hash for item in items], [item.parent_hash for item in items],
            self._zeros[:, : len(items)],
        )
        if put.refused:  # only a read guard refuses, and it is 0 here
            raise RuntimeError(f"store {self.node_id} refused {len(put.refused)} blocks")
        planner.apply_outcomes(OffloadOutcome(_GROUP_ID, item.block_hash, True) for item in items)
        planner.apply_outcomes(
            OffloadOutcome(_GROUP_ID, h, False, True) for h in put.missing_ancestors
        )
        self.num_offloaded_blocks += put.num_stored
        self.num_present_blocks += put.num_present
        self.num_dropped_blocks += put.num_dropped
        if put.events:
            self.index.publish(self.node_id, self.incarnation, put.events, default_tier="store")

    def report_to(self, result: ReplayResult) -> None:
        """Copy the store's counts into a policy's ``result`` (at the end of a replay)."""
        result.num_offloaded_blocks = self.num_offloaded_blocks
        result.num_ancestor_blocks = self.num_ancestor_blocks
        result.num_store_dropped_blocks = self.num_dropped_blocks
        result.num_store_rewritten_blocks = self.num_rewritten_blocks
        result.num_store_present_blocks = self.num_present_blocks
        result.num_store_held_blocks = self.num_held_blocks
        result.num_store_listed_blocks = self.num_listed_blocks

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
