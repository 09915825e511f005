"""The holder vouches for a step's new blocks only once the forward has computed them.

On a GPU, vLLM calls ``wait_for_save`` when the forward is issued; its kernels may still run.
``HeldBlockHashes`` lists the step's stores once the step's marker (a CUDA event there; here a
stand-in whose completion the test sets) says so, keeps steps in order, and drops a pending
store whose block a later step removed (reused for another prompt). A CPU worker passes no
marker: stores list at once, as before.
"""

from __future__ import annotations

import torch
from kvbridge.connector.forward_marker import forward_done_marker
from kvbridge.connector.holder import HeldBlockHashes
from kvbridge.connector.metadata import BlockHashDelta

H1, H2, H3 = b"h1", b"h2", b"h3"


class Marker:
    """A forward that finishes when the test says so."""

    def __init__(self) -> None:
        self.finished = False

    def __call__(self) -> bool:
        return self.finished


def stores(ids: list[int], hashes: list[bytes]) -> BlockHashDelta:
    return BlockHashDelta(stored_block_ids=ids, stored_hashes=hashes)


def removals(ids: list[int], cleared: bool = False) -> BlockHashDelta:
    return BlockHashDelta(removed_block_ids=ids, cleared=cleared)


def test_without_a_marker_stores_are_vouched_for_at_once():
    held = HeldBlockHashes()
    held.apply_stores(stores([1, 2], [H1, H2]))
    assert held.holds(1, H1) and held.holds(2, H2) and len(held) == 2


def test_a_store_is_vouched_for_only_once_its_forward_is_done():
    held = HeldBlockHashes()
    forward = Marker()
    held.apply_stores(stores([1], [H1]), forward)
    assert not held.holds(1, H1)  # the kernels that write block 1 may still run
    forward.finished = True
    assert held.holds(1, H1)


def test_steps_are_listed_in_order_and_a_later_step_waits_for_an_earlier_one():
    held = HeldBlockHashes()
    first, second = Marker(), Marker()
    held.apply_stores(stores([1], [H1]), first)
    held.apply_stores(stores([2], [H2]), second)
    second.finished = True  # one stream completes in order: this cannot outrun ``first``
    assert not held.holds(2, H2)
    first.finished = True
    assert held.holds(1, H1) and held.holds(2, H2)
    held.apply_stores(stores([3], [H3]))  # no marker, nothing pending: at once
    assert held.holds(3, H3)


def test_a_store_without_a_marker_waits_behind_a_pending_one():
    held = HeldBlockHashes()
    forward = Marker()
    held.apply_stores(stores([1], [H1]), forward)
    held.apply_stores(stores([1], [H2]))  # a later step re-cached block 1 under another hash
    assert not held.holds(1, H2) and not held.holds(1, H1)
    forward.finished = True
    assert held.holds(1, H2) and not held.holds(1, H1)


def test_a_block_removed_before_its_forward_finished_is_never_vouched_for():
    held = HeldBlockHashes()
    forward = Marker()
    held.apply_stores(stores([1, 2], [H1, H2]), forward)
    held.apply_removals(removals([1]))  # the next step reuses block 1 for another prompt
    forward.finished = True
    assert not held.holds(1, H1)
    assert held.holds(2, H2)


def test_a_reset_drops_pending_stores_too():
    held = HeldBlockHashes()
    forward = Marker()
    held.apply_stores(stores([1], [H1]), forward)
    held.apply_removals(removals([], cleared=True))
    forward.finished = True
    assert not held.holds(1, H1) and len(held) == 0


def test_the_cpu_marker_is_none_the_forward_ran_on_the_calling_thread():
    assert forward_done_marker(torch.device("cpu")) is None


def test_blocks_a_pull_did_not_fill_are_never_listed_and_listed_ones_are_forgotten():
    # vLLM caches a sync load's blocks when it allocates them, before the load: a block the
    # pull did not fill holds no KV of its hash, so the step's stores leave it out ...
    held = HeldBlockHashes()
    held.apply_stores(stores([1, 2], [H1, H2]), unlisted={2})
    assert held.holds(1, H1) and not held.holds(2, H2)
    # ... and a failed pull reported later unlists its blocks, listed or still pending.
    forward = Marker()
    held.apply_stores(stores([3], [H3]), forward)
    held.forget([1, 3])
    forward.finished = True
    assert not held.holds(1, H1) and not held.holds(3, H3) and len(held) == 0
