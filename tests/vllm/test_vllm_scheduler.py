"""vLLM's real ``Scheduler`` driven on CPU with kvbridge's scheduler half (vLLM's unit-test style).

No worker half and no model run here: each step's worker answer (sampled tokens,
``finished_recving`` / ``finished_sending``, ``invalid_block_ids``, the worker half's report) is
hand-made, as in vLLM's ``tests/v1/kv_connector/unit``. What is checked is the contract between
vLLM's scheduler and ``KVBridgeConnector``: what the connector orders (the step's
``KVBridgeConnectorMetadata``, decoded from the adapter's msgpack bytes), what vLLM does with
the connector's answers, and that after every scenario the scheduler is empty and every block
free (``assert_scheduler_empty``).

    (a) D pulls by position, then runs from prompt - 1        test_d_remote_prefill_lifecycle
    (b) abort while waiting for remote KV                      test_d_abort_while_waiting_*
    (c) finished_sending + finished_recving in one step        test_kv_both_send_and_recv_same_step
    (d) P grants a lease, expiry frees the blocks              test_p_*
    (e) malformed kv_transfer_params                           test_d_malformed_params_*
    (f) a partial local hit on D                               test_d_partial_local_hit_*
    (g) invalid_block_ids under recompute / fail               test_d_invalid_blocks_*
    (h) another prompt's ticket refused before any pull        test_d_*another_prompts_ticket*
"""

from __future__ import annotations

import pytest

# Not plain "vllm": without vLLM installed, this very folder (tests/vllm) imports as a namespace
# package of that name.
pytest.importorskip("vllm.v1.core.sched.scheduler")

from _vllm_sched_builders import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    WORKER_HOST,
    WORKER_PORT,
    assert_scheduler_empty,
    connector_of,
    make_request,
    make_scheduler,
    num_free_blocks,
    run_to_end,
    step,
    ticket_for,
    worker_report,
)
from kvbridge.connector.metadata import LeaseGrant, PullReport, ReleaseNotice, Ticket
from kvbridge.connector.transfer_params import RemotePrefillParams
from kvbridge.connector.vllm.adapter import PARAMS_ERROR_KEY
from kvbridge.transport import LeaseRef
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

USABLE = NUM_BLOCKS - 1  # every block but vLLM's null block
P_TICKET = Ticket("127.0.0.1", 47000, "p-req-1")
DO_REMOTE_DECODE = {"do_remote_decode": True}


def _prompt(n: int, start: int = 100) -> list[int]:
    return [(start + i) % 500 + 3 for i in range(n)]


def _blocks(scheduler, request) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])


def _admit_d(scheduler, n: int, **ticket_kw):
    """A D request with P's ticket for an ``n``-token prompt, admitted and scheduled once."""
    request = make_request(_prompt(n), kv_transfer_params=ticket_for(n, **ticket_kw))
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {}, "an async load schedules nothing until it settles"
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return request, first


