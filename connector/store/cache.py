"""The store tier's storage: KV tensors shaped like a node's, a hash map and an LRU order.

Per KV cache group ``g`` the store keeps one tensor per layer, ``[num_store_blocks + 1, 2,
block_size, num_kv_heads, head_size]`` (kvbridge.kernels.layout; row 0 is never used, as a node's
null block, so the transport's ``[1, num_blocks)`` id rule holds), a map ``block_hash -> store
block id`` in LRU order (first = coldest) and the chain links the writers sent (``parent_hashes``).

Index visibility. The Redis index records, per entry, how long a run from block 0 the holder had
when it stored the hash (``index/redis_scripts.py``), so a child stored before its parent would
stay invisible. Offloading walks the free queue from its head, where a finished request's *last*
blocks sit (vLLM frees in reverse order), so children usually arrive first. The store therefore
publishes a block only once it is *anchored* (its parent is the chain root or anchored) and, when
a parent arrives, publishes its held descendants after it, parents first. A dropped block is
removed from the index; its descendants stay listed but unreachable (the index cuts a run at a
removed hash) until the block comes back. So that it does come back, a put reports, for its
blocks held but not anchored, the first ancestor the store does not hold
(``GroupPutResult.missing_ancestors``, the put reply's ``missing_ancestors``): the writer's planner
then writes that block again if its pool still caches it (``planner.py``, "Feedback").

Chain recency. A chain is only reachable through its head (the index's runs start at block 0),
so the LRU order keeps every held block at least as recent as each of its held descendants: a
put (stored or present blocks) and a read (the blocks that pass ``validate``) touch the blocks
and all their held ancestors, each block after its descendants, so a shared head (a system
prompt's first block, which a puller never reads because it holds it already) is dropped only
after every block below it. ``_touch_chains`` does it per batch: a walk up from each block
stops at an ancestor this batch already reached, so a batch costs about the blocks it touches
(a chain's head and the path to it are walked once per batch, not once per block). A put that
may have to evict touches the held ancestors of its blocks first as well, so none of them is
the victim that makes room for its own descendants.

Read guard. A read is validated first and its bytes are copied afterwards, chunk by chunk; the
validator stamps the blocks it passes, and a block stamped less than ``read_guard_s`` ago is never
overwritten: if the coldest block is that fresh, the write is refused (no room) instead.

Blocks written in slices. Each rank of a tensor-parallel writer puts its own KV heads of a
block (``put``'s ``heads``; ``slices.py``). A block some of whose heads are written is
*incomplete*: it takes a store block but is not held (never served: ``validate`` refuses it,
never published, never named in ``missing_ancestors``, counted in no ``num_held``) until a put
writes its last heads; then it is stored as a whole put's block would be. A slice of heads
already written is present (not rewritten); one overlapping written heads otherwise (writers of
another head split) is refused by ``head_conflict``, which the store asks before any put. When
room is needed, an incomplete block older than ``incomplete_ttl_s`` (a rank that died or lost
its write) is dropped before any held block, so none pins memory; younger ones are kept, so the
ranks' slices of a full store do not evict one another before they meet.

Not thread-safe: the store's event loop owns it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvbridge.transport import LeaseRef

from .slices import HeadSlice, IncompleteBlock, write_rows

__all__ = ["GroupPutResult", "StoreCache"]

ROOT_PARENT = b""


class GroupPutResult(NamedTuple):
    """``refused``: hashes not stored (no room); ``events``: index events, in order;
    ``num_dropped``: blocks evicted (LRU) to make room; ``missing_ancestors``: for the put's
    blocks held but not anchored after it, the first ancestor not held (each once, in the put's
    order), whose absence keeps them out of the index."""

    num_stored: int
    num_present: int
    refused: tuple[bytes, ...]
    num_dropped: int
    events: tuple[KVCacheEvent, ...]
    missing_ancestors: tuple[bytes, ...] = ()
    num_incomplete: int = 0  # put blocks still lacking other heads ("Blocks written in slices")


@dataclass(slots=True)
class _GroupCache:
    kv_caches: list[torch.Tensor]
    block_nbytes: int  # one block across the group's layers
    hash_to_block_id: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    block_id_to_hash: list[bytes | None] = field(default_factory=list)
    served_at: list[float] = field(default_factory=list)
    free_block_ids: list[int] = field(default_factory=list)
    parent_of: dict[bytes, bytes] = field(default_factory=dict)
    children: dict[bytes, set[bytes]] = field(default_factory=dict)
    anchored: set[bytes] = field(default_factory=set)
    published: set[bytes] = field(default_factory=set)
    incomplete: OrderedDict[bytes, IncompleteBlock] = field(default_factory=OrderedDict)


class StoreCache:
    """Blocks held by hash, per KV cache group, with LRU eviction.

    Args:
        kv_caches_by_group: ``[group][layer]`` tensors ``[num_store_blocks + 1, 2, block_size,
            num_kv_heads, head_size]`` (all groups the same ``num_store_blocks``).
        read_guard_s: a block validated for a read this recently is never overwritten.
        clock: monotonic seconds.
        incomplete_ttl_s: an incomplete block this old is dropped first when room is needed
            (module docstring, "Blocks written in slices").
    """

    def __init__(
        self,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        *,
        read_guard_s: float,
        clock: Callable[[], float] = time.monotonic,
        incomplete_ttl_s: float = 10.0,
    ) -> None:
        if read_guard_s < 0 or incomplete_ttl_s < 0:
            raise ValueError(f"read_guard_s {read_guard_s} and incomplete_ttl_s "
                             f"{incomplete_ttl_s} must be >= 0")
        self.read_guard_s, self.incomplete_ttl_s = read_guard_s, incomplete_ttl_s
        self._clock = clock
        self.block_size = int(kv_caches_by_group[0][0].shape[2])
        self.groups: list[_GroupCache] = []
        for caches in kv_caches_by_group:
            num_rows = int(caches[0].shape[0])
            if num_rows < 2:
                raise ValueError(f"a store group needs >= 1 block besides row 0, got {num_rows}")
            block_nbytes = sum(int(c[0].numel()) * c.element_size() for c in caches)
            self.groups.append(
                _GroupCache(
                    kv_caches=list(caches),
                    block_nbytes=block_nbytes,
                    block_id_to_hash=[None] * num_rows,
                    served_at=[float("-inf")] * num_rows,
                    free_block_ids=list(range(num_rows - 1, 0, -1)),  # pop() gives 1 first
                )
            )

    @property
    def num_store_blocks(self) -> int:
        return len(self.groups[0].block_id_to_hash) - 1

    def num_held(self, group_id: int | None = None) -> int:
        groups = self.groups if group_id is None else [self.groups[group_id]]
        return sum(len(g.hash_to_block_id) for g in groups)

    def num_incomplete(self, group_id: int) -> int:
        """Blocks of ``group_id`` some but not all of whose heads are written."""
        return len(self.groups[group_id].incomplete)

    def head_conflict(self, group_id: int, block_hashes: Sequence[bytes],
                      heads: HeadSlice | None) -> str | None:
        """Why a put of ``heads`` of ``block_hashes`` cannot be assembled with what group
        ``group_id`` holds (an incomplete block whose written heads overlap ``heads`` without
        being them), or None. Mutates nothing."""
        incomplete = self.groups[group_id].incomplete
        if heads is None or heads.whole or not incomplete:
            return None
        for block_hash in block_hashes:
            block = incomplete.get(block_hash)
            run = None if block is None else block.conflict(heads.start, heads.stop)
            if run is not None:
                return (f"heads [{heads.start}, {heads.stop}) of block {block_hash.hex()[:16]} "
                        f"overlap its heads [{run[0]}, {run[1]}) written by another writer; "
                        "writers of one store must split the KV heads alike")
        return None

    def block_id_of(self, group_id: int, block_hash: bytes) -> int | None:
        """The store block holding ``block_hash`` in ``group_id`` (no LRU touch)."""
        return self.groups[group_id].hash_to_block_id.get(block_hash)

    def lru_hashes(self, group_id: int) -> list[bytes]:
        """Held hashes of ``group_id``, coldest first."""
        return list(self.groups[group_id].hash_to_block_id)

    def resync_events(self) -> list[KVCacheEvent]:
        """What the index should say of this store, as a resync's events (``IndexClient.
        set_resync_events``): ``AllBlocksCleared``, then one ``BlockStored`` per held, anchored
        block, parents before children, each with the parent its writer sent."""
        events: list[KVCacheEvent] = [AllBlocksCleared(medium=None)]
        for group_id, group in enumerate(self.groups):
            stack = [h for h in group.anchored if group.parent_of[h] == ROOT_PARENT]
            while stack:
                current = stack.pop()
                events.append(self._stored_event(group_id, current))
                stack.extend(c for c in group.children.get(current, ()) if c in group.anchored)
        return events

    def _stored_event(self, group_id: int, block_hash: bytes) -> BlockStored:
        group = self.groups[group_id]
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=group.parent_of[block_hash] or None,
            token_ids=[],  # the store never sees tokens; the index does not need them
            block_size=self.block_size,
            lora_name=None,
            medium=None,
            group_id=group_id,
            block_ids=[group.hash_to_block_id[block_hash]],
        )

    # ------------------------------------------------------------------ writes
    def put(
        self,
        group_id: int,
        block_hashes: Sequence[bytes],
        parent_hashes: Sequence[bytes],
        staging: torch.Tensor,
        heads: HeadSlice | None = None,
    ) -> GroupPutResult:
        """Store ``block_hashes[i]`` with bytes ``staging[:, i]`` (mutates the tensors, the map,
        the LRU order). A hash already held is touched, not rewritten. The stored and present
        blocks and their held ancestors end up the most recent, each after its descendants
        (module docstring, "Chain recency").

        Args:
            staging: ``[num_layers, n, 2, block_size, num_kv_heads, head_size]``, the caches'
                dtype, on CPU (the ``gather_blocks`` layout); with ``heads`` of part of the
                model's, ``[num_layers, n, row bytes of those heads]`` (uint8).
            heads: the KV heads ``staging`` holds of each block (None: every head); module
                docstring, "Blocks written in slices".

        Raises:
            ValueError: ``group_id`` out of range, lengths that disagree, or heads that
                ``head_conflict`` names (the caller checks network input first and reports it
                to the writer).
        """
        if not 0 <= group_id < len(self.groups):
            raise ValueError(f"group_id {group_id} not in [0, {len(self.groups)})")
        if len(block_hashes) != len(parent_hashes) or staging.shape[1] != len(block_hashes):
            raise ValueError(
                f"{len(block_hashes)} hashes, {len(parent_hashes)} parents, "
                f"staging holds {staging.shape[1]} blocks"
            )
        conflict = self.head_conflict(group_id, block_hashes, heads)
        if conflict is not None:
            raise ValueError(conflict)
        group = self.groups[group_id]
        events: list[KVCacheEvent] = []
        refused: list[bytes] = []
        block_id_to_row: dict[int, int] = {}
        num_present = num_dropped = 0
        sliced = heads is not None and not heads.whole
        if len(block_hashes) > len(group.free_block_ids):  # may evict: shield the ancestors
            self._touch_chains(group, [*parent_hashes, *block_hashes])
        for row, (block_hash, parent) in enumerate(zip(block_hashes, parent_hashes, strict=True)):
            if block_hash in group.hash_to_block_id:
                group.hash_to_block_id.move_to_end(block_hash)
                num_present += 1
                continue
            block = group.incomplete.get(block_hash)
            if block is not None and sliced and (heads.start, heads.stop) in block.covered:
                num_present += 1  # these heads are written: wait for the others
                continue
            if block is None:
                num_free_before = len(group.free_block_ids)
                block_id = self._take_block(group_id, events)
                num_dropped += int(num_free_before == 0 and block_id is not None)
                if block_id is None:
                    refused.append(block_hash)
                    continue
                if sliced:
                    block = IncompleteBlock(block_id, parent, self._clock())
                    group.incomplete[block_hash] = block
            else:
                block_id = block.block_id
            block_id_to_row[block_id] = row  # a later row may take the block of an earlier one
            if block is not None:  # a slice, or a whole put over an incomplete block
                if sliced:
                    block.covered.append((heads.start, heads.stop))
                    if block.num_covered() < heads.total:
                        continue  # incomplete: not held yet
                del group.incomplete[block_hash]
            self._hold(group_id, block_hash, parent, block_id, events)
        if block_id_to_row:
            rows = list(block_id_to_row.values())
            if rows != list(range(len(block_hashes))):  # some rows skipped or reordered
                staging = staging.index_select(1, torch.tensor(rows, dtype=torch.int64))
            write_rows(group.kv_caches, list(block_id_to_row), staging, heads)
        self._touch_chains(group, block_hashes)  # refused ones are not held: skipped
        num_stored = len(block_hashes) - num_present - len(refused)
        num_incomplete = sum(h in group.incomplete for h in block_hashes) if sliced else 0
        return GroupPutResult(
            num_stored, num_present, tuple(refused), num_dropped, tuple(events),
            self._missing_ancestors(group, block_hashes), num_incomplete,
        )

    def _hold(self, group_id: int, block_hash: bytes, parent: bytes, block_id: int,
              events: list[KVCacheEvent]) -> None:
        """``block_hash`` (every head written) is held in ``block_id``: mapped, linked to its
        parent, anchored and published if its chain reaches block 0."""
        group = self.groups[group_id]
        group.hash_to_block_id[block_hash] = block_id
        group.block_id_to_hash[block_id] = block_hash
        group.parent_of[block_hash] = parent
        group.children.setdefault(parent, set()).add(block_hash)
        if parent == ROOT_PARENT or parent in group.anchored:
            self._anchor(group_id, block_hash, events)

    @staticmethod
    def _missing_ancestors(group: _GroupCache, block_hashes: Sequence[bytes]) -> tuple[bytes, ...]:
        """For each held, unanchored hash of ``block_hashes``: walk up its held ancestors to
        the first parent not held, and name it (each once). A walk stops at a block an earlier
        walk of this call passed, so the call costs about the unanchored blocks it reaches."""
        missing: dict[bytes, None] = {}
        seen: set[bytes] = set()
        for current in block_hashes:
            while current not in seen and current in group.hash_to_block_id:
                if current in group.anchored:
                    break
                seen.add(current)
                parent = group.parent_of[current]
                if parent == ROOT_PARENT:  # held first blocks are anchored: not reached
                    break
                if parent in group.incomplete:  # its other heads are on their way
                    break
                if parent not in group.hash_to_block_id:
                    missing[parent] = None
                    break
                current = parent
        return tuple(missing)

    @staticmethod
    def _touch_chains(group: _GroupCache, block_hashes: Sequence[bytes]) -> None:
        """Move the held ``block_hashes`` and all their held ancestors to the recent end of
        ``group``'s LRU order, every block after its held descendants among them (so the
        chain heads come last). Unheld hashes are skipped. O(blocks moved): each walk up stops
        at a block this call reached already; then Kahn's order, children before parents."""
        held, parent_of = group.hash_to_block_id, group.parent_of
        # reached block -> its reached children not moved yet (-1: moved); insertion-ordered
        pending: dict[bytes, int] = {}
        for block_hash in block_hashes:
            if block_hash in pending or block_hash not in held:
                continue
            pending[block_hash] = 0
            current = block_hash
            while (parent := parent_of[current]) in held:  # ROOT_PARENT is never held
                if parent in pending:
                    pending[parent] += 1
                    break
                pending[parent] = 1
                current = parent
        move_to_end = held.move_to_end
        for block_hash in list(pending):
            current = block_hash
            while pending.get(current) == 0:  # every reached child moved: move it, go up
                move_to_end(current)
                pending[current] = -1
                current = parent_of[current]
                if current in pending:
                    pending[current] -= 1

    def _take_block(self, group_id: int, events: list[KVCacheEvent]) -> int | None:
        group = self.groups[group_id]
        if group.free_block_ids:
            return group.free_block_ids.pop()
        if group.incomplete:  # the oldest incomplete block, if stale, goes first
            block_hash, block = next(iter(group.incomplete.items()))
            if self._clock() - block.since >= self.incomplete_ttl_s:
                del group.incomplete[block_hash]
                return block.block_id
        if not group.hash_to_block_id:
            return None
        coldest_hash, block_id = next(iter(group.hash_to_block_id.items()))
        if self._clock() - group.served_at[block_id] < self.read_guard_s:
            return None  # possibly still being copied out by a read: never overwrite it
        self._drop(group_id, coldest_hash, events)
        return group.free_block_ids.pop()

    def _drop(self, group_id: int, block_hash: bytes, events: list[KVCacheEvent]) -> None:
        group = self.groups[group_id]
        block_id = group.hash_to_block_id.pop(block_hash)
        group.block_id_to_hash[block_id] = None
        group.free_block_ids.append(block_id)
        parent = group.parent_of.pop(block_hash)
        siblings = group.children.get(parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del group.children[parent]
        if block_hash in group.published:
            group.published.discard(block_hash)
            events.append(
                BlockRemoved(
                    block_hashes=[block_hash], medium=None, group_id=group_id, block_ids=[block_id]
                )
            )
        # Descendants lose their anchor (the index cuts their runs at this hash).
        stack = [block_hash]
        while stack:
            current = stack.pop()
            if current in group.anchored or current == block_hash:
                group.anchored.discard(current)
                stack.extend(group.children.get(current, ()))

    def _anchor(self, group_id: int, block_hash: bytes, events: list[KVCacheEvent]) -> None:
        """Anchor ``block_hash`` and every held, unanchored descendant; publish them, parents
        before children (depth-first)."""
        group = self.groups[group_id]
        stack = [block_hash]
        while stack:
            current = stack.pop()
            if current in group.anchored or current not in group.hash_to_block_id:
                continue
            group.anchored.add(current)
            group.published.add(current)
            events.append(self._stored_event(group_id, current))
            stack.extend(group.children.get(current, ()))

    # ------------------------------------------------------------------ reads
    def validate(
        self,
        group_id: int,
        block_ids: Sequence[int],
        expected_hashes: Sequence[bytes],
        lease: LeaseRef | None = None,
    ) -> list[int]:
        """Positions whose store block does not hold the expected hash (an empty expected hash
        never passes: the store serves by hash only, so a read's ``lease`` is ignored: the store
        grants none). Passing blocks are stamped for the read guard and touched (LRU), with
        their held ancestors after them (not stamped: they are not read); module docstring,
        "Chain recency". A ``transport.BlockValidator``; runs on the transport's loop thread."""
        if not 0 <= group_id < len(self.groups):
            return list(range(len(block_ids)))
        group = self.groups[group_id]
        now = self._clock()
        bad: list[int] = []
        passed: list[bytes] = []
        for pos, (block_id, expected) in enumerate(zip(block_ids, expected_hashes, strict=True)):
            held = group.block_id_to_hash[block_id] if 0 < block_id < len(group.served_at) else None
            if not expected or held != expected:
                bad.append(pos)
                continue
            group.served_at[block_id] = now
            passed.append(expected)
        self._touch_chains(group, passed)
        return bad
