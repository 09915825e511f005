"""The scheduler half's view of vLLM's ``BlockPool``: its prefix cache as kvbridge block events.

Why not vLLM's own KV events (``kv_event_queue``, ``BlockPool.take_events``): in vLLM 0.32 they
name no block ids (the index says which block of the holder to read, and the holder's re-check is
by block id), their hashes are 64-bit integers by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
so the full hash a lookup and the re-check need is gone), a copy-on-write move of a cache entry to
another block (``move_block_hashes``) emits none, and draining that queue would take the events
from vLLM's publisher when the user configured KV events. Why not a diff of the whole cache map
each step: O(cached blocks) per step.

What the follower does instead, once, at ``bind_gpu_block_pool``:

- it puts a ``BlockHashToBlockMap`` of its own in the pool (``_JournaledMap``, the same class,
  holding the same entries) that tells a ``PrefixCacheMirror`` every ``insert`` and every ``pop``
  that removed an entry (eviction, promotion, reset of a block, a copy-on-write move): all of the
  prefix cache's changes pass through these two methods, at the cost of one append each;
- it wraps the pool's ``cache_full_blocks`` to note the parents of the hashes a request is about
  to cache (the Redis index extends a holder's run from its parent: one slice and one append per
  call, in a wrapper with vLLM's own parameters), and ``reset_prefix_cache``, which replaces
  the map, to journal the new one and report ``AllBlocksCleared``.

vLLM's own event queue, its ``enable_kv_cache_events`` setting and its publisher are untouched.
``take_changes`` runs in ``build_connector_meta`` (the end of vLLM's ``schedule()``) and only
copies the step's records: its holder delta (``StepBatch.hash_delta``) goes with the step's orders,
so its removals reach the worker half before that step's forward may overwrite the blocks
(``holder.HeldBlockHashes``); the exact changes and their events are taken, built and published
after the forward (``update_connector_output``), where ``settle`` also runs.

Needs the hashes of every group at the block size (``hash_block_size == block_size``): a finer
hash granularity (vLLM's partial-block entries) is refused at bind time.

Owner: the engine thread (vLLM's scheduler); nothing here is shared.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from vllm.v1.core.block_pool import BlockHashToBlockMap

from ..errors import KVTransferConfigError
from .pool_changes import StepBatch
from .prefix_cache_mirror import PrefixCacheMirror

__all__ = ["VllmPoolFollower"]

logger = logging.getLogger(__name__)


class _JournaledMap(BlockHashToBlockMap):
    """vLLM's prefix-cache map that reports each entry it gains or loses to ``mirror``."""

    def __init__(self, mirror: PrefixCacheMirror, entries: BlockHashToBlockMap) -> None:
        super().__init__()
        self._record_insert, self._record_pop = mirror.recorders  # one C call per change
        self._cache = entries._cache  # adopt the pool's entries as they are
        for key in self._cache:
            mirror.record_insert(key, self.block_id_of(key))

    def insert(self, key: Any, block: Any) -> None:
        # A key new to the map (the usual insert) gets ``block`` alone, as vLLM's ``insert``
        # gives it, in one C call; a key held already goes through vLLM's own merge.
        if self._cache.setdefault(key, block) is not block:
            BlockHashToBlockMap.insert(self, key, block)
        self._record_insert(key, block.block_id)

    def pop(self, key: Any, block_id: int) -> Any:
        block = BlockHashToBlockMap.pop(self, key, block_id)
        if block is not None:
            self._record_pop((key, block_id))
        return block

    @property
    def has_key(self) -> Callable[[Any], bool]:
        """``has_key(key)``: the map maps ``key`` to some block (its dict's C method)."""
        return self._cache.__contains__

    def block_id_of(self, key: Any) -> int | None:
        if key not in self._cache:  # (a key that lost its last block: the usual ask)
            return None
        block = self.get_one_block(key)
        return None if block is None else block.block_id


_CACHE_FULL_BLOCKS_PARAMS = ("request", "blocks", "num_cached_blocks", "num_full_blocks",
                             "block_size", "kv_cache_group_id", "block_mask")
"""vLLM 0.32's ``BlockPool.cache_full_blocks`` parameters (bound method: no ``self``)."""


def _noting_parents(original: Callable[..., Any], note: Callable[[Any], Any]
                    ) -> Callable[..., Any]:
    """``original`` (vLLM 0.32's ``cache_full_blocks``) that first notes the slice of hashes it
    is about to cache: ``PrefixCacheMirror.record_parents``' note, made inline through
    ``note_recorder`` (no Python call of its own). Its parameters are vLLM's own, so vLLM's
    keyword call binds to them directly; it runs once per request and group in a step."""

    def cache_full_blocks(request: Any, blocks: Any, num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: Any = None) -> Any:
        if 0 <= num_cached_blocks < num_full_blocks:
            hashes = request.block_hashes
            noted = hashes[num_cached_blocks:num_full_blocks]
            if noted:
                note((noted, hashes[num_cached_blocks - 1] if num_cached_blocks else None,
                      kv_cache_group_id))
        return original(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                        kv_cache_group_id, block_mask)

    return cache_full_blocks