# ------------------------------------------------------------------ (a) the D lifecycle
@pytest.mark.parametrize("n", [33, 64, 70])
def test_d_remote_prefill_lifecycle(n):
    scheduler = make_scheduler("kv_consumer")
    remote_ids = list(range(41, 41 + -(-n // BLOCK_SIZE)))
    request, first = _admit_d(scheduler, n, p_block_ids=remote_ids)
    num_external = n - 1  # the last prompt token is recomputed for its logits
    assert request.num_computed_tokens == num_external
    local = _blocks(scheduler, request)
    num_pulled = -(-num_external // BLOCK_SIZE)

    (plan,) = first.meta.pulls
    assert plan.request_id == request.request_id
    assert (plan.holder.engine_id, plan.holder.incarnation) == ("prefill", "prefill-inc-1")
    assert (plan.holder.host, plan.holder.port) == ("127.0.0.1", 47000)
    assert plan.lease == P_TICKET
    assert plan.num_external_tokens == num_external
    assert plan.unloadable_block_ids == []
    (group,) = plan.groups
    assert group.local_block_ids == local[:num_pulled]  # paired by position
    assert group.remote_block_ids == remote_ids[:num_pulled]
    hashes = [bytes(h) for h in request.block_hashes]
    # The partial last block has no hash: the plan's lease guards it (``Read.lease``).
    expected = [hashes[i] if i < len(hashes) else b"" for i in range(num_pulled)]
    assert group.expected_hashes == expected
    assert plan.lease.lease_ref() == LeaseRef(request_id="p-req-1", token=P_TICKET.token)
    assert first.meta.tickets_to_watch == [P_TICKET]
    assert first.meta.tickets_to_forget == [P_TICKET]  # the pull takes over the heartbeats
    assert request.kv_transfer_params["do_remote_prefill"] is False  # the ticket is used once

    waiting = step(scheduler)  # the pull is in flight: nothing runs, nothing is planned again
    assert waiting.scheduled == {} and waiting.meta.pulls == []
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    step(scheduler, finished_recving={request.request_id})
    resumed = step(scheduler)
    (new,) = resumed.output.scheduled_new_reqs
    assert new.num_computed_tokens == n - 1
    assert resumed.scheduled == {request.request_id: 1}
    assert new.block_ids[0][:num_pulled] == local[:num_pulled]
    assert resumed.meta.pulls == []

    finished = run_to_end(scheduler)
    assert finished[request.request_id].finish_reason == FinishReason.LENGTH
    assert finished[request.request_id].kv_transfer_params is None  # D hands nothing on
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (b) abort during a load
def test_d_abort_while_waiting_keeps_blocks_until_recv_settles():
    scheduler = make_scheduler("kv_consumer")
    request, _ = _admit_d(scheduler, 70)
    held = _blocks(scheduler, request)
    assert len(held) == 3 and num_free_blocks(scheduler) == USABLE - 3

    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    for i in range(3):  # the pull may still write them: nothing is freed meanwhile
        after = step(scheduler)
        if i == 0:  # the worker half hears of the abort with the next step
            assert request.request_id in after.output.finished_req_ids
        assert after.meta.notices == [] and after.meta.pulls == []  # the pull owns the release
        assert request.request_id in scheduler.requests
        assert _blocks(scheduler, request) == held
        assert num_free_blocks(scheduler) == USABLE - 3

    step(scheduler, finished_recving={request.request_id})
    assert num_free_blocks(scheduler) == USABLE  # freed once, by the settled load
    step(scheduler)
    assert num_free_blocks(scheduler) == USABLE
    assert_scheduler_empty(scheduler)


def test_d_abort_before_scheduling_releases_p_now():
    """Aborted before its pull was planned: P is told to release (not left to the lease)."""
    scheduler = make_scheduler("kv_consumer")
    request = make_request(_prompt(70), kv_transfer_params=ticket_for(70))
    scheduler.add_request(request)
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    after = step(scheduler)
    assert after.scheduled == {} and after.meta.pulls == []
    assert after.meta.notices == [
        ReleaseNotice(ticket=P_TICKET, success=False, reason="finished before its pull")
    ]
    assert after.meta.tickets_to_forget == [P_TICKET]
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (c) kv_both
def test_kv_both_send_and_recv_same_step():
    scheduler = make_scheduler("kv_both")
    p_req = make_request(_prompt(40, 7), max_tokens=1, kv_transfer_params=dict(DO_REMOTE_DECODE))
    d_req = make_request(_prompt(70), kv_transfer_params=ticket_for(70))
    scheduler.add_request(p_req)
    scheduler.add_request(d_req)

    first = step(scheduler)
    assert first.scheduled == {p_req.request_id: 40}
    assert [plan.request_id for plan in first.meta.pulls] == [d_req.request_id]
    ticket = first.finished()[p_req.request_id].kv_transfer_params
    assert RemotePrefillParams.parse(ticket, num_groups=1, block_size=BLOCK_SIZE)
    assert p_req.request_id in scheduler.requests  # delay_free: held for its puller
    granted = step(scheduler).meta.lease_grants
    assert [grant.request_id for grant in granted] == [p_req.request_id]

    step(scheduler, finished_sending={p_req.request_id}, finished_recving={d_req.request_id})
    assert p_req.request_id not in scheduler.requests
    assert num_free_blocks(scheduler) == USABLE - 3  # only D's blocks are still held
    resumed = step(scheduler)
    assert resumed.scheduled == {d_req.request_id: 1}
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (d) P side
@pytest.mark.parametrize("n", [40, 64, 70])
def test_p_lease_grant_then_expiry_frees_blocks(n):
    scheduler = make_scheduler("kv_producer", engine_id="prefill-0", extra={"lease_s": 12.0})
    request = make_request(_prompt(n), max_tokens=1, kv_transfer_params=dict(DO_REMOTE_DECODE))
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {request.request_id: n}
    out = first.finished()[request.request_id]
    assert out.finish_reason == FinishReason.LENGTH
    num_blocks = -(-n // BLOCK_SIZE)
    held = _blocks(scheduler, request)[:num_blocks]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.request_id in scheduler.requests  # delay_free: kept for the puller
    assert len(held) == num_blocks and num_free_blocks(scheduler) < USABLE

    params = RemotePrefillParams.parse(out.kv_transfer_params, num_groups=1, block_size=BLOCK_SIZE)
    assert out.kv_transfer_params["do_remote_prefill"] is True
    assert params.remote_engine_id == "prefill-0"
    assert params.remote_incarnation == "prefill-0-inc-1"
    assert (params.remote_host, params.remote_port) == (WORKER_HOST, WORKER_PORT)
    assert params.remote_request_id == request.request_id
    assert params.remote_block_ids == (tuple(held),)
    assert params.remote_num_tokens == n

    grant_step = step(scheduler)
    assert grant_step.meta.lease_grants == [
        LeaseGrant(
            request_id=request.request_id,
            block_ids=[held],
            block_hashes=[bytes(h) for h in request.block_hashes[: n // BLOCK_SIZE]],
            lease_s=12.0,
            token=params.remote_lease_token,  # the ticket's capability, fresh per request
        )
    ]
    for _ in range(3):  # the lease holds the blocks across empty steps
        assert step(scheduler).meta.lease_grants == []
        assert num_free_blocks(scheduler) == USABLE - len(_blocks(scheduler, request))

    # The lease expires on P's worker half: it reports the request as sent, and the expiry.
    step(scheduler, finished_sending={request.request_id},
         worker_meta=worker_report(num_expired_leases=1))
    assert connector_of(scheduler).stats.num_expired_leases == 1
    assert_scheduler_empty(scheduler)


def test_p_aborted_request_hands_nothing_over():
    scheduler = make_scheduler("kv_producer")
    request = make_request(_prompt(70), max_tokens=1, kv_transfer_params=dict(DO_REMOTE_DECODE))
    scheduler.add_request(request)
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert step(scheduler).meta.lease_grants == []
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (e) malformed params
# spoiled field -> (the field the error names, whether P's address is usable for a release)
MALFORMED = {
    "block_ids_too_short": ({"remote_block_ids": [[41, 42]]}, "remote_block_ids[0]", True),
    "groups_not_lists": ({"remote_block_ids": [41, 42, 43]}, "remote_block_ids", True),
    "other_block_size": ({"remote_block_size": 16}, "remote_block_size", True),
    "string_port": ({"remote_port": "47000"}, "remote_port", False),
    "bool_port": ({"remote_port": True}, "remote_port", False),
    "no_host": ({"remote_host": ""}, "remote_host", False),
}


@pytest.mark.parametrize(("spoil", "field", "released"), MALFORMED.values(), ids=MALFORMED.keys())
def test_d_malformed_params_computed_locally_and_counted(spoil, field, released, caplog):
    scheduler = make_scheduler("kv_consumer")
    connector = connector_of(scheduler)
    bad = make_request(_prompt(70), kv_transfer_params=ticket_for(70, **spoil))
    with caplog.at_level("WARNING", logger="kvbridge.connector.vllm.adapter"):
        scheduler.add_request(bad)
    (message,) = [r.getMessage() for r in caplog.records if r.name.startswith("kvbridge")]
    assert f"kv_transfer_params.{field}:" in message and bad.request_id in message
    assert connector.stats.num_rejected_params == 1

    first = step(scheduler)
    assert first.scheduled == {bad.request_id: 70}  # the whole prompt, locally
    assert first.output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert first.meta.pulls == [] and first.meta.tickets_to_watch == []
    assert [n.ticket for n in first.meta.notices] == ([P_TICKET] if released else [])
    assert all(not n.success and n.reason.startswith("rejected: ") for n in first.meta.notices)
    finished = run_to_end(scheduler)
    assert finished[bad.request_id].finish_reason == FinishReason.LENGTH
    # the request's caller gets the error (RequestOutput.kv_transfer_params), naming the field
    error = finished[bad.request_id].kv_transfer_params[PARAMS_ERROR_KEY]
    assert error.startswith(f"kv_transfer_params.{field}: ") and "computed locally" in error
    assert connector.stats.num_rejected_params == 1  # counted once, not per scheduling try
    assert_scheduler_empty(scheduler)

    good, _ = _admit_d(scheduler, 70, remote_request_id="p-req-2")  # the next one is served
    step(scheduler, finished_recving={good.request_id})
    assert step(scheduler).scheduled == {good.request_id: 1}
    finished = run_to_end(scheduler)
    assert finished[good.request_id].finish_reason == FinishReason.LENGTH
    assert finished[good.request_id].kv_transfer_params is None  # no error of its own
    assert connector.stats.num_rejected_params == 1
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (f) a partial local hit
def _cache_prefix(scheduler, prefix: list[int]) -> list[int]:
    """Run a plain request over ``prefix`` + a tail; its full blocks stay in the prefix cache."""
    warm = make_request(prefix + _prompt(10, 400), max_tokens=2)
    scheduler.add_request(warm)
    step(scheduler)
    cached = _blocks(scheduler, warm)[: len(prefix) // BLOCK_SIZE]
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)
    return cached


def test_d_partial_local_hit_pulls_the_rest_only():
    scheduler = make_scheduler("kv_consumer")
    prefix = _prompt(64, 250)
    cached = _cache_prefix(scheduler, prefix)
    n = 100  # 2 blocks local, positions 2 and 3 remote (the last token recomputed)
    request = make_request(
        prefix + _prompt(n - 64, 30),
        kv_transfer_params=ticket_for(n, [51, 52, 53, 54]),
    )
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {}
    (plan,) = first.meta.pulls
    local = _blocks(scheduler, request)
    assert local[:2] == cached  # D's own prefix cache
    assert plan.num_external_tokens == (n - 1) - 64  # remote - local
    (group,) = plan.groups
    assert group.remote_block_ids == [53, 54]  # the remote list trimmed from the front
    assert group.local_block_ids == local[2:4]
    assert group.expected_hashes == [bytes(request.block_hashes[2]), b""]  # lease: the plan's
    assert plan.lease is not None and plan.lease.remote_request_id == "p-req-1"

    step(scheduler, finished_recving={request.request_id})
    resumed = step(scheduler)
    assert resumed.output.scheduled_new_reqs[0].num_computed_tokens == n - 1
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


def test_d_local_hit_covers_everything_releases_p():
    scheduler = make_scheduler("kv_consumer")
    prefix = _prompt(64, 250)
    _cache_prefix(scheduler, prefix)
    request = make_request([*prefix, 9], kv_transfer_params=ticket_for(65))
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {request.request_id: 1}  # runs at once, nothing pulled
    assert first.meta.pulls == []
    assert first.meta.notices == [
        ReleaseNotice(ticket=P_TICKET, success=True, reason="local prefix hit")
    ]
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (g) invalid_block_ids
@pytest.mark.parametrize("bad_position", [0, 1, 2])
def test_d_invalid_blocks_recompute(bad_position):
    scheduler = make_scheduler("kv_consumer", policy="recompute")
    request, _ = _admit_d(scheduler, 70)
    bad = _blocks(scheduler, request)[bad_position]
    step(
        scheduler,
        invalid_block_ids={bad},
        finished_recving={request.request_id},
        worker_meta=worker_report(
            pulls=[PullReport(request.request_id, 3, 1, 0.01, 0.0)],
            num_load_errors_blocks=1, num_failed_loads=1,
        ),
    )
    stats = connector_of(scheduler).stats
    assert (stats.num_load_errors_blocks, stats.num_failed_loads) == (1, 1)
    resumed = step(scheduler)
    valid = bad_position * BLOCK_SIZE  # cut back to the first bad block
    assert resumed.scheduled == {request.request_id: 70 - valid}
    assert resumed.output.scheduled_new_reqs[0].num_computed_tokens == valid
    assert resumed.meta.pulls == []  # recomputed locally, never pulled twice
    finished = run_to_end(scheduler)
    assert finished[request.request_id].finish_reason == FinishReason.LENGTH
    assert_scheduler_empty(scheduler)


def test_d_invalid_blocks_fail():
    scheduler = make_scheduler("kv_consumer", policy="fail")
    request, _ = _admit_d(scheduler, 70)
    bad = _blocks(scheduler, request)[1]
    failed = step(scheduler, invalid_block_ids={bad}, finished_recving={request.request_id})
    out = failed.finished()[request.request_id]
    assert out.finish_reason == FinishReason.ERROR and out.new_token_ids == []
    assert request.status == RequestStatus.FINISHED_ERROR
    step(scheduler)
    assert_scheduler_empty(scheduler)

    good, _ = _admit_d(scheduler, 70, remote_request_id="p-req-2")  # the next one is served
    step(scheduler, finished_recving={good.request_id})
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("null_position", [0, 1])
def test_d_null_block_in_a_full_attention_group_is_planned_as_a_load_error(null_position):
    """P's null block (id 0) in a full-attention group's list is a wrong ticket (P keeps every
    block of a request there), not a sliding window's gap: the request waits for its pull like
    any other, the pull plan names D's block at that position as unloadable (the worker half
    reports it in ``invalid_block_ids``), and vLLM's ``fail`` policy ends the request."""
    scheduler = make_scheduler("kv_consumer", policy="fail")
    p_block_ids = [41, 42, 43]
    p_block_ids[null_position] = 0
    request, first = _admit_d(scheduler, 70, p_block_ids=p_block_ids)
    assert connector_of(scheduler).stats.num_window_gaps == 0
    (plan,) = first.meta.pulls
    bad = _blocks(scheduler, request)[null_position]
    assert plan.unloadable_block_ids == [bad]
    assert bad not in plan.groups[0].local_block_ids
    failed = step(scheduler, invalid_block_ids={bad}, finished_recving={request.request_id})
    assert failed.finished()[request.request_id].finish_reason == FinishReason.ERROR
    step(scheduler)
    assert_scheduler_empty(scheduler)


def test_a_ticket_sent_to_a_producer_is_computed_and_said_once(caplog):
    """vLLM started as ``kv_producer`` gets requests with P's tickets (a proxy with P and D
    swapped): each is computed as a plain request, and one warning says what to change."""
    import logging

    scheduler = make_scheduler("kv_producer")
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        for i in range(2):
            scheduler.add_request(make_request(_prompt(70, start=10 * i),
                                               kv_transfer_params=ticket_for(70)))
        stepped = step(scheduler)
    assert sum(stepped.scheduled.values()) == 140  # both computed at once, nothing pulled
    lines = [r.getMessage() for r in caplog.records if "do_remote_prefill=true" in r.getMessage()]
    assert len(lines) == 1 and "kv_role is 'kv_producer'" in lines[0], lines
    assert connector_of(scheduler).stats.num_role_mismatches == 2
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


# ------------------------------------------------------------------ (h) another prompt's ticket
def _p_ticket(prompt: list[int]) -> dict:
    """P's own ticket for ``prompt``: vLLM's ``Request`` and block hashes, kvbridge's
    ``request_finished`` (with the ``remote_prompt_digest`` of the prompt)."""
    scheduler = make_scheduler("kv_producer", engine_id="prefill")
    request = make_request(prompt, max_tokens=1, kv_transfer_params=dict(DO_REMOTE_DECODE))
    scheduler.add_request(request)
    return step(scheduler).finished()[request.request_id].kv_transfer_params


_X = _prompt(70)  # two full blocks and 6 tokens
_OTHER = {"another prompt": _prompt(70, 300), "another tail": _X[:64] + _prompt(6, 300)}


def test_d_pulls_with_ps_ticket_for_its_own_prompt():
    """P's and D's digests of one prompt agree (both from vLLM's own block hashes)."""
    ticket = _p_ticket(_X)
    assert len(ticket["remote_prompt_digest"]) == 64
    scheduler = make_scheduler("kv_consumer")
    request = make_request(_X, kv_transfer_params=ticket)
    scheduler.add_request(request)
    (plan,) = step(scheduler).meta.pulls
    assert plan.refused == "" and plan.unloadable_block_ids == []
    assert plan.groups[0].local_block_ids == _blocks(scheduler, request)[:3]
    step(scheduler, finished_recving={request.request_id})
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("kind", list(_OTHER))
def test_d_recomputes_another_prompts_ticket_in_its_first_step(kind):
    """x with P's ticket for y: D refuses it before any pull (``remote_prompt_digest``), even
    when y shares x's full blocks and differs only in the partial last block, which no hash
    guards. Under ``recompute`` the first step computes x's whole prompt: no step waits for a
    load, P is told to release, and a failed load is counted."""
    scheduler = make_scheduler("kv_consumer", policy="recompute")
    request = make_request(_X, kv_transfer_params=_p_ticket(_OTHER[kind]))
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.scheduled == {request.request_id: len(_X)}
    assert first.output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert first.meta.pulls == []
    (notice,) = first.meta.notices
    assert not notice.success and "another prompt" in notice.reason
    stats = connector_of(scheduler).stats
    assert (stats.num_failed_loads, stats.num_load_errors_blocks) == (1, 3)
    assert stats.num_rejected_params == 0
    assert request.kv_transfer_params["do_remote_prefill"] is False  # the ticket is used up
    finished = run_to_end(scheduler)
    assert finished[request.request_id].finish_reason == FinishReason.LENGTH
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("kind", list(_OTHER))
def test_d_fails_another_prompts_ticket_without_reading_under_fail(kind):
    """Under ``fail`` the request errors: its load is planned with every block unloadable and
    a reason, so the worker half reads nothing and reports the blocks at once."""
    scheduler = make_scheduler("kv_consumer", policy="fail")
    request = make_request(_X, kv_transfer_params=_p_ticket(_OTHER[kind]))
    scheduler.add_request(request)
    first = step(scheduler)
    (plan,) = first.meta.pulls
    assert plan.groups == [] and "another prompt" in plan.refused
    assert plan.unloadable_block_ids == _blocks(scheduler, request)[:3]
    failed = step(scheduler, invalid_block_ids=set(plan.unloadable_block_ids),
                  finished_recving={request.request_id})
    assert failed.finished()[request.request_id].finish_reason == FinishReason.ERROR
    step(scheduler)
    assert_scheduler_empty(scheduler)
