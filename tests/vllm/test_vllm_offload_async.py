"""Offload on eviction under vLLM's async scheduling, in vLLM's real ``AsyncScheduler`` on CPU
(vLLM's unit-test style, no worker: ``_vllm_sched_builders``; issue 31, part 4).

Under async scheduling vLLM schedules step K + 1 before step K's output comes back, and
``allocate_slots`` gives a block its hash when it schedules the block, before the forward that
computes its KV. The worker half snapshots a step's offload items at that step's start, after
every earlier forward and before its own (``OffloadPlanner.drop_reused``), so an item is sound
when, as the step's orders go out, its block still holds the item's hash and got that hash in
an earlier step. The test checks both for every item of every step, while requests arrive,
finish and evict one another's blocks with one step always in flight, and that the engine
ends empty with nothing left in flight.
"""

from __future__ import annotations

from collections import deque

import pytest

pytest.importorskip("vllm.v1.core.sched.async_scheduler")

from _vllm_sched_builders import (
    NUM_BLOCKS,
    assert_scheduler_empty,
    connector_of,
    make_request,
    model_runner_output,
    worker_report,
)
from kvbridge.connector.metadata import decode_metadata
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from test_vllm_index_scheduler import _namespace, _prompt, index_node, wait_lookups
from vllm.v1.core.sched.async_scheduler import AsyncScheduler


def _report(scheduler, output) -> None:
    """``update_from_output`` with a worker report of ``output``'s step that names the step
    and says the store now holds each of its offload items."""
    meta = decode_metadata(output.kv_connector_metadata.payload)
    scheduler.update_from_output(output, model_runner_output(output, worker_meta=worker_report(
        step_id=meta.step_id, store_incarnation=1,
        offload_outcomes=[(group_id, block_hash, True, False)
                          for _, group_id, block_hash, _ in meta.offload_items])))


def test_every_offload_item_names_a_block_computed_before_its_step_and_still_holding_it():
    scheduler = index_node("offload-async", _namespace(), async_scheduling=True, extra={
        "store_url": "127.0.0.1:9", "offload": "evict", "offload_blocks_per_step": 3,
        "offload_scan_blocks": 8})
    assert isinstance(scheduler, AsyncScheduler)
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    hashed_at: dict[int, int] = {}  # block id -> the step its current hash was given in
    hashes = [block.block_hash for block in blocks]
    in_flight: deque = deque()
    planned = 0  # items the steps' orders carried
    try:
        planner = connector_of(scheduler)._sched().offload_planner
        plan, num_picked = planner.plan, [0]

        def counted_plan(block_pool, **kwargs):
            items = plan(block_pool, **kwargs)
            num_picked[0] += len(items)
            return items

        planner.plan = counted_plan
        for k in range(160):
            if k < 80 and k % 3 == 0:  # 8-block prompts: the pool holds about seven at once
                scheduler.add_request(make_request(_prompt(900 + k, 250), max_tokens=4))
            if k >= 80 and not (scheduler.requests or in_flight or planner.num_in_flight):
                break  # (idle steps go on while the cold blocks left are offloaded)
            output = scheduler.schedule()
            for block in blocks:
                if block.block_hash is not None and block.block_hash != hashes[block.block_id]:
                    hashed_at[block.block_id] = k
                hashes[block.block_id] = block.block_hash
            for block_id, group_id, block_hash, _ in decode_metadata(
                    output.kv_connector_metadata.payload).offload_items:
                planned += 1
                assert blocks[block_id].block_hash == make_block_hash_with_group_id(
                    block_hash, group_id), (k, block_id)  # still its hash as the orders go out
                assert hashed_at[block_id] < k, (k, block_id)  # computed by an earlier forward
            in_flight.append(output)
            if len(in_flight) > 1 or not scheduler.requests:  # else one step stays in flight
                while in_flight:
                    _report(scheduler, in_flight.popleft())
            wait_lookups(scheduler)
        assert not (scheduler.requests or in_flight or planner.num_in_flight), k
        # More blocks than the pool has were offloaded, and some picks were reused by the
        # schedule in between and left out (the fence, ``drop_reused``).
        assert num_picked[0] > planned >= NUM_BLOCKS, (num_picked, planned)
    finally:
        assert_scheduler_empty(scheduler)
        connector_of(scheduler).shutdown()
