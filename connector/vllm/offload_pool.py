"""The offload planner's view of vLLM's ``BlockPool`` (offload on eviction, issue 31 part 4).

kvbridge's ``OffloadPlanner`` (``connector/store/planner.py``) reads a block pool through five
names: ``num_gpu_blocks``, ``iter_cold_cached_blocks``, ``get_block``, ``get_cached_block`` and
``snapshot_cached_blocks``; the scheduler half gives the index client its ``resync_events``.
``VllmOffloadPool`` gives them over
vLLM 0.32's pool (vllm/v1/core/block_pool.py) without changing it:

- ``iter_cold_cached_blocks(max_scan)`` walks vLLM's ``free_block_queue`` from its head (the
  side ``get_new_blocks`` pops next: vLLM evicts in that order, the least recently used block
  first) through at most ``max_scan`` entries and yields the hashed ones: blocks with
  ``ref_cnt == 0`` that vLLM still finds by hash. So only the blocks within the ``max_scan``
  (``offload_scan_blocks``) entries vLLM reuses next are candidates, never a block a request
  holds or one just computed; how many are planned per step is the planner's
  ``blocks_per_step`` (``offload_blocks_per_step``), and the bytes waiting for the store are
  bounded by the worker's ``offload_max_inflight_bytes``;
- ``get_block`` / ``get_cached_block`` / ``num_gpu_blocks`` are the pool's own, so the planner's
  fence (``OffloadPlanner.drop_reused``: a planned block that no longer holds its hash when the
  step's orders are built is withdrawn, never copied) reads what vLLM's scheduler just did;
- ``snapshot_cached_blocks`` and ``resync_events`` are the pool follower's
  (``pool_follower.py``).

Owner: the engine thread (vLLM's scheduler); reads only, nothing here is shared. The pool must
not change while an ``iter_cold_cached_blocks`` iterator is in use (the planner exhausts or
drops it inside one ``plan``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvbridge.kvmanager.block_pool import ColdCachedBlock

__all__ = ["VllmOffloadPool"]


class VllmOffloadPool:
    """vLLM's ``BlockPool`` as ``OffloadPlanner.plan`` reads it. See the module docstring.

    Args:
        pool: vLLM's ``BlockPool`` (``bind_gpu_block_pool``): read through ``blocks``,
            ``free_block_queue`` (``fake_free_list_head`` / ``fake_free_list_tail``,
            ``next_free_block``), ``get_cached_block`` and ``num_gpu_blocks``.
        snapshot_cached_blocks: the cached set (``VllmPoolFollower.snapshot_cached_blocks``).
        resync_events: the index client's resync batch, parents included
            (``VllmPoolFollower.resync_events``; ``IndexClient.set_resync_events``).
    """

    def __init__(self, pool: Any, snapshot_cached_blocks: Any, resync_events: Any) -> None:
        self._pool = pool
        self.snapshot_cached_blocks = snapshot_cached_blocks
        self.resync_events = resync_events

    @property
    def num_gpu_blocks(self) -> int:
        return int(self._pool.num_gpu_blocks)

    def get_block(self, block_id: int) -> Any:
        """vLLM's ``KVCacheBlock`` ``block_id`` (its ``block_hash`` is the prefix-cache key,
        block hash plus 4 bytes of group id, or None). ValueError when out of range."""
        if not 0 <= block_id < len(self._pool.blocks):
            raise ValueError(f"block id {block_id} out of range [0, {len(self._pool.blocks)})")
        return self._pool.blocks[block_id]

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> Any:
        """vLLM's ``BlockPool.get_cached_block``: one cached block per group, or None."""
        return self._pool.get_cached_block(block_hash, list(kv_cache_group_ids))

    def iter_cold_cached_blocks(self, max_scan: int) -> Iterator[ColdCachedBlock]:
        """The hashed blocks among the first ``max_scan`` entries of vLLM's free queue, head
        (evicted next) first, as ``(block_id, block hash with group id)``. Does not mutate.
        ValueError if ``max_scan < 0``."""
        if max_scan < 0:
            raise ValueError(f"max_scan must be >= 0, got {max_scan}")
        return self._walk(max_scan)

    def _walk(self, max_scan: int) -> Iterator[ColdCachedBlock]:
        # Up to ``offload_scan_blocks`` nodes every step: the tuple is built in C (a NamedTuple's
        # own ``__new__`` is a Python call per cold block).
        queue = self._pool.free_block_queue
        tail = queue.fake_free_list_tail
        block = queue.fake_free_list_head.next_free_block
        make = tuple.__new__
        for _ in range(max_scan):
            if block is None or block is tail:
                return
            key = block.block_hash
            if key is not None and block.ref_cnt == 0 and not block.is_null:
                yield make(ColdCachedBlock, (block.block_id, key))
            block = block.next_free_block
