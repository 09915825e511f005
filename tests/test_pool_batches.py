"""``block_events.PoolBatches``: a step's batch is published once a worker report names that
step. Under vLLM's async scheduling step N + 1 is scheduled (its new blocks hashed) before step
N's output comes back; its blocks hold no KV until its own forward has run, so publishing them
with step N's output would let a peer find blocks it cannot yet read (the holder's re-check
would then fail the pull, and the peer recompute). ``with_removals_of``: a failed load's blocks,
removed after the step's stores."""

from __future__ import annotations

from kvbridge.connector.block_events import PoolBatches, with_removals_of
from kvbridge.kvmanager import BlockRemoved, BlockStored


def _stored(block_id: int) -> BlockStored:
    return BlockStored(block_hashes=[bytes([block_id]) * 32], parent_block_hash=None,
                       token_ids=[], block_size=16, lora_name=None, medium=None, group_id=0,
                       block_ids=[block_id])


def _batches(*steps: list[BlockStored]) -> tuple[PoolBatches, list[int]]:
    """A ``PoolBatches`` fed ``steps`` (one list of events per step), each taken; the step ids."""
    pending = list(steps)
    batches = PoolBatches(lambda: pending.pop(0))
    ids = []
    for _ in steps:
        batches.take(publish=True)
        ids.append(batches.num_steps)
    return batches, ids


def test_a_step_s_events_wait_for_the_report_that_names_that_step():
    n, n1 = _stored(1), _stored(2)
    batches, (step_n, step_empty, step_n1) = _batches([n], [], [n1])  # all numbered
    assert (step_empty, step_n1) == (step_n + 1, step_n + 2)
    assert batches.unpublished_events(step_n) == [n]  # step N's output: not step N + 2's
    assert batches.unpublished_events(step_n) == []
    assert batches.unpublished_events(step_empty) == []
    assert batches.unpublished_events(step_n1) == [n1]


def test_a_report_of_a_later_step_publishes_every_step_before_it_in_order():
    events = [_stored(i) for i in range(4)]
    batches, ids = _batches(*([e] for e in events))
    assert batches.unpublished_events(ids[2]) == events[:3]
    assert batches.unpublished_events(None) == events[3:]  # unnumbered reports: everything


def _h(i: int) -> bytes:
    return bytes([i]) * 32


def test_a_failed_loads_blocks_are_removed_after_the_step_s_stores_one_removal_per_group():
    # Blocks 11-15 cached as one chain after the hash of block 10; the loads of 12 and 14
    # failed. The chain stays whole and their removal follows it.
    chain = BlockStored(block_hashes=[_h(i) for i in range(11, 16)], parent_block_hash=_h(10),
                        token_ids=[], block_size=4, lora_name=None, medium=None, group_id=1,
                        block_ids=list(range(11, 16)))
    other_group = BlockStored(block_hashes=[_h(40)], parent_block_hash=None, token_ids=[],
                              block_size=4, lora_name=None, medium=None, group_id=0,
                              block_ids=[40])
    removed = BlockRemoved(block_hashes=[_h(3)], medium=None, group_id=0, block_ids=[12])
    events = [removed, chain, other_group]
    out = with_removals_of(events, [12, 14, 40, 99])
    assert out[:3] == events and out[0] is removed and out[1] is chain
    assert out[3:] == [
        BlockRemoved(block_hashes=[_h(12), _h(14)], medium=None, group_id=1, block_ids=[12, 14]),
        BlockRemoved(block_hashes=[_h(40)], medium=None, group_id=0, block_ids=[40]),
    ]
    assert events == [removed, chain, other_group]  # not changed


def test_nothing_to_remove_returns_the_same_list():
    events = [_stored(1), _stored(2)]
    assert with_removals_of(events, []) is events
    assert with_removals_of(events, [3]) is events  # a removal names no block the events store
    assert with_removals_of([], [1]) == []
