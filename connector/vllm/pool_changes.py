"""One step's prefix-cache changes of vLLM's pool: as the step takes them (``StepBatch``), and
as the mirror settles them (``PoolChanges``).

``PrefixCacheMirror.take_step`` runs inside vLLM's ``schedule()`` and only copies the step's
records (keys are vLLM's ``BlockHashWithGroupId``: the block hash plus 4 bytes of group id). What
the step needs at once is the holder's ``BlockHashDelta`` (``StepBatch.hash_delta``, read from the
records alone); the exact changes (``PoolChanges``: what was last reported against the map), the
stored keys' parents (``parents``, worked out from what ``record_parents`` noted) and the kvbridge
events the index and the store tier read (``events``) come later, off the step (in
``update_from_output``), and once.

Order of the events: ``AllBlocksCleared`` if the map was emptied, then every removal (one
``BlockRemoved`` per KV cache group, in the order the removals were taken), then the stores in
the order taken, cut into one ``BlockStored`` per chain: a store joins the one before it while
its parent is that store's hash in the same group (a request caches its blocks in position
order, so one event per run of a request's blocks, as vLLM's own events; a ``BlockStored``'s
hashes are one chain: ``kvmanager.kv_events``).

The usual step caches only the new blocks its requests noted, all of them and nothing else: its
stored keys are then the noted slices end to end (``PoolChanges.noted_runs``, checked by
comparing two joined byte strings), so their parents and their ``BlockStored`` events are built
slice by slice, with no Python work per key; any other step is worked out key by key.

Owner: the engine thread (vLLM's scheduler thread); nothing here is shared.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.kvmanager.block_hash import get_group_id, make_block_hash_with_group_id

from ..metadata import BlockHashDelta

__all__ = ["GROUP_ID_BYTES", "PoolChanges", "StepBatch", "StepJournal"]

GROUP_ID_BYTES = len(make_block_hash_with_group_id(b"", 0))  # the key's group id suffix


class PoolChanges:
    """What one ``take_changes`` found (read-only once taken).

    Attributes:
        block_size: tokens per block (the events' ``block_size``).
        cleared: the map was emptied (``reset_prefix_cache``) before the rest.
        removed_keys / removed_block_ids: keys that no longer map to the block reported for
            them, and that block (same length).
        stored_keys / stored_block_ids: keys now reported at a block (a key removed above and
            held by another block is here again), and that block (same length).
        noted: what ``PrefixCacheMirror.record_parents`` noted before the take (the source of
            the parents; the mirror's to read).

    Args:
        parents_of: ``parents_of(changes)`` sets ``changes``' parents (``set_parents``) when
            first asked for (``parents``); None: the parents are given with ``set_parents``.
    """

    __slots__ = ("_events", "_parents", "_parents_of", "_runs", "block_size", "cleared",
                 "noted", "removed_block_ids", "removed_keys", "stored_block_ids", "stored_keys")

    def __init__(self, block_size: int, *,
                 parents_of: Callable[[PoolChanges], None] | None = None) -> None:
        self.block_size = block_size
        self.cleared = False
        self.removed_keys: list[bytes] = []
        self.removed_block_ids: list[int] = []
        self.stored_keys: list[bytes] = []
        self.stored_block_ids: list[int] = []
        self.noted: list[Any] = []
        self._parents_of = parents_of
        self._parents: list[bytes | None] | None = None
        self._events: list[Any] | None = None
        self._runs: list[tuple[Sequence[bytes], bytes | None, int]] | bool | None = False

    def __bool__(self) -> bool:
        return bool(self.cleared or self.removed_keys or self.stored_keys)

    def parents(self) -> list[bytes | None]:
        """Each stored key's parent block hash, in ``stored_keys`` order (None: the first
        block of a request, or not known); worked out on the first call (off the step)."""
        if self._parents is None:
            if self._parents_of is None:
                raise RuntimeError("these changes' parents were never set")
            self._parents_of(self)
        assert self._parents is not None
        return self._parents

    def noted_runs(self) -> list[tuple[Sequence[bytes], bytes | None, int]] | None:
        """``noted`` (``(hashes, the first one's parent, group id)`` per slice) when the stored
        keys are exactly the noted slices' keys, end to end in note order (the usual step:
        every noted block cached, nothing else stored), else None. Then slice ``i`` holds the
        next ``len(hashes)`` stored keys, and each hash's parent is the one before it. Read once
        the changes are taken (off the step); decided on the first call by comparing the joined
        keys with the joined slices (C calls, no Python work per key)."""
        if self._runs is False:
            self._runs = self.noted if self._stores_are_noted() else None
        return self._runs  # type: ignore[return-value]

    def _stores_are_noted(self) -> bool:
        keys, noted = self.stored_keys, self.noted
        if not keys or sum(len(hashes) for hashes, _, _ in noted) != len(keys):
            return False
        # Equal joins of equally many keys, all of one length on both sides, are the same keys
        # in the same order.
        width = len(keys[0])
        if min(map(len, keys)) != width or max(map(len, keys)) != width:
            return False
        pieces = []  # each slice's keys joined: its hashes, each followed by its group's suffix
        for hashes, _, group_id in noted:
            if hashes:
                suffix = _group_suffix(group_id)
                pieces.append(suffix.join(hashes) + suffix)
                if len(pieces[-1]) != width * len(hashes) or \
                        min(map(len, hashes)) != max(map(len, hashes)):
                    return False
        return b"".join(keys) == b"".join(pieces)

    def has_parents(self) -> bool:
        return self._parents is not None

    def set_parents(self, parents: list[bytes | None]) -> None:
        """Give the parents (one per stored key; the mirror's ``parents_of`` calls this)."""
        if len(parents) != len(self.stored_keys):
            raise ValueError(f"{len(parents)} parents for {len(self.stored_keys)} stored keys")
        self._parents = parents

    def events(self) -> list[Any]:
        """kvbridge KV events (``kvbridge.kvmanager.kv_events``, ``medium`` None: the engine's
        device tier) in the order of the module docstring; built on the first call, the same
        list after (do not change it)."""
        if self._events is None:
            events: list[Any] = [AllBlocksCleared(medium=None)] if self.cleared else []
            if self.removed_keys:
                events += self._removed_events()
            if self.stored_keys:
                events += self._stored_events()
            self._events = events
        return self._events

    def _removed_events(self) -> list[BlockRemoved]:
        gone: dict[bytes, tuple[list[bytes], list[int]]] = {}  # group suffix -> hashes, ids
        for key, block_id in zip(self.removed_keys, self.removed_block_ids, strict=True):
            hashes, block_ids = gone.setdefault(key[-GROUP_ID_BYTES:], ([], []))
            hashes.append(key[:-GROUP_ID_BYTES])
            block_ids.append(block_id)
        return [BlockRemoved(block_hashes=hashes, medium=None, group_id=get_group_id(suffix),
                             block_ids=block_ids)
                for suffix, (hashes, block_ids) in gone.items()]

    def _stored_events(self) -> list[BlockStored]:
        parents = self.parents()  # (settles the batches before this one first, as always)
        runs = self.noted_runs()
        if runs is not None:
            return self._stored_events_of_runs(runs)
        keys, block_ids = self.stored_keys, self.stored_block_ids
        hashes = [key[:-GROUP_ID_BYTES] for key in keys]
        suffixes = [key[-GROUP_ID_BYTES:] for key in keys]
        # a chain goes on while a key's parent is the hash before it, in the same group
        breaks = map(operator.or_, map(operator.ne, itertools.islice(parents, 1, None), hashes),
                     map(operator.ne, itertools.islice(suffixes, 1, None), suffixes))
        cuts = list(itertools.compress(range(1, len(keys)), breaks))
        return [BlockStored(block_hashes=hashes[start:stop], parent_block_hash=parents[start],
                            token_ids=[], block_size=self.block_size, lora_name=None,
                            medium=None, group_id=get_group_id(suffixes[start]),
                            block_ids=block_ids[start:stop])
                for start, stop in zip([0, *cuts], [*cuts, len(keys)], strict=True)]

    def _stored_events_of_runs(self, runs: list[tuple[Sequence[bytes], bytes | None, int]]
                               ) -> list[BlockStored]:
        """``_stored_events`` of a step whose stores are ``runs`` (``noted_runs``): the same
        events, a run joining the chain before it when its first parent is that chain's last
        hash in the same group."""
        chains: list[tuple[list[bytes], bytes | None, int, int]] = []
        start = 0  # each chain: its hashes, parent, group id and first stored key's index
        for hashes, first_parent, group_id in runs:
            if not hashes:
                continue
            if chains and chains[-1][2] == group_id and chains[-1][0][-1] == first_parent:
                chains[-1][0].extend(hashes)
            else:
                chains.append((list(hashes), first_parent, group_id, start))
            start += len(hashes)
        block_ids = self.stored_block_ids
        return [BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[],
                            block_size=self.block_size, lora_name=None, medium=None,
                            group_id=group_id, block_ids=block_ids[first:first + len(hashes)])
                for hashes, parent, group_id, first in chains]


@functools.lru_cache(maxsize=64)
def _group_suffix(group_id: int) -> bytes:
    """The 4 bytes a group's keys end with."""
    return make_block_hash_with_group_id(b"", group_id)


class StepJournal(NamedTuple):
    """What the pool follower recorded in one step (``PrefixCacheMirror``'s, read-only), and the
    map's readers its changes are taken with."""

    cleared: bool
    inserted: dict[bytes, int]  # key -> first block it was inserted with, in insertion order
    popped: list[tuple[bytes, int]]  # (key, block id) the map stopped naming, in order
    noted: list[Any]  # ``record_parents``' slices
    holds: Callable[[bytes, int], bool]
    block_of: Callable[[bytes], int | None]
    has_key: Callable[[bytes], bool] | None


class StepBatch:
    """One step's prefix-cache changes as the step takes them: the holder's delta at once, the
    exact changes (``PoolChanges``) on first use, off the step.

    The delta is read from the step's records alone, with no look-up in the map or in what was
    reported: every popped block is removed (the holder forgets ids it does not list), and every
    key the map gained is stored with the first block it gained, unless that very block lost it
    again in the step (cached, freed and reused by a preemption in one ``schedule()``). So the
    holder lists a block only for a key vLLM's map named it with and did not take back; it may
    list a key vLLM holds in two blocks under both, and it may miss a key re-cached after such a
    pop (that block is then not served: a pull of it recomputes).

    Args:
        journal: the step's records.
        take: ``take(batch)`` sets this batch's changes (``set_changes``), taking the batches
            before it first (the mirror's).
        late_removed_block_ids: blocks found to have lost their key behind the follower's back
            when an earlier batch was taken: removed with this delta.
    """

    __slots__ = ("_changes", "_late", "_take", "journal")

    def __init__(self, journal: StepJournal, take: Callable[[StepBatch], None],
                 late_removed_block_ids: list[int]) -> None:
        self.journal = journal
        self._take = take
        self._late = late_removed_block_ids
        self._changes: PoolChanges | None = None

    def __bool__(self) -> bool:
        journal = self.journal
        return bool(journal.cleared or journal.inserted or journal.popped or self._late)

    def hash_delta(self) -> BlockHashDelta:
        """The holder's delta (``holder.HeldBlockHashes``): removals before the forward, stores
        after it."""
        journal = self.journal
        stores = journal.inserted
        removed = self._late
        if journal.popped:
            removed = [*removed, *map(operator.itemgetter(1), journal.popped)]
            stores = stores.copy()
            for key, block_id in journal.popped:
                if stores.get(key) == block_id:
                    del stores[key]
        return BlockHashDelta(cleared=journal.cleared, removed_block_ids=removed,
                              stored_block_ids=list(stores.values()), stored_hashes=list(stores))

    def changes(self) -> PoolChanges:
        """The exact changes (the mirror's ``take_changes`` answer for this step)."""
        if self._changes is None:
            self._take(self)
        assert self._changes is not None
        return self._changes

    def set_changes(self, changes: PoolChanges) -> None:
        self._changes = changes

    def events(self) -> list[Any]:
        """``changes().events()``."""
        return self.changes().events()
