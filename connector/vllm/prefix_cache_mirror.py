"""What one engine's prefix cache holds, as kvbridge's block-pool events (pure; no vLLM import).

vLLM's ``BlockPool`` keeps its prefix cache in one map, ``BlockHashWithGroupId`` (the block hash
plus 4 big-endian bytes of the KV cache group id) -> the block(s) holding it. The pool follower
(``pool_follower.py``) reports each change of that map here as it happens, inside the scheduler
step, at the cost of one append:

    record_insert(key, block_id)     the map now maps ``key`` to ``block_id`` (maybe another too)
    record_pop(key, block_id)        the map no longer maps ``key`` to ``block_id``
    record_clear()                   the map was emptied (``reset_prefix_cache``)
    record_parents(hashes, ...)      the parents of the hashes a request is about to cache

``take_events(holds, block_of)`` turns what changed since the last call into the events kvbridge's
own ``BlockPool.take_events`` would have given, ``BlockStored`` / ``BlockRemoved`` with block ids
and ``AllBlocksCleared``, so that the scheduler half's hash deltas (``block_events.py``), the index
client's publishes and its resyncs work on vLLM's pool unchanged. The result is exact at the moment
of the call: it compares what was last reported (``_block_of_key``) with the map itself, only for
the keys that lost a block since (``record_pop``), so a key stored and evicted within one step costs
nothing and a key that moved to another block (vLLM's copy-on-write ``move_block_hashes``) is
reported as moved. A key that gained a block and lost none is not looked up in the map: every
change of the map passes through the two recorded methods, so a key not reported at the last call
and popped from no block since was absent then, and the map names it with the first block it was
inserted with (vLLM keeps a key's blocks in insertion order). The work of a call is proportional to
the keys that changed, never to the size of the cache.

One block per key is published (the first the map names): the index needs one holder block per
hash and node; a second block holding the same key (vLLM does not de-duplicate) is published only
when the first loses it.

Order of a batch (the worker half applies removals before the step's forward and stores after it,
``holder.HeldBlockHashes``): ``AllBlocksCleared`` if the map was emptied, then every removal (one
``BlockRemoved`` per KV cache group), then
the stores in the order their keys were first inserted (a request caches its blocks in position
order, so a parent comes before its child, which the Redis index needs to extend a run). Stores
that follow one another in that order form one ``BlockStored`` while each key's parent is the hash
before it in the same group (one event per run of a request's blocks, as vLLM's own events; a
``BlockStored``'s hashes are one chain: ``kvmanager.kv_events``).

Owner: the engine thread (vLLM's scheduler thread); nothing here is shared.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlock
from kvbridge.kvmanager.block_hash import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

_GROUP_ID_BYTES = len(make_block_hash_with_group_id(b"", 0))  # the key's group id suffix

__all__ = ["PrefixCacheMirror"]


class PrefixCacheMirror:
    """The prefix cache as last reported, and the changes since.

    Args:
        block_size: tokens per block (the ``block_size`` of the events).
    """

    def __init__(self, *, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._block_of_key: dict[bytes, int] = {}  # key -> the block reported as holding it
        self._parent_of_key: dict[bytes, bytes | None] = {}  # reported keys' parent hashes
        self._new_parents: dict[bytes, bytes | None] = {}  # since the last take
        self._new_hashes: dict[bytes, bytes] = {}  # their keys' block hashes
        self._new_groups: set[int] = set()  # their groups
        self._inserted: dict[bytes, int] = {}  # key -> first block inserted since the last take
        self._popped: list[tuple[bytes, int]] = []  # (key, block id) popped since, in order
        self._cleared = False

    def __len__(self) -> int:
        """Keys reported as held."""
        return len(self._block_of_key)

    # ------------------------------------------------------------------ recording (in the step)
    def record_insert(self, key: bytes, block_id: int) -> None:
        self._inserted.setdefault(key, block_id)

    def record_pop(self, key: bytes, block_id: int) -> None:
        self._popped.append((key, block_id))

    @property
    def recorders(self) -> tuple[Callable[[bytes, int], Any], Callable[[tuple[bytes, int]], Any]]:
        """``record_insert`` and ``record_pop`` as the bound C methods they come down to
        (``insert(key, block_id)``, ``pop((key, block_id))``), valid for the mirror's life: the
        map's ``insert`` and ``pop`` run inside vLLM's step once per block, so they call these
        without a Python frame of their own."""
        return self._inserted.setdefault, self._popped.append

    def record_clear(self) -> None:
        """The map was emptied: every change recorded before is superseded."""
        self._cleared = True
        self._inserted.clear()
        self._popped.clear()

    def record_parents(
        self, block_hashes: Sequence[bytes], start: int, stop: int, group_id: int
    ) -> None:
        """Blocks ``start .. stop - 1`` of a request whose hashes are ``block_hashes`` (one per
        block, from block 0) are about to be cached in ``group_id``: the parent of block ``i``
        is ``block_hashes[i - 1]`` (none for block 0). A hash names its whole prefix, so its
        parent never changes; a recorded key that is not then inserted is forgotten at the
        next ``take_events``."""
        stop = min(stop, len(block_hashes))
        start = max(start, 0)
        if start >= stop:
            return
        suffix = make_block_hash_with_group_id(b"", group_id)
        hashes = block_hashes[start:stop]
        parents = [block_hashes[start - 1] if start > 0 else None, *hashes[:-1]]
        keys = [h + suffix for h in hashes]
        self._new_parents.update(zip(keys, parents, strict=True))
        self._new_hashes.update(zip(keys, hashes, strict=True))
        self._new_groups.add(group_id)

    # ------------------------------------------------------------------ the step's batch
    def take_events(
        self,
        holds: Callable[[bytes, int], bool],
        block_of: Callable[[bytes], int | None],
    ) -> list[Any]:
        """The events that bring the last report up to the map as it is now, and forget the
        recorded changes.

        Args:
            holds: ``holds(key, block_id)``: the map maps ``key`` to ``block_id`` now.
            block_of: ``block_of(key)``: a block the map maps ``key`` to now, or None.

        Returns:
            kvbridge KV events (``kvbridge.kvmanager.kv_events``): a ``BlockRemoved`` per group,
            a ``BlockStored`` per run of stores that make one chain (see the module docstring),
            ``medium`` None (the engine's device tier).
        """
        events: list[Any] = []
        reported = self._block_of_key
        if self._cleared:
            events.append(AllBlocksCleared(medium=None))
            reported.clear()
            self._parent_of_key.clear()
            self._cleared = False
        inserted, popped_in_order = self._inserted, self._popped
        if not popped_in_order and self._only_new_chains():
            self._take_new_chains(events)
            return events
        removed: list[bytes] = []  # their parents are kept until the stores below are done
        # (key, first block inserted since the last take or None): the keys that gained a block,
        # then those that only lost one
        touched: Iterable[tuple[bytes, int | None]] = inserted.items()
        popped: dict[bytes, int] = {}  # keys that lost a block (empty: none did)
        if popped_in_order:
            popped = self._take_removals(events, removed)
            touched = itertools.chain(touched, ((key, None) for key in popped
                                                if key not in inserted))
        run = _Run(self.block_size, events)
        new_parents, parent_of_key = self._new_parents, self._parent_of_key
        for key, first_block_id in touched:
            block_id = reported.get(key)
            if block_id is not None:
                if holds(key, block_id):
                    continue  # still where it was reported
                # Lost without a recorded pop: the map changed behind the follower's back.
                del reported[key]
                removed.append(key)
                run.flush()
                events.append(self._removed(key, block_id))
                block_id = block_of(key)
            elif first_block_id is None or key in popped:
                block_id = block_of(key)
            else:  # gained a block, lost none, not reported: the first one it gained
                block_id = first_block_id
            if block_id is None:
                continue
            parent = new_parents[key] if key in new_parents else parent_of_key.get(key)
            reported[key] = block_id
            parent_of_key[key] = parent
            run.add(key, block_id, parent)
        run.flush()
        for key in removed:
            if key not in reported:
                parent_of_key.pop(key, None)
        inserted.clear()
        self._popped.clear()
        self._forget_parents()
        return events

    def _only_new_chains(self) -> bool:
        """True when every key that gained a block since the last take was not reported and
        had its parent noted by ``record_parents``, in one group (a step that only cached new
        blocks: the usual one). Set operations on the keys, no Python loop."""
        inserted = self._inserted
        return len(self._new_groups) <= 1 and self._block_of_key.keys().isdisjoint(inserted) \
            and inserted.keys() <= self._new_parents.keys()

    def _take_new_chains(self, events: list[Any]) -> None:
        """``take_events`` when nothing was popped and ``_only_new_chains``: each key is
        reported with the first block it gained and the parent ``record_parents`` noted, the
        stores cut into chains as ``_Run`` cuts them, with C-level list and map operations
        rather than a loop body per key (this runs inside vLLM's ``schedule()``)."""
        inserted = self._inserted
        keys = list(inserted)
        if keys:
            (group_id,) = self._new_groups
            block_ids = list(inserted.values())
            parents = list(map(self._new_parents.__getitem__, keys))
            hashes = list(map(self._new_hashes.__getitem__, keys))
            self._block_of_key.update(inserted)
            self._parent_of_key.update(zip(keys, parents, strict=True))
            # a chain goes on while a key's parent is the hash before it
            cuts = list(itertools.compress(range(1, len(keys)), map(
                operator.ne, itertools.islice(parents, 1, None), hashes)))
            for start, stop in zip([0, *cuts], [*cuts, len(keys)], strict=True):
                events.append(BlockStored(
                    block_hashes=hashes[start:stop], parent_block_hash=parents[start],
                    token_ids=[], block_size=self.block_size, lora_name=None, medium=None,
                    group_id=group_id, block_ids=block_ids[start:stop]))
        inserted.clear()
        self._forget_parents()  # (those of blocks never inserted too)

    def _forget_parents(self) -> None:
        self._new_parents.clear()
        self._new_hashes.clear()
        self._new_groups.clear()

    def _take_removals(self, events: list[Any], removed: list[bytes]) -> dict[bytes, int]:
        """The recorded pops that removed a reported block, as ``BlockRemoved`` events (one per
        group) appended to ``events``, their keys to ``removed``; returns every popped key (in
        first-pop order)."""
        reported = self._block_of_key
        popped: dict[bytes, int] = {}
        gone: dict[bytes, tuple[list[bytes], list[int]]] = {}  # group suffix -> hashes, ids
        for key, block_id in self._popped:
            popped[key] = block_id
            if reported.get(key) == block_id:
                del reported[key]
                removed.append(key)
                hashes, block_ids = gone.setdefault(key[-_GROUP_ID_BYTES:], ([], []))
                hashes.append(key[:-_GROUP_ID_BYTES])
                block_ids.append(block_id)
        events.extend(
            BlockRemoved(block_hashes=hashes, medium=None, group_id=get_group_id(suffix),
                         block_ids=block_ids)
            for suffix, (hashes, block_ids) in gone.items()
        )
        return popped

    def snapshot_cached_blocks(self) -> list[CachedBlock]:
        """Every key reported as held and its block: the state the events taken so far describe
        (the index client's resync source, read on this thread after a step)."""
        return [
            CachedBlock(get_block_hash(key), get_group_id(key), block_id)
            for key, block_id in self._block_of_key.items()
        ]

    @staticmethod
    def _removed(key: bytes, block_id: int) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=[get_block_hash(key)],
            medium=None,
            group_id=get_group_id(key),
            block_ids=[block_id],
        )


class _Run:
    """The stores of one ``take_events``, gathered into ``BlockStored`` events of one chain each
    (a key joins the run when its parent is the run's last hash in the same group)."""

    __slots__ = ("_block_ids", "_block_size", "_events", "_hashes", "_parent", "_suffix")

    def __init__(self, block_size: int, events: list[Any]) -> None:
        self._block_size = block_size
        self._events = events
        self._suffix = b""
        self._hashes: list[bytes] = []
        self._block_ids: list[int] = []
        self._parent: bytes | None = None

    def add(self, key: bytes, block_id: int, parent: bytes | None) -> None:
        hashes = self._hashes
        if not hashes or parent != hashes[-1] or not key.endswith(self._suffix):
            self.flush()
            self._suffix, self._parent = key[-_GROUP_ID_BYTES:], parent
            hashes = self._hashes
        hashes.append(key[:-_GROUP_ID_BYTES])
        self._block_ids.append(block_id)

    def flush(self) -> None:
        """End the run: its ``BlockStored`` (if it holds a block) goes to the events."""
        if not self._hashes:
            return
        self._events.append(BlockStored(
            block_hashes=self._hashes,
            parent_block_hash=self._parent,
            token_ids=[],
            block_size=self._block_size,
            lora_name=None,
            medium=None,
            group_id=get_group_id(self._suffix),
            block_ids=self._block_ids,
        ))
        self._hashes, self._block_ids = [], []
