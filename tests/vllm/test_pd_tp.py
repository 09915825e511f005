"""P/D between tensor-parallel vLLM engines (issue 30, "What must hold").

Engines here run ``tensor_parallel_size`` 2 on vLLM's multiprocess executor (one worker process
per rank; EngineCore stays in the node process, so D's connector statistics can be read), the
tiny Llama's 2 KV heads one per rank. D runs ``kv_load_failure_policy: "recompute"``, so a load
that cannot land still ends with a single instance's tokens. The tests run in file order and
share the engines, started when first needed and stopped once no later test needs them, so at
most three engines (seven processes) are alive at once:

    test                                       P            D
    same size, prompts of 31 / 64 / 1,000      TP 2         TP 2
    a ticket naming P's ranks swapped          TP 2         TP 2
    P narrower                                 TP 1         TP 2
    P wider                                    TP 2         TP 1 (reads over UCX)
    a P worker killed while D pulls            TP 2         TP 1

What each D rank pulled is counted per rank by D's connector (``Node.rank_stats``); D's node
counters and P's count each request once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from _harness import (
    Node,
    NodeError,
    _group_pids,
    kvbridge_config,
    prefill_requests,
    request,
    start_nodes,
    tokens,
)
from _prompts import N_NEW, PROMPTS

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# What these tests check is which heads move, not how fast: the deadline bounds a hang. On this
# host it is 30 s, as in test_pd_handover and test_pd_hybrid, because the connector's loop
# thread shares the GIL with vLLM's worker, and two things of vLLM's were seen to starve it
# for seconds (the stall dumps of KVBRIDGE_STALL_DUMP_S): a TP worker's first forward, which
# compiles vocab_parallel_embedding's get_masked_input_and_mask (torch.compile: seconds of
# Python, and a C++ compiler taking the cores), and a worker spinning in os.sched_yield
# (shm_broadcast) while its engine steps, on a host with fewer cores than busy processes. A
# new engine here is warmed up with one plain request first (``WARMUP``), so the compile is
# behind it before any test counts; the spinning stays, as in a busy deployment.
LOAD_TIMEOUT_S = 30.0
WARMUP = tokens(95, 40)  # a plain prompt no test uses
KV_HEAD_BYTES_PER_TOKEN = 2 * 32 * 4 * 2  # K and V, head size 32, float32, 2 layers
GROUPS = {"a": ("tp_a31", "tp_a64", "tp_a1000"), "b": ("tp_b31", "tp_b64", "tp_b1000"),
          "c": ("tp_c31", "tp_c64", "tp_c1000")}

SPECS = {  # name -> (role, engine id, tensor-parallel size, more connector settings)
    "p2": ("producer", "prefill-tp2", 2, {}),
    "d2": ("consumer", "decode-tp2", 2, {}),
    "p1": ("producer", "prefill-tp1", 1, {}),
    "d1": ("consumer", "decode-tp1", 1, {"cma": False}),
}


class Fleet:
    """The module's engines by name (``SPECS``), started on first use."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.nodes: dict[str, Node] = {}

    def get(self, *names: str) -> list[Node]:
        new = [self._node(n) for n in names if n not in self.nodes]
        start_nodes(*new)
        for node in new:
            node.generate([request(WARMUP, 2)])  # its first forward compiles (see WARMUP)
            self.nodes[node.name.removeprefix("tp-")] = node
        return [self.nodes[n] for n in names]

    def _node(self, name: str) -> Node:
        role, engine_id, tp_size, extra = SPECS[name]
        config = kvbridge_config(role, engine_id, policy="recompute",
                                 load_timeout_s=LOAD_TIMEOUT_S, **extra)
        return Node(f"tp-{name}", model=self.model, log_dir=self.log_dir,
                    llm=TP2 if tp_size == 2 else {}, kv_transfer_config=config)

    def stop(self, *names: str) -> None:
        for name in names:
            node = self.nodes.pop(name, None)
            if node is not None:
                node.stop()


