"""D's scheduler half looks at P's block board before it commits a step to a handoff (issue 28,
item 4; ``kvbridge.connector.ticket_board``), inside vLLM's real ``Scheduler``.

A ticket D cannot refuse by itself (no ``remote_prompt_digest``, or a stale one whose blocks P
reused) used to be found out by P's answer to a load planned inside the step that computes the
request (``load_mode`` "auto", a holder D reads one-sided): vLLM had scheduled the request's
last prompt token over blocks that never loaded, and computed the prompt one step later than a
plain request. Now, with P's board reported by the worker half, such a ticket is refused before
anything is allocated: under "recompute" the first step computes the whole prompt, as for a
plain request. A ticket the board vouches for, or one only P can answer for (its lease not
granted yet, or ended), still loads in the step.

P's board is a real ``BlockBoard`` written by a real ``LeaseTable`` in this process (a process
may read itself with ``process_vm_readv``); the worker half's report of it is fed to the
scheduler the way vLLM hands it over (``kv_connector_worker_meta``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

import kvbridge.transport.cma as cma
from _vllm_sched_builders import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_of,
    make_request,
    make_scheduler,
    model_runner_output,
    run_to_end,
    step,
    ticket_for,
)
from kvbridge.connector.lease import LeaseTable
from kvbridge.connector.metadata import KVBridgeWorkerMeta, decode_metadata, encode_worker_meta
from kvbridge.connector.ticket_board import BOARD_REFUSAL
from kvbridge.connector.vllm.adapter import _WorkerReport
from kvbridge.transport import BlockBoard, BoardRef
from vllm.v1.request import RequestStatus

if not cma.available():
    pytest.skip("this system has no process_vm_readv", allow_module_level=True)

X = [(100 + i) % 500 + 3 for i in range(70)]  # two full blocks and 6 tokens
Y = [(300 + i) % 500 + 3 for i in range(70)]  # another prompt
P_IDS = [41, 42, 43]  # ticket_for's blocks on P


class _P:
    """P's lease table and board in this process, and the worker half's report of them."""

    def __init__(self) -> None:
        self.leases = LeaseTable(lease_s=30.0)
        self.board = BlockBoard([64])
        self.leases.attach_board(self.board)
        self.probe = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        ref = BoardRef("prefill", "prefill-inc-1", os.getpid(), self.board.address, (64,),
                       int(self.probe.ctypes.data), self.probe.tobytes())
        meta = KVBridgeWorkerMeta(one_sided_holders=[ref])
        self.report = _WorkerReport([encode_worker_meta(meta)])

    def grant(self, request_id: str, prompt: list[int], ids=P_IDS) -> None:
        hashes = make_request(prompt).block_hashes
        self.leases.grant(request_id, [ids], list(hashes[:2]))


def _d_with_board(p: _P, policy: str = "recompute"):
    scheduler = make_scheduler("kv_consumer", policy=policy)
    step(scheduler, worker_meta=p.report)  # D's worker connected to P: reads it one-sided
    return scheduler


def _x_with_ticket(scheduler, **ticket_kw):
    """x with a ticket naming P's lease ``p-req-1`` (no digest: one D cannot check itself)."""
    request = make_request(X, kv_transfer_params=ticket_for(len(X), **ticket_kw))
    scheduler.add_request(request)
    return request, step(scheduler)


@pytest.mark.parametrize("case", ["another prompt's ticket", "stale: P reused the blocks"])
def test_a_ticket_the_board_refuses_is_computed_in_the_first_step(case):
    """Before, the first step scheduled one token over a sync load P then refused, and the
    prompt was computed in the second step."""
    p = _P()
    if case == "another prompt's ticket":
        p.grant("p-req-1", Y)
    else:  # x's lease ended and P leased the same blocks for another prompt since
        p.grant("p-req-1", X)
        p.leases.release("p-req-1")
        p.grant("p-req-2", Y)
    scheduler = _d_with_board(p)
    request, first = _x_with_ticket(scheduler)
    assert first.scheduled == {request.request_id: len(X)}  # the whole prompt, as plainly
    assert first.output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert first.meta.pulls == []
    (notice,) = first.meta.notices  # P releases the lease the ticket named
    assert not notice.success and notice.reason == BOARD_REFUSAL
    stats = connector_of(scheduler).stats
    assert (stats.num_failed_loads, stats.num_load_errors_blocks) == (1, 3)
    assert request.kv_transfer_params["do_remote_prefill"] is False
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


