"""vLLM's real ``Scheduler`` with the scheduler half of a tensor-parallel engine (issue 30):
every rank's handshake in, every rank in the ticket out, every P rank in a D pull's orders,
each request counted once whatever the number of ranks that report it, and the layouts the
connector does not serve refused before anything starts. No worker, no model forward
(``_vllm_sched_builders``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from _vllm_sched_builders import (
    WORKER_HOST,
    WORKER_PORT,
    assert_scheduler_empty,
    connector_of,
    make_request,
    make_scheduler,
    run_to_end,
    step,
    ticket_for,
    worker_report,
)
from kvbridge.connector.errors import KVTransferConfigError
from kvbridge.connector.metadata import PullReport, ReleaseNotice, Ticket
from kvbridge.connector.vllm.adapter import PARAMS_ERROR_KEY
from kvbridge.connector.vllm.translate import refuse_unsupported_layout
from vllm.v1.request import RequestStatus

DO_REMOTE_DECODE = {"do_remote_decode": True}


def _prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 500 + 1 for i in range(n)]


def _ranks(engine_id: str, tp_size: int) -> list[dict]:
    return [{"host": WORKER_HOST, "port": WORKER_PORT + r,
             "incarnation": f"{engine_id}-inc-{r + 1}"} for r in range(tp_size)]


def _tp_ticket(n: int, p_size: int) -> dict:
    """P's ticket for an ``n``-token prompt from a P of ``p_size`` ranks (``ticket_for`` with
    the ranks of ``make_scheduler(..., tp_size=p_size)``'s handshakes)."""
    ranks = _ranks("prefill", p_size)
    return ticket_for(n, remote_host=WORKER_HOST, remote_port=WORKER_PORT,
                      remote_incarnation="prefill-inc-1", remote_tp_size=p_size,
                      remote_ranks=ranks, remote_num_kv_heads=2)


def test_a_tensor_parallel_prefill_names_every_rank_in_its_ticket():
    scheduler = make_scheduler("kv_producer", engine_id="prefill", tp_size=2)
    request = make_request(_prompt(70), max_tokens=1, kv_transfer_params=dict(DO_REMOTE_DECODE))
    scheduler.add_request(request)
    out = step(scheduler).finished()[request.request_id]
    params = out.kv_transfer_params
    assert params["remote_tp_size"] == 2 and params["remote_num_kv_heads"] == 2
    assert params["remote_ranks"] == _ranks("prefill", 2)
    assert (params["remote_host"], params["remote_port"]) == (WORKER_HOST, WORKER_PORT)
    grants = step(scheduler).meta.lease_grants  # one grant: every rank takes it (broadcast)
    assert [g.request_id for g in grants] == [request.request_id]
    # the request is freed when every rank reported it sent (vLLM's aggregator counts ranks)
    step(scheduler, finished_sending={request.request_id})
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize(("p_size", "d_size"), [(2, 2), (1, 2), (2, 1)])
def test_a_decode_pull_names_every_prefill_rank_and_counts_the_request_once(p_size, d_size):
    scheduler = make_scheduler("kv_consumer", tp_size=d_size, policy="recompute")
    params = _tp_ticket(70, p_size) if p_size > 1 else ticket_for(70)
    request = make_request(_prompt(70), kv_transfer_params=params)
    scheduler.add_request(request)
    first = step(scheduler)
    holders = [("127.0.0.1", 47000)] if p_size == 1 else \
        [(WORKER_HOST, WORKER_PORT + r) for r in range(p_size)]
    tickets = [Ticket(h, p, "p-req-1", "") for h, p in holders]
    assert first.meta.tickets_to_watch == tickets  # every P rank's lease is heart-beaten
    (plan,) = first.meta.pulls
    assert [(h.host, h.port) for h in plan.holders()] == holders
    assert [h.incarnation for h in plan.holders()] == (
        ["prefill-inc-1"] if p_size == 1 else [f"prefill-inc-{r + 1}" for r in range(p_size)])
    assert first.meta.tickets_to_forget == tickets  # the pull heart-beats from here on
    # every D rank reports its part; the node counts one load, each rank its own
    num_blocks = len(plan.groups[0].local_block_ids)
    reports = [worker_report(tp_rank=r, pulls=[PullReport(request.request_id, num_blocks, 0,
                                                          0.01 * (r + 1), 0.0)],
                             num_loads=1, bytes_received=1000) for r in range(d_size)]
    report = reports[0]
    for other in reports[1:]:
        report = report.aggregate(other)
    step(scheduler, finished_recving={request.request_id}, worker_meta=report)
    connector = connector_of(scheduler)
    assert (connector.stats.num_loads, connector.stats.bytes_received) == (1, 1000 * d_size)
    assert connector.stats.transfer_s_sum == pytest.approx(0.01 * d_size)  # the slowest rank
    assert sorted(connector.rank_stats) == list(range(d_size))
    assert all(s.num_loads == 1 for s in connector.rank_stats.values())
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