class VllmPoolFollower:
    """Follows one vLLM ``BlockPool`` (vllm/v1/core/block_pool.py) for the block index.

    Args:
        pool: the pool vLLM binds (``bind_gpu_block_pool``); its map and two methods are
            replaced on this instance (see the module docstring).
        block_size: tokens per block of every KV cache group.

    Raises:
        KVTransferConfigError: the pool hashes at another granularity than ``block_size``.
    """

    def __init__(self, pool: Any, *, block_size: int) -> None:
        hash_block_size = int(pool.hash_block_size)
        if hash_block_size != block_size:
            raise KVTransferConfigError(
                f"kv_connector_extra_config.index_url: vLLM hashes blocks every "
                f"{hash_block_size} tokens but its KV blocks hold {block_size}; the index needs "
                "one hash per block (unset prefix_match_unit, one block size for every group)"
            )
        self._pool = pool
        self.mirror = PrefixCacheMirror(block_size=block_size)
        self._map = self._journal()
        self._wrap_cache_full_blocks(pool.cache_full_blocks)
        self._wrap_reset_prefix_cache(pool.reset_prefix_cache)

    def _journal(self) -> _JournaledMap:
        journaled = _JournaledMap(self.mirror, self._pool.cached_block_hash_to_block)
        self._pool.cached_block_hash_to_block = journaled
        # the map's readers ``take_step`` is given, bound once per map (not once per step)
        self._readers = (journaled.contain, journaled.block_id_of, journaled.has_key)
        return journaled

    def _wrap_cache_full_blocks(self, original: Callable[..., Any]) -> None:
        signature = inspect.signature(original)
        if tuple(signature.parameters) == _CACHE_FULL_BLOCKS_PARAMS:
            self._pool.cache_full_blocks = _noting_parents(original, self.mirror.note_recorder)
            return
        mirror = self.mirror  # another vLLM's signature: bound by name, at a Python call more

        def cache_full_blocks(*args: Any, **kwargs: Any) -> Any:
            # vLLM 0.32 passes every argument by keyword; anything else is bound by name.
            call = kwargs if not args else signature.bind(*args, **kwargs).arguments
            mirror.record_parents(
                call["request"].block_hashes,
                call["num_cached_blocks"],
                call["num_full_blocks"],
                call["kv_cache_group_id"],
            )
            return original(*args, **kwargs)

        self._pool.cache_full_blocks = cache_full_blocks

    def _wrap_reset_prefix_cache(self, original: Callable[..., Any]) -> None:
        def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
            done = original(*args, **kwargs)
            if self._pool.cached_block_hash_to_block is not self._map:
                self.mirror.record_clear()
                self._map = self._journal()
            return done

        self._pool.reset_prefix_cache = reset_prefix_cache

    def take_changes(self) -> StepBatch:
        """The pool's prefix-cache changes since the last call (``PrefixCacheMirror.
        take_step``): its ``hash_delta`` now, its exact changes and their kvbridge block events
        (``BlockStored`` / ``BlockRemoved`` with block ids, ``AllBlocksCleared``) when asked,
        off the step. Engine thread, once per step."""
        if self._pool.cached_block_hash_to_block is not self._map:
            logger.warning("vLLM replaced its prefix-cache map outside reset_prefix_cache; "
                           "the block index is told every entry again")
            self.mirror.record_clear()
            self._map = self._journal()
        return self.mirror.take_step(*self._readers)

    def take_events(self) -> list[Any]:
        """``take_changes().events()``, then ``settle()``: the changes as kvbridge block events
        at once (for callers outside vLLM's step: tests, tools). Engine thread."""
        events = self.take_changes().events()
        self.settle()
        return events

    def settle(self) -> None:
        """Off the step (after the forward): the mirror's bookkeeping the step left
        (``PrefixCacheMirror.settle``). Engine thread."""
        self.mirror.settle()

    def resync_events(self) -> list[Any]:
        """The index client's resync batch (``PrefixCacheMirror.resync_events``). Engine
        thread."""
        return self.mirror.resync_events()

    def snapshot_cached_blocks(self) -> list[Any]:
        """The cached set the events taken so far describe (``kvmanager.CachedBlock`` list;
        the index client's resync source). Engine thread."""
        return self.mirror.snapshot_cached_blocks()