@pytest.fixture(scope="module")
def fleet(tiny_llama, log_dir, reference):  # reference first: its engine is gone
    made = Fleet(tiny_llama, log_dir)
    yield made
    made.stop(*list(made.nodes))


def _handover(p: Node, d: Node, names, reference) -> tuple[dict, dict, dict]:
    """P prefills ``names``, D decodes them with P's tickets; D's tokens must be a single
    instance's. Returns D's node stats and rank stats before and after (deltas)."""
    tickets = [o["kv_transfer_params"] for o in p.generate(prefill_requests(
        [PROMPTS[n] for n in names]))]
    assert all(t and t["do_remote_prefill"] for t in tickets), tickets
    d_before, ranks_before, p_before = d.stats(), d.rank_stats(), p.stats()
    outs = d.generate([request(PROMPTS[n], N_NEW, t) for n, t in zip(names, tickets, strict=True)])
    for name, out in zip(names, outs, strict=True):
        assert out["token_ids"] == reference[name], name
    p_after = _wait_released(p, p_before, len(names))
    d_after, ranks_after = d.stats(), d.rank_stats()
    delta = {k: d_after[k] - d_before[k] for k in ("num_loads", "num_failed_loads",
                                                    "bytes_received")}
    rank_delta = {r: {k: s[k] - ranks_before.get(r, {}).get(k, 0)
                      for k in ("num_loads", "bytes_received")}
                  for r, s in ranks_after.items()}
    p_delta = {k: p_after[k] - p_before[k] for k in ("num_released_leases", "num_expired_leases")}
    return delta, rank_delta, p_delta


