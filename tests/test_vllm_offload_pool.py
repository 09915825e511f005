"""Offload on eviction over vLLM's block pool (``connector/vllm/offload_pool.py``), no vLLM needed.

A stand-in for vLLM 0.32's ``BlockPool`` keeps what the pool view reads: ``blocks`` (each with
``block_id``, ``ref_cnt``, ``block_hash``, ``is_null`` and the free queue's ``next_free_block``
link), ``free_block_queue`` with its fake head and tail, ``get_cached_block`` and
``num_gpu_blocks``. Checked with kvbridge's own ``OffloadPlanner``: only cached blocks among the
first ``offload_scan_blocks`` entries of the free queue (the side vLLM pops next) are planned,
never a block a request holds or an uncached one; at most ``offload_blocks_per_step`` a step,
the rest in later steps; a planned block vLLM reuses before the step's orders go out is
withdrawn (not offloaded) and reported not held.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvbridge.connector.store.offload_items import OffloadOutcome
from kvbridge.connector.store.planner import OffloadPlanner
from kvbridge.connector.vllm.offload_pool import VllmOffloadPool
from kvbridge.kvmanager import BlockStored
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id

BLOCK_SIZE = 32


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


class _Block(SimpleNamespace):
    pass


class _Pool:
    """vLLM's ``BlockPool``, reduced to what ``VllmOffloadPool`` reads. ``free_order``: the
    free queue's block ids, head (popped next) first; ``hashed``: block id -> hash number."""

    def __init__(self, num_blocks: int, free_order: list[int], hashed: dict[int, int]) -> None:
        self.num_gpu_blocks = num_blocks
        self.blocks = [
            _Block(block_id=i, ref_cnt=0 if i in free_order else 1, is_null=i == 0,
                   block_hash=make_block_hash_with_group_id(_hash(hashed[i]), 0)
                   if i in hashed else None, next_free_block=None)
            for i in range(num_blocks)
        ]
        head, tail = _Block(block_id=-1, next_free_block=None), _Block(block_id=-1)
        previous = head
        for block_id in free_order:
            previous.next_free_block = self.blocks[block_id]
            previous = self.blocks[block_id]
        previous.next_free_block = tail
        self.free_block_queue = SimpleNamespace(fake_free_list_head=head, fake_free_list_tail=tail)

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]):
        key = make_block_hash_with_group_id(block_hash, group_ids[0])
        for block in self.blocks:
            if block.block_hash == key:
                return [block]
        return None

    def pop_for_reuse(self, block_id: int) -> None:
        """vLLM's ``get_new_blocks`` on that block: its hash is dropped, a request holds it."""
        block = self.blocks[block_id]
        block.block_hash, block.ref_cnt = None, 1


def _stored(hashed: dict[int, int]) -> list[BlockStored]:
    """The pool follower's events for these cached blocks, each a request's first block."""
    return [BlockStored(block_hashes=[_hash(h)], parent_block_hash=None, token_ids=[],
                        block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=0,
                        block_ids=[block_id]) for block_id, h in hashed.items()]


def _view(pool: _Pool) -> VllmOffloadPool:
    return VllmOffloadPool(pool, lambda: [], lambda: [])


def test_only_cached_free_blocks_within_the_scan_of_the_queue_head_are_cold():
    # Free queue: 5 (cached), 3 (not cached), 7 (cached), 2 (cached), 9 (cached).
    # Block 4 is cached but held by a request (not in the queue).
    hashed = {5: 50, 7: 70, 2: 20, 9: 90, 4: 40}
    pool = _Pool(12, [5, 3, 7, 2, 9], hashed)
    view = _view(pool)
    assert [c.block_id for c in view.iter_cold_cached_blocks(3)] == [5, 7]
    assert [c.block_id for c in view.iter_cold_cached_blocks(100)] == [5, 7, 2, 9]
    assert list(view.iter_cold_cached_blocks(0)) == []
    cold = next(view.iter_cold_cached_blocks(1))
    assert cold.block_hash_with_group_id == make_block_hash_with_group_id(_hash(50), 0)
    with pytest.raises(ValueError, match="max_scan"):
        view.iter_cold_cached_blocks(-1)
    with pytest.raises(ValueError, match="out of range"):
        view.get_block(12)


def test_the_planner_offloads_at_most_blocks_per_step_from_the_cold_end_only():
    free_order = [1, 2, 3, 4, 5, 6, 7, 8]
    hashed = {b: 100 + b for b in free_order} | {10: 110}  # block 10: held by a request
    pool = _Pool(12, free_order, hashed)
    planner = OffloadPlanner(policy="evict", blocks_per_step=3, scan_blocks=6)
    planner.observe(_stored(hashed))
    first = planner.plan(_view(pool))
    assert [item.block_id for item in first] == [1, 2, 3]  # the bound: 3 a step, head first
    planner.apply_outcomes([OffloadOutcome(0, item.block_hash, True) for item in first])
    second = planner.plan(_view(pool))
    assert [item.block_id for item in second] == [4, 5, 6]  # then the next ones of the scan
    planner.apply_outcomes([OffloadOutcome(0, item.block_hash, True) for item in second])
    # 7 and 8 lie beyond the first 6 entries of the queue: not near eviction yet; 10 is in use.
    assert planner.plan(_view(pool)) == []
    assert all(item.block_hash == _hash(100 + item.block_id) for item in first + second)


def test_a_block_vllm_reuses_before_the_orders_go_out_is_not_offloaded():
    hashed = {1: 11, 2: 12}
    pool = _Pool(4, [1, 2], hashed)
    planner = OffloadPlanner(policy="evict", blocks_per_step=8, scan_blocks=8)
    planner.observe(_stored(hashed))
    planned = [tuple(item) for item in planner.plan(_view(pool))]
    assert [item[0] for item in planned] == [1, 2]
    pool.pop_for_reuse(1)  # the next schedule hands block 1 to another request
    kept = planner.drop_reused(planned, _view(pool))
    assert [item[0] for item in kept] == [2]  # only block 2 is copied out
    assert planner.num_in_flight == 1 and not planner.is_offloaded(0, _hash(11))
