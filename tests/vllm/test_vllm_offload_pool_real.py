"""Offload on eviction over vLLM's own ``BlockPool`` (vllm/v1/core/block_pool.py), driven
directly, and the store tier's events for vLLM's KV-event stream.

``VllmOffloadPool`` must read vLLM's free queue as vLLM pops it (head first, cached blocks
only, never one a request holds), and ``OffloadPlanner`` over it plans the cold blocks at most
``blocks_per_step`` a step and withdraws a planned block vLLM reuses before the step's orders
go out. ``StoreTierEvents`` turns the worker's offload outcomes into vLLM ``BlockStored`` /
``BlockRemoved`` events of the medium ``KVBRIDGE_STORE``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.core.block_pool")

from kvbridge.connector.store.offload_items import OffloadOutcome
from kvbridge.connector.store.planner import OffloadPlanner
from kvbridge.connector.vllm.metrics import KVBridgeConnectorStats
from kvbridge.connector.vllm.offload_pool import VllmOffloadPool
from kvbridge.connector.vllm.pool_follower import VllmPoolFollower
from kvbridge.connector.vllm.store_events import STORE_MEDIUM, StoreTierEvents
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

BLOCK_SIZE = 4


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


def _cache(pool: BlockPool, hashes: list[int]):
    """A request of ``len(hashes)`` full blocks allocated and cached, as a manager does."""
    request = SimpleNamespace(block_hashes=[_hash(h) for h in hashes])
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(request=request, blocks=blocks, num_cached_blocks=0,
                           num_full_blocks=len(hashes), block_size=BLOCK_SIZE,
                           kv_cache_group_id=0)
    return blocks


def _setup(num_blocks: int, **planner_kw):
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)
    follower = VllmPoolFollower(pool, block_size=BLOCK_SIZE)
    view = VllmOffloadPool(pool, follower.snapshot_cached_blocks, follower.resync_events)
    planner = OffloadPlanner(policy="evict", **planner_kw)
    return pool, follower, view, planner


def test_cold_blocks_are_vllm_s_free_queue_head_cached_and_unheld_only():
    pool, follower, view, planner = _setup(16, blocks_per_step=64, scan_blocks=64)
    held = _cache(pool, [1, 2])  # a running request's blocks
    done = _cache(pool, [3, 4, 5])
    pool.free_blocks(reversed(done))  # a finished request: its last block evicted first
    cold = [c.block_id for c in view.iter_cold_cached_blocks(64)]
    assert cold == [b.block_id for b in reversed(done)]  # behind the never-used blocks
    assert not {b.block_id for b in held} & set(cold)
    # Only the entries vLLM pops next are looked at: 10 never-used blocks lie in front.
    assert list(view.iter_cold_cached_blocks(pool.get_num_free_blocks() - 3)) == []
    planner.observe(follower.take_events())
    items = planner.plan(view)  # ancestors first: the chain root first
    assert [(i.block_id, i.block_hash, i.parent_hash) for i in items] == [
        (done[0].block_id, _hash(3), b""), (done[1].block_id, _hash(4), _hash(3)),
        (done[2].block_id, _hash(5), _hash(4))]


def test_at_most_blocks_per_step_and_a_block_reused_before_its_copy_is_not_offloaded():
    pool, follower, view, planner = _setup(8, blocks_per_step=2, scan_blocks=64)
    done = _cache(pool, [1, 2, 3])
    pool.free_blocks(reversed(done))
    planner.observe(follower.take_events())
    first = [tuple(i) for i in planner.plan(view)]
    assert [i[2] for i in first] == [_hash(1), _hash(2)]  # the bound: two this step
    # The next schedule takes every free block: vLLM evicts all three cached ones.
    pool.get_new_blocks(pool.get_num_free_blocks())
    planner.observe(follower.take_events())
    assert planner.drop_reused(first, view) == []  # nothing of them is copied out
    assert not planner.is_offloaded(0, _hash(1)) and planner.num_in_flight == 0
    assert planner.plan(view) == []


def test_store_tier_events_name_what_the_store_holds_with_its_medium():
    parents = {_hash(1): b"", _hash(2): _hash(1)}
    events = StoreTierEvents(block_size=BLOCK_SIZE, parent_of=lambda g, h: parents.get(h))
    events.observe([OffloadOutcome(0, _hash(1), True), OffloadOutcome(0, _hash(2), True),
                    OffloadOutcome(0, _hash(3), False),  # not held: no event
                    (0, _hash(1), False, True)])  # the store reported it missing
    stored_1, stored_2, removed = events.take()
    assert isinstance(stored_1, BlockStored) and isinstance(removed, BlockRemoved)
    assert {e.medium for e in (stored_1, stored_2, removed)} == {STORE_MEDIUM}
    # Hashes as vLLM's own events carry them (64-bit ints unless
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    ext = maybe_convert_block_hash
    assert stored_1.parent_block_hash is None and stored_2.parent_block_hash == ext(_hash(1))
    assert stored_2.block_hashes == [ext(_hash(2))] and removed.block_hashes == [ext(_hash(1))]
    assert events.take() == []


def test_vllm_s_log_line_shows_the_store_tier_s_counters_when_there_are_any():
    quiet = KVBridgeConnectorStats({"counters": {"num_loads": 2}}).reduce()
    assert not {"blocks offloaded", "blocks restored", "store write failures"} & set(quiet)
    busy = KVBridgeConnectorStats({"counters": {"num_offloaded_blocks": 40,
                                                "num_restored_blocks": 46,
                                                "num_offload_failures": 1}}).reduce()
    assert (busy["blocks offloaded"], busy["blocks restored"],
            busy["store write failures"]) == (40, 46, 1)