def _wait_released(p: Node, before: dict, n: int, timeout_s: float = 2 * LOAD_TIMEOUT_S) -> dict:
    """P's stats once its leases of ``n`` more requests were released (at once when they are;
    the timeout outlasts a D loop stalled for about a lease, ``_harness.kvbridge_config``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = p.stats()
        if after["num_released_leases"] - before["num_released_leases"] >= n or \
                time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def _pulled_bytes(names, d_heads: int) -> int:
    """KV bytes a D rank holding ``d_heads`` heads pulls for ``names`` (all prompt tokens but
    the last, in whole 32-token blocks)."""
    blocks = sum(-(-(len(PROMPTS[n]) - 1) // 32) for n in names)
    return blocks * 32 * d_heads * KV_HEAD_BYTES_PER_TOKEN


def _assert_counted_once(delta, rank_delta, p_delta, names, d_size: int) -> None:
    n = len(names)
    assert (delta["num_loads"], delta["num_failed_loads"]) == (n, 0), delta
    assert delta["bytes_received"] == _pulled_bytes(names, 2), delta  # both heads, all ranks
    assert sorted(rank_delta) == list(range(d_size)), rank_delta
    for rank, counts in rank_delta.items():  # each rank pulled its own head, every request
        assert counts == {"num_loads": n, "bytes_received": _pulled_bytes(names, 2 // d_size)}, \
            (rank, counts)
    assert p_delta == {"num_released_leases": n, "num_expired_leases": 0}, p_delta


def test_same_size_each_d_rank_pulls_its_head_from_its_p_rank(fleet, reference):
    p, d = fleet.get("p2", "d2")
    names = GROUPS["a"]
    _assert_counted_once(*_handover(p, d, names, reference), names, d_size=2)
    assert p.wait_drained()["requests"] == 0  # every P rank let go of every request


def _swap_ranks(ticket: dict) -> dict:
    """P's two ranks swapped in the ticket, consistently (rank 0's fields too)."""
    ranks = list(reversed(ticket["remote_ranks"]))
    return {**ticket, "remote_ranks": ranks, "remote_host": ranks[0]["host"],
            "remote_port": ranks[0]["port"], "remote_incarnation": ranks[0]["incarnation"]}


def test_a_ticket_naming_ps_ranks_swapped_fails_the_load_never_loads_the_wrong_heads(
        fleet, reference):
    """Each D rank is sent to the P rank holding the other head (as when every D rank read
    P's rank 0, before this issue): each P rank refuses the read, the load fails, D
    recomputes (right tokens), and P still frees the blocks."""
    p, d = fleet.get("p2", "d2")
    (out,) = p.generate(prefill_requests([PROMPTS["tp_swapped"]]))
    before = d.stats()
    (decoded,) = d.generate([request(PROMPTS["tp_swapped"], N_NEW,
                                     _swap_ranks(out["kv_transfer_params"]))])
    assert decoded["token_ids"] == reference["tp_swapped"]
    after = d.stats()
    assert (after["num_failed_loads"] - before["num_failed_loads"],
            after["num_loads"] - before["num_loads"]) == (1, 0), after
    assert p.wait_drained()["requests"] == 0
    assert "holds KV heads" in Path(d.log_path).read_text(errors="replace")


def test_a_narrower_p_each_d_rank_pulls_its_head_of_ps_blocks(fleet, reference):
    p, d = fleet.get("p1", "d2")
    names = GROUPS["b"]
    _assert_counted_once(*_handover(p, d, names, reference), names, d_size=2)
    fleet.stop("p1", "d2")


def test_a_wider_p_the_d_rank_pulls_each_p_ranks_head(fleet, reference):
    p, d = fleet.get("p2", "d1")
    names = GROUPS["c"]
    _assert_counted_once(*_handover(p, d, names, reference), names, d_size=1)


def test_a_p_worker_killed_while_d_pulls(fleet, reference):
    """P stops answering, D's pull (over UCX: it needs P) reaches both P ranks, and P's rank-1
    worker is killed: D's request follows the failure policy (recompute: a single instance's
    tokens) within the load deadline, nothing hangs, and D serves the next request."""
    p, d = fleet.get("p2", "d1")
    (out,) = p.generate(prefill_requests([PROMPTS["tp_killed"]]))
    ticket = out["kv_transfer_params"]
    rank1 = p.pid_listening_on(ticket["remote_ranks"][1]["port"])
    assert rank1 is not None and rank1 != p.pid
    before = d.stats()
    p.pause()
    t0 = time.monotonic()
    d.submit([request(PROMPTS["tp_killed"], N_NEW, ticket)])
    time.sleep(1.0)  # the reads are out, P answers nothing
    os.kill(rank1, signal.SIGKILL)
    p.resume()
    (decoded,) = d.result(timeout_s=LOAD_TIMEOUT_S + 60)["outputs"]
    assert decoded["token_ids"] == reference["tp_killed"]
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 10
    assert d.stats()["num_failed_loads"] - before["num_failed_loads"] == 1
    (after,) = d.generate([request(PROMPTS["tp_after"], N_NEW)], timeout_s=120)
    assert after["token_ids"] == reference["tp_after"]
    state = d.wait_drained()
    assert state["requests"] == 0 and state["free_blocks"] == state["num_blocks"] - 1, state
    fleet.stop("p2", "d1")


def test_a_pipeline_parallel_engine_is_refused_at_start_and_leaves_nothing(fleet, log_dir):
    """The refusal names the setting to whoever starts the engine, and the engine's processes
    all end by themselves (the connector refused in each worker before starting anything of
    its own: ``test_vllm_scheduler_tp`` checks that no thread starts)."""
    node = Node("tp-pp2", model=fleet.model, log_dir=log_dir,
                llm={"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},
                kv_transfer_config=kvbridge_config("producer", "prefill-pp"))
    try:
        with pytest.raises(NodeError, match=r"pipeline_parallel_size=2: kvbridge moves KV"):
            node.wait_ready()
        deadline = time.monotonic() + 120
        # alive() reaps the node process once it exited (else it would linger as a zombie)
        while (node.alive() or _group_pids(node.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not node.alive() and not _group_pids(node.pid), "the refused engine still runs"
    finally:
        node.kill()
