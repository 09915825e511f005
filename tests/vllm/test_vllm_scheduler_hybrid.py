"""vLLM's real ``Scheduler`` with two KV cache groups (its hybrid allocator) and kvbridge's
scheduler half: the style of ``test_vllm_scheduler.py``, one sliding-window group (window
``WINDOW`` = 64 tokens = two blocks) and one full-attention group sharing one block pool.

    (a) P: request_finished_all_groups -> delay_free, a ticket per group   test_p_hybrid_*
    (b) D: pulls both groups by position, the window's blocks only          test_d_hybrid_*
    (c) D: P no longer holds the window's first block -> computed locally   test_d_window_gap_*
    (d) D: a failed pull is reported by request (failed_recving)           test_d_hybrid_failed_*
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from _vllm_sched_builders import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    WINDOW,
    assert_scheduler_empty,
    connector_of,
    make_request,
    make_scheduler,
    num_free_blocks,
    run_to_end,
    step,
    ticket_for,
)
from kvbridge.connector.metadata import Ticket
from kvbridge.connector.transfer_params import RemotePrefillParams
from kvbridge.connector.vllm.adapter import KVBridgeConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

USABLE = NUM_BLOCKS - 1
SLIDING, FULL = 0, 1  # group ids, in vLLM's order
P_TICKET = Ticket("127.0.0.1", 47000, "p-req-1")


def _prompt(n: int, start: int = 300) -> list[int]:
    return [(start + i) % 500 + 3 for i in range(n)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _first_kept_block(num_computed_tokens: int) -> int:
    """First sliding-window block vLLM keeps once ``num_computed_tokens`` are computed."""
    return max(num_computed_tokens - WINDOW + 1, 0) // BLOCK_SIZE


def test_connector_is_hma_and_vllm_keeps_two_groups():
    scheduler = make_scheduler("kv_consumer", hybrid=True)
    assert issubclass(KVBridgeConnector, SupportsHMA)
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    assert not scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


# ------------------------------------------------------------------ (a) P side
@pytest.mark.parametrize("n", [40, 300])
def test_p_hybrid_ticket_per_group_then_release(n):
    scheduler = make_scheduler("kv_producer", engine_id="prefill-0", hybrid=True)
    request = make_request(_prompt(n), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {request.request_id: n}
    out = first.finished()[request.request_id]
    assert out.finish_reason == FinishReason.LENGTH
    assert request.request_id in scheduler.requests  # delay_free: kept for the puller
    params = RemotePrefillParams.parse(out.kv_transfer_params, num_groups=2, block_size=BLOCK_SIZE)
    sliding, full = params.remote_block_ids
    num_blocks = _cdiv(n, BLOCK_SIZE)
    assert len(sliding) == len(full) == num_blocks
    # vLLM frees the blocks outside the window of P's next token (position n) before it
    # hands the table over; they are null block 0 in the ticket, by position.
    skipped = _first_kept_block(n)
    assert list(sliding[:skipped]) == [0] * skipped and 0 not in sliding[skipped:]
    assert 0 not in full
    held = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    assert tuple(held[SLIDING][:num_blocks]) == sliding and tuple(held[FULL]) == full
    assert not set(sliding) & set(full) - {0}  # one pool: a block id belongs to one group

    (grant,) = step(scheduler).meta.lease_grants
    assert grant.block_ids == [list(sliding), list(full)]
    assert num_free_blocks(scheduler) == USABLE - (num_blocks - skipped) - num_blocks

    step(scheduler, finished_sending={request.request_id})  # D's completion notice
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (b) D side
def _p_block_ids(n: int) -> list[list[int]]:
    """P's table for an ``n``-token prompt after its prefill (as in (a)): sliding-window
    positions before the window of token ``n`` are null."""
    num_blocks = _cdiv(n, BLOCK_SIZE)
    skipped = _first_kept_block(n)
    sliding = [0] * skipped + list(range(100 + skipped, 100 + num_blocks))
    return [sliding, list(range(200, 200 + num_blocks))]


@pytest.mark.parametrize("n", [40, 300])
def test_d_hybrid_pulls_both_groups_by_position(n):
    scheduler = make_scheduler("kv_consumer", hybrid=True)
    remote = _p_block_ids(n)
    request = make_request(_prompt(n), kv_transfer_params=ticket_for(n, remote_block_ids=remote))
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == n - 1
    local = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    end = _cdiv(n - 1, BLOCK_SIZE)
    kept = _first_kept_block(n - 1)  # D computes token n - 1 next: its window starts here
    assert list(local[SLIDING][:kept]) == [0] * kept  # D's own null padding

    (plan,) = first.meta.pulls
    assert plan.lease == P_TICKET and plan.unloadable_block_ids == []
    sliding, full = plan.groups
    assert (sliding.group_id, full.group_id) == (SLIDING, FULL)
    assert sliding.local_block_ids == list(local[SLIDING][kept:end])
    assert sliding.remote_block_ids == remote[SLIDING][kept:end]
    assert full.local_block_ids == list(local[FULL][:end])
    assert full.remote_block_ids == remote[FULL][:end]
    hashes = [bytes(h) for h in request.block_hashes]
    assert full.expected_hashes == [hashes[i] if i < len(hashes) else b"" for i in range(end)]

    step(scheduler, finished_recving={request.request_id})
    resumed = step(scheduler)
    assert resumed.scheduled == {request.request_id: 1}
    finished = run_to_end(scheduler)
    assert finished[request.request_id].finish_reason == FinishReason.LENGTH
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (c) a window gap
def test_d_window_gap_computes_locally_and_releases_p():
    """319 tokens: P (next token 319) dropped positions 0..255, blocks 0..7; D computing token
    318 reads positions 255..318, so it would need block 7, which P no longer has. D computes
    the request itself and tells P to release, before allocating anything for a pull."""
    n = 319
    remote = _p_block_ids(n)
    assert remote[SLIDING][7] == 0 and _first_kept_block(n - 1) == 7
    scheduler = make_scheduler("kv_consumer", hybrid=True)
    request = make_request(_prompt(n), kv_transfer_params=ticket_for(n, remote_block_ids=remote))
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {request.request_id: n}  # computed locally, from token 0
    assert first.meta.pulls == []
    (notice,) = first.meta.notices
    assert notice.ticket == P_TICKET and notice.success is False
    assert "groups [0]" in notice.reason
    assert first.meta.tickets_to_forget == [P_TICKET]
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert connector_of(scheduler).stats.num_window_gaps == 1
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (d) a failed pull
def test_d_hybrid_failed_pull_recomputes_whole_request():
    """With two groups vLLM refuses block-level load errors; the adapter reports the request in
    ``failed_recving`` and vLLM (policy ``recompute``) computes it from its first token."""
    n = 300
    scheduler = make_scheduler("kv_consumer", hybrid=True, policy="recompute")
    request = make_request(_prompt(n),
                           kv_transfer_params=ticket_for(n, remote_block_ids=_p_block_ids(n)))
    scheduler.add_request(request)
    step(scheduler)
    rid = request.request_id
    step(scheduler, finished_recving={rid}, failed_recving={rid})
    again = step(scheduler)
    assert again.scheduled == {rid: n} and again.meta.pulls == []  # no second pull
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)