def test_a_request_aborted_before_its_pull_releases_every_prefill_rank():
    scheduler = make_scheduler("kv_consumer", tp_size=2)
    request = make_request(_prompt(70), kv_transfer_params=_tp_ticket(70, 2))
    scheduler.add_request(request)
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    meta = step(scheduler).meta
    assert meta.notices == [
        ReleaseNotice(ticket=Ticket(WORKER_HOST, WORKER_PORT + r, "p-req-1", ""), success=False,
                      reason="finished before its pull") for r in range(2)]
    assert_scheduler_empty(scheduler)


def test_a_ticket_whose_sizes_vllm_would_not_run_is_computed_locally_naming_both():
    scheduler = make_scheduler("kv_consumer", tp_size=2)
    params = ticket_for(70, remote_tp_size=3, remote_ranks=_ranks("prefill", 3),
                        remote_incarnation="prefill-inc-1", remote_host=WORKER_HOST,
                        remote_port=WORKER_PORT, remote_num_kv_heads=2)
    request = make_request(_prompt(70), kv_transfer_params=params)
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.meta.pulls == [] and first.scheduled == {request.request_id: 70}
    assert len(first.meta.notices) == 3  # every rank the ticket names is told to release
    finished = run_to_end(scheduler)
    error = finished[request.request_id].kv_transfer_params[PARAMS_ERROR_KEY]
    assert "prefill tp_size 3, decode tp_size 2: tp_size 3 with 2 KV heads" in error
    assert_scheduler_empty(scheduler)


def _config(**parallel) -> SimpleNamespace:
    base = dict(pipeline_parallel_size=1, data_parallel_size=1, tensor_parallel_size=2,
                decode_context_parallel_size=1, prefill_context_parallel_size=1)
    return SimpleNamespace(parallel_config=SimpleNamespace(**(base | parallel)),
                           model_config=SimpleNamespace(use_mla=parallel.pop("use_mla", False)))


@pytest.mark.parametrize(("setting", "value"), [
    ("pipeline_parallel_size", 2),
    ("data_parallel_size", 2),
    ("decode_context_parallel_size", 2),
    ("prefill_context_parallel_size", 2),
])
def test_parallel_layouts_not_served_are_refused_naming_the_setting(setting, value):
    with pytest.raises(KVTransferConfigError, match=rf"^{setting}={value}: kvbridge"):
        refuse_unsupported_layout(_config(**{setting: value}))
    refuse_unsupported_layout(_config())  # tensor parallelism alone is served


def test_an_mla_model_is_refused():
    config = _config()
    config.model_config.use_mla = True
    with pytest.raises(KVTransferConfigError, match=r"^use_mla=True: "):
        refuse_unsupported_layout(config)


def test_a_refused_engine_starts_no_thread_of_ours():
    """The adapter refuses before its halves exist: no transport, no loop thread, no port."""
    from kvbridge.connector.vllm.adapter import KVBridgeConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    scheduler = make_scheduler("kv_consumer")  # a real config to spoil
    vllm_config = connector_of(scheduler)._vllm_config
    threads = set(threading.enumerate())
    vllm_config.parallel_config.pipeline_parallel_size = 2
    try:
        for role in (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER):
            with pytest.raises(KVTransferConfigError, match="pipeline_parallel_size=2"):
                KVBridgeConnector(vllm_config, role, None)  # type: ignore[arg-type]
    finally:
        vllm_config.parallel_config.pipeline_parallel_size = 1
    assert set(threading.enumerate()) == threads
