"""What one engine's prefix cache holds, and how it changed (pure; no vLLM import).

vLLM's ``BlockPool`` keeps its prefix cache in one map, ``BlockHashWithGroupId`` (the block hash
plus 4 big-endian bytes of the KV cache group id) -> the block(s) holding it. The pool follower
(``pool_follower.py``) reports each change of that map here as it happens, inside the scheduler
step, at the cost of one append:

    record_insert(key, block_id)     the map now maps ``key`` to ``block_id`` (maybe another too)
    record_pop(key, block_id)        the map no longer maps ``key`` to ``block_id``
    record_clear()                   the map was emptied (``reset_prefix_cache``)
    record_parents(hashes, ...)      a request is about to cache these hashes (noted as a slice)

``take_step(holds, block_of, has_key)``, once a step, inside it, copies the records into a
``StepBatch`` (``pool_changes.py``) whose holder delta goes with the step's orders. Off the step,
the batches are taken in order (``take_changes`` does both at once): each settles what changed
into a ``PoolChanges``, whose ``events`` (the ``BlockStored`` / ``BlockRemoved`` with block ids
and ``AllBlocksCleared`` that kvbridge's own ``BlockPool.take_events`` would give, for the index
client's publishes and resyncs) are built then. So are the stored keys' parent hashes: the
step keeps only the slices of hashes ``record_parents`` was given, and a batch's parents are
worked out when its events are built, or by ``settle``, always before a later take can forget a
parent (a hash names its whole prefix, so a key's parent is the same whenever it is looked up).

The result is exact at the moment of the call: it compares what was last reported
(``_block_of_key``) with the map itself, only for the keys that lost a block since
(``record_pop``), so a key stored and evicted within one step costs nothing and a key that moved
to another block (vLLM's copy-on-write ``move_block_hashes``) is reported as moved. A key that
gained a block and lost none is not looked up in the map: every change of the map passes through
the two recorded methods, so a key not reported at the last call and popped from no block since
was absent then, and the map names it with the first block it was inserted with (vLLM keeps a
key's blocks in insertion order). The work of a call is proportional to the keys that changed,
never to the size of the cache; the usual step (new keys, and evictions of keys no other block
holds) is taken with list and map operations, without a loop body per key.

One block per key is published (the first the map names): the index needs one holder block per
hash and node; a second block holding the same key (vLLM does not de-duplicate) is published only
when the first loses it. Removals come before stores; stores come in the order their keys were
first inserted (a request caches its blocks in position order, so a parent comes before its
child, which the Redis index needs to extend a run).

Owner: the engine thread (vLLM's scheduler thread); nothing here is shared.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvbridge.kvmanager import CachedBlock
from kvbridge.kvmanager.block_hash import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

from ..index.resync import resync_events
from .pool_changes import PoolChanges, StepBatch, StepJournal

__all__ = ["PrefixCacheMirror"]

_MAX_UNSETTLED = 64  # batches whose parents wait for ``settle`` before a take files them itself
_first, _second = operator.itemgetter(0), operator.itemgetter(1)


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
        # batches taken whose stored keys' parents are not yet in _parent_of_key (``settle``)
        self._unsettled: deque[PoolChanges] = deque()
        # since the last take, per ``record_parents``: (hashes, the first one's parent, group id)
        self._noted: list[tuple[Sequence[bytes], bytes | None, int]] = []
        self._untaken: deque[StepBatch] = deque()  # batches whose changes are not taken yet
        self._late_removed_block_ids: list[int] = []  # for the next step's holder delta
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

    @property
    def note_recorder(self) -> Callable[[tuple[Sequence[bytes], bytes | None, int]], Any]:
        """``record_parents`` as the bound C method it comes down to, for a caller that has
        sliced already: ``note((block_hashes[start:stop], block_hashes[start - 1] or None for
        start 0, group_id))``, the slice not empty. Valid for the mirror's life."""
        return self._noted.append

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
        is ``block_hashes[i - 1]`` (none for block 0). Inside the step this only keeps the
        slice (the parents are worked out off it: ``PoolChanges.parents``); a noted key that is
        not then inserted is forgotten at the next take."""
        start = max(start, 0)
        hashes = block_hashes[start:stop]
        if hashes:
            self._noted.append((hashes, block_hashes[start - 1] if start else None, group_id))

    # ------------------------------------------------------------------ the step's batch
    def take_step(
        self,
        holds: Callable[[bytes, int], bool],
        block_of: Callable[[bytes], int | None],
        has_key: Callable[[bytes], bool] | None = None,
    ) -> StepBatch:
        """The changes recorded since the last call, as one step's batch: its holder delta at
        once (``StepBatch.hash_delta``: list copies, nothing looked up), its exact changes
        (``StepBatch.changes``, ``take_changes``'s answer) when first asked for, off the step,
        batches in the order taken. Engine thread, once a step, inside it.

        Args:
            holds: ``holds(key, block_id)``: the map maps ``key`` to ``block_id`` now.
            block_of: ``block_of(key)``: a block the map maps ``key`` to now, or None.
            has_key: ``has_key(key)``: the map maps ``key`` to some block now (a C method,
                e.g. a dict's ``__contains__``; None: ``block_of`` is asked).
        """
        journal = StepJournal(self._cleared, self._inserted.copy(), self._popped.copy(),
                              self._noted.copy(), holds, block_of, has_key)
        self._cleared = False
        self._inserted.clear()
        self._popped.clear()
        self._noted.clear()
        late, self._late_removed_block_ids = self._late_removed_block_ids, []
        batch = StepBatch(journal, self._take_through, late)
        self._untaken.append(batch)
        if len(self._untaken) > _MAX_UNSETTLED:
            self._take_through(batch)
        return batch

    def take_changes(
        self,
        holds: Callable[[bytes, int], bool],
        block_of: Callable[[bytes], int | None],
        has_key: Callable[[bytes], bool] | None = None,
    ) -> PoolChanges:
        """``take_step(...).changes()``: what brings the last report up to the map as it is
        now (that is then the report), at once."""
        return self.take_step(holds, block_of, has_key).changes()

    def _take_through(self, batch: StepBatch) -> None:
        """Take the batches up to ``batch``, in order (each against the map as it is now)."""
        while self._untaken:
            taken = self._untaken.popleft()
            taken.set_changes(self._take(taken.journal))
            if taken is batch:
                return

    def _take(self, journal: StepJournal) -> PoolChanges:
        changes = PoolChanges(self.block_size, parents_of=self._settle_through)
        changes.noted = journal.noted
        holds, block_of, has_key = journal.holds, journal.block_of, journal.has_key
        reported = self._block_of_key
        if journal.cleared:
            self._settle_parents()  # the batches before the clear keep their parents
            changes.cleared = True
            reported.clear()
            self._parent_of_key.clear()
        inserted, popped_in_order = journal.inserted, journal.popped
        popped: dict[bytes, int] = {}  # keys that lost a block (empty: none did)
        if popped_in_order:
            self._settle_parents()  # the removals forget their keys' parents
            popped = self._take_removals(changes, popped_in_order)
        if self._only_new_keys(inserted, popped):
            self._take_new_keys(changes, inserted)  # the usual step
            touched: Iterable[tuple[bytes, int | None]] = ()
        else:
            touched = inserted.items()
        if popped:
            if has_key is None:
                def has_key(key: bytes) -> bool:
                    return block_of(key) is not None
            # The popped keys that gained no block: only those still reported or still in the
            # map need a look (an evicted key no other block holds is done with).
            others = [key for key in popped if key not in inserted]
            looks = map(operator.or_, map(reported.__contains__, others), map(has_key, others))
            touched = itertools.chain(touched, zip(itertools.compress(others, looks),
                                                   itertools.repeat(None)))
        if self._take_touched(changes, touched, popped, holds, block_of):
            # a key found in the map again was cached after this batch's records (they are
            # taken late): its parent was noted by a later step's records, alive until taken
            changes.noted = [*changes.noted, *(note for later in self._untaken
                                               for note in later.journal.noted), *self._noted]
        if changes.removed_keys and self._unsettled:
            self._settle_parents()
        for key in changes.removed_keys:  # (their parents were kept for the stores above)
            if key not in reported:
                self._parent_of_key.pop(key, None)
        if changes.stored_keys:
            self._unsettled.append(changes)
            if len(self._unsettled) > _MAX_UNSETTLED:
                self._settle_parents()
        return changes

    def take_events(
        self,
        holds: Callable[[bytes, int], bool],
        block_of: Callable[[bytes], int | None],
    ) -> list[Any]:
        """``take_changes(holds, block_of).events()`` and ``settle()``: the changes as
        kvbridge KV events at once (``PoolChanges.events``)."""
        events = self.take_changes(holds, block_of).events()
        self.settle()
        return events

    def settle(self) -> None:
        """Take every batch still untaken, then work out and file their parents (off the step:
        after the publish; the next take that needs it, or every ``_MAX_UNSETTLED`` steps, does
        it itself)."""
        if self._untaken:
            self._take_through(self._untaken[-1])
        self._settle_parents()

    def _settle_parents(self) -> None:
        while self._unsettled:
            self._settle_next()

    def _settle_through(self, changes: PoolChanges) -> None:
        """``changes.parents()``: settle the batches taken up to ``changes``, in order (its
        parents may be a moved key's, filed by an earlier batch)."""
        if changes not in self._unsettled:  # (settled already, or of an emptied mirror)
            self._settle_one(changes)
            return
        while self._settle_next() is not changes:
            pass

    def _settle_next(self) -> PoolChanges:
        changes = self._unsettled.popleft()
        self._settle_one(changes)
        self._parent_of_key.update(zip(changes.stored_keys, changes.parents(), strict=True))
        return changes

    def _settle_one(self, changes: PoolChanges) -> None:
        """Set ``changes``' parents: a key noted in its take has the parent noted (the hash
        before it in its request); any other (a moved key, a second block) keeps the parent
        filed for it, or none."""
        if changes.has_parents():
            return
        runs = changes.noted_runs()
        if runs is not None:  # the usual step: the stored keys are the noted slices end to end
            parents: list[bytes | None] = []
            for hashes, first_parent, _ in runs:
                if hashes:
                    parents.append(first_parent)
                    parents += hashes[:-1]
            changes.set_parents(parents)
            return
        noted: dict[bytes, bytes | None] = {}
        for hashes, first_parent, group_id in changes.noted:
            if not hashes:
                continue
            keys = map(bytes.__add__, hashes, itertools.repeat(
                make_block_hash_with_group_id(b"", group_id)))
            parents = itertools.chain((first_parent,), itertools.islice(hashes, len(hashes) - 1))
            noted.update(zip(keys, parents, strict=True))
        keys = changes.stored_keys
        changes.set_parents(list(map(noted.get, keys, map(self._parent_of_key.get, keys))))

    def _only_new_keys(self, inserted: dict[bytes, int], popped: dict[bytes, int]) -> bool:
        """True when every key that gained a block is neither reported (after this take's
        removals) nor popped: set operations, no Python loop."""
        return self._block_of_key.keys().isdisjoint(inserted) and \
            (not popped or popped.keys().isdisjoint(inserted))

    def _take_new_keys(self, changes: PoolChanges, inserted: dict[bytes, int]) -> None:
        """Every key that gained a block is new (neither reported nor popped): each is
        reported with the first block it gained, by list operations."""
        if not inserted:
            return
        self._block_of_key.update(inserted)
        changes.stored_keys += inserted
        changes.stored_block_ids += inserted.values()

    def _take_touched(self, changes: PoolChanges, touched: Iterable[tuple[bytes, int | None]],
                      popped: dict[bytes, int], holds: Callable[[bytes, int], bool],
                      block_of: Callable[[bytes], int | None]) -> bool:
        """The general case, key by key: ``(key, first block inserted since the last take, or
        None)`` of the keys that gained a block, then of those that only lost one. Returns
        True when a key that lost a block and has no parent filed is found in the map: it may
        have been cached again after the records (by a step whose batch is taken later)."""
        reported, parent_of_key = self._block_of_key, self._parent_of_key
        cached_later = False
        for key, first_block_id in touched:
            block_id = reported.get(key)
            if block_id is not None:
                if holds(key, block_id):
                    continue  # still where it was reported
                # Lost without a recorded pop: the map changed behind the follower's back (the
                # holder hears of it with the next step's delta).
                del reported[key]
                changes.removed_keys.append(key)
                changes.removed_block_ids.append(block_id)
                self._late_removed_block_ids.append(block_id)
                block_id = block_of(key)
            elif first_block_id is None or key in popped:
                block_id = block_of(key)
                cached_later |= block_id is not None and key not in parent_of_key
            else:  # gained a block, lost none, not reported: the first one it gained
                block_id = first_block_id
            if block_id is None:
                continue
            reported[key] = block_id
            changes.stored_keys.append(key)
            changes.stored_block_ids.append(block_id)
        return cached_later

    def _take_removals(self, changes: PoolChanges, pops: list[tuple[bytes, int]]
                       ) -> dict[bytes, int]:
        """The recorded pops that removed a reported block go to ``changes`` (in first-pop
        order); returns every popped key (in first-pop order) and its last popped block."""
        reported = self._block_of_key
        # a (key, block) pair removes when the key is reported at that block (once per key)
        matches = map(operator.eq, map(reported.get, map(_first, pops)), map(_second, pops))
        removals = dict(itertools.compress(pops, matches))
        deque(map(reported.__delitem__, removals), maxlen=0)
        changes.removed_keys += removals
        changes.removed_block_ids += removals.values()
        return dict(pops)

    def resync_events(self) -> list[Any]:
        """The events that make an index say exactly what ``snapshot_cached_blocks`` says, each
        block with the parent filed for its key (``index.resync.resync_events``: the index
        client's resync, ``IndexClient.set_resync_events``; so the client keeps no parent table
        of its own). Engine thread, after a step."""
        cached = self.snapshot_cached_blocks()
        self._settle_parents()
        parents = {get_block_hash(key): parent for key, parent in self._parent_of_key.items()}
        return resync_events(cached, parents.get, self.block_size, max_chain=len(parents) + 1)

    def snapshot_cached_blocks(self) -> list[CachedBlock]:
        """Every key reported as held and its block: the state the batches taken so far
        describe (the index client's resync source, read on this thread after a step)."""
        if self._untaken:
            self._take_through(self._untaken[-1])
        return [
            CachedBlock(get_block_hash(key), get_group_id(key), block_id)
            for key, block_id in self._block_of_key.items()
        ]