def test_under_fail_a_ticket_the_board_refuses_fails_without_reading():
    p = _P()
    p.grant("p-req-1", Y)
    scheduler = _d_with_board(p, policy="fail")
    _, first = _x_with_ticket(scheduler)
    (plan,) = first.meta.pulls
    assert plan.groups == [] and plan.refused == BOARD_REFUSAL


def test_a_ticket_the_board_vouches_for_still_loads_in_the_step():
    p = _P()
    p.grant("p-req-1", X)
    scheduler = _d_with_board(p)
    request, first = _x_with_ticket(scheduler)
    assert first.scheduled == {request.request_id: 1}  # the last prompt token, after the load
    (plan,) = first.meta.pulls
    assert plan.sync and plan.refused == "" and len(plan.groups[0].local_block_ids) == 3


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_beside_another_request_a_vouched_handoff_loads_in_the_step_only_under_fail(policy):
    """Under ``recompute`` vLLM leaves a failed in-step load's blocks to the loading request to
    recompute, while another request of the step that took them as a local hit keeps them as
    computed; if the first is then aborted, the other decodes over KV never written
    (connector/vllm/load_modes.py). So beside another request the handoff is pulled over later
    steps there; alone (the test above) it still loads in the step."""
    p = _P()
    p.grant("p-req-1", X)
    scheduler = _d_with_board(p, policy=policy)
    other = make_request(Y, max_tokens=1)
    scheduler.add_request(other)
    request, first = _x_with_ticket(scheduler)
    (plan,) = first.meta.pulls
    assert plan.sync == (policy == "fail")
    if policy == "recompute":
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert first.scheduled == {other.request_id: len(Y)}
        step(scheduler, finished_recving=[request.request_id])  # the pull landed
    else:
        assert first.scheduled == {other.request_id: len(Y), request.request_id: 1}
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("case", ["lease not granted yet", "lease ended"])
def test_a_ticket_only_p_can_answer_for_is_planned_as_without_the_look(case):
    """An empty board is no refusal: a correct ticket often reaches D before P's next step
    hands its lease over, so the load stays in the step and the worker's read asks P."""
    p = _P()
    if case == "lease ended":
        p.grant("p-req-1", X)
        p.leases.release("p-req-1")
    scheduler = _d_with_board(p)
    request, first = _x_with_ticket(scheduler)
    assert first.scheduled == {request.request_id: 1}
    (plan,) = first.meta.pulls
    assert plan.sync and plan.refused == "" and len(plan.groups[0].local_block_ids) == 3


def test_under_async_scheduling_a_handoff_the_board_vouches_for_loads_over_later_steps():
    # vLLM's AsyncScheduler (its default on a GPU) schedules the next step before a step's
    # output comes back, and cannot finish a request whose in-step load failed
    # (connector/vllm/load_modes.py): there the same handoff is pulled over later steps, and a
    # block that does not land is recomputed from it, with the step after already scheduled.
    p = _P()
    p.grant("p-req-1", X)
    scheduler = make_scheduler("kv_consumer", policy="recompute", async_scheduling=True)
    step(scheduler, worker_meta=p.report)
    assert connector_of(scheduler).config.load_mode == "async"
    request = make_request(X, kv_transfer_params=ticket_for(len(X)))
    scheduler.add_request(request)
    planned = scheduler.schedule()
    (plan,) = decode_metadata(planned.kv_connector_metadata.payload).pulls
    assert not plan.sync and planned.num_scheduled_tokens == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    block_ids = list(plan.groups[0].local_block_ids)
    following = scheduler.schedule()  # before the planning step's output
    scheduler.update_from_output(planned, model_runner_output(
        planned, finished_recving=[request.request_id], invalid_block_ids=block_ids[1:2]))
    scheduler.update_from_output(following, model_runner_output(following))
    resumed = step(scheduler)
    (new,) = resumed.output.scheduled_new_reqs
    assert (new.num_computed_tokens, resumed.scheduled) == (
        BLOCK_SIZE, {request.request_id: len(X) - BLOCK_SIZE})  # from the block that failed
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)
