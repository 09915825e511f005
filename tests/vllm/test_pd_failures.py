"""P stalls, dies and comes back while D pulls (issue 13, "What must hold"): nothing hangs.

One P/D pair of in-process vLLM engines for the whole module; the tests run in file order
and share it. D runs vLLM's ``kv_load_failure_policy: "fail"`` (the handover module covers
``recompute``) with kvbridge's ``load_timeout_s`` at ``LOAD_TIMEOUT_S``, so a load that cannot
land ends its request with ``finish_reason == "error"`` within the deadline, and D goes on
serving. P listens on a fixed port so that its restart, under the same engine id, is reached
by tickets of the dead incarnation too.

P's block board is off (``cma_board: false``): every read here asks P and so needs P to answer.
With the board on, a P stopped after its worker had published a lease's blocks is still read
one-sided, correctly (the lease keeps those blocks as they were), and whether that happens
depends on whether P stepped once more before the stop: the deadline path would then be
tested by chance only.
"""

from __future__ import annotations

import time

import pytest
from _harness import Node, free_port, kvbridge_config, prefill_requests, request, start_nodes
from _prompts import N_NEW, PROMPTS

LOAD_TIMEOUT_S = 5.0
# On top of the deadline: a timed-out read waits up to 2 s for the holder's answer to its Cancel
# (transport/read_path.py CANCEL_REPLY_TIMEOUT_S; measured 7.0 s for a 5 s deadline against a
# stopped P), then vLLM's next step reports the failure.
SLACK_S = 5.0


class Scenario:
    def __init__(self, tiny_llama, log_dir) -> None:
        self.model, self.log_dir = tiny_llama, log_dir
        self.port = free_port()
        self.p = self.new_p("p1")
        self.d = Node("fail-d", model=tiny_llama, log_dir=log_dir, kv_transfer_config=(
            kvbridge_config("consumer", "decode-0", policy="fail",
                            load_timeout_s=LOAD_TIMEOUT_S)))
        self.tickets: dict[str, dict] = {}

    def new_p(self, tag: str) -> Node:
        return Node(f"fail-{tag}", model=self.model, log_dir=self.log_dir,
                    kv_transfer_config=kvbridge_config("producer", "prefill-0",
                                                       port=self.port, cma_board=False))

    def timed_generate(self, name: str, ticket: dict | None, *, kill_p_mid_pull=False):
        """D decodes ``name`` with ``ticket``: (its output, seconds). ``kill_p_mid_pull``
        kills P once D's pull has connected to it."""
        t0 = time.monotonic()
        self.d.submit([request(PROMPTS[name], N_NEW, ticket)])
        if kill_p_mid_pull:
            while not self.d.connected_to(self.port):
                assert time.monotonic() - t0 < LOAD_TIMEOUT_S, "D never connected to P"
                time.sleep(0.01)
            self.p.kill()
        (out,) = self.d.result(timeout_s=LOAD_TIMEOUT_S + 120)["outputs"]
        return out, time.monotonic() - t0


@pytest.fixture(scope="module")
def scenario(tiny_llama, log_dir, reference):  # reference first: its engine is gone
    sc = Scenario(tiny_llama, log_dir)
    start_nodes(sc.p, sc.d)
    yield sc
    sc.d.stop()
    sc.p.stop()


def test_p_killed_while_d_pulls(scenario):
    """P prefills and stops answering (SIGSTOP of its process group); D's pull connects to
    it, and P is killed outright: the load fails within the deadline and the request follows
    the failure policy (``fail``: ``finish_reason == "error"``)."""
    sc = scenario
    names = ["killed", "old_ticket"]
    outs = sc.p.generate(prefill_requests([PROMPTS[n] for n in names]))
    sc.tickets = {n: o["kv_transfer_params"] for n, o in zip(names, outs, strict=True)}
    assert all(t and t["do_remote_prefill"] for t in sc.tickets.values()), sc.tickets
    assert sc.tickets["killed"]["remote_port"] == sc.port
    sc.p.pause()
    out, elapsed = sc.timed_generate("killed", sc.tickets["killed"], kill_p_mid_pull=True)
    assert not sc.p.alive()
    assert out["finish_reason"] == "error", out
    assert elapsed < LOAD_TIMEOUT_S + SLACK_S, elapsed


def _served_and_drained(sc: Scenario, name: str, reference) -> None:
    (out,) = sc.d.generate([request(PROMPTS[name], N_NEW)], timeout_s=120)
    assert out["token_ids"] == reference[name]
    st = sc.d.wait_drained()
    assert st["requests"] == 0 and st["free_blocks"] == st["num_blocks"] - 1, st


def test_d_serves_the_next_request(scenario, reference):
    """After the failure D answers a plain request with a single instance's tokens, and it
    holds nothing: no request left, every block free (the failed load's blocks came back)."""
    _served_and_drained(scenario, "after", reference)
    assert scenario.d.stats()["num_failed_loads"] == 1


def test_restarted_p_is_a_new_incarnation(scenario, reference):
    """P restarted under the same engine id on the same port: a ticket of the dead incarnation
    is not served by the new one (the request fails, quickly), and the new P's own tickets
    hand over with a single instance's tokens."""
    sc = scenario
    sc.p = sc.new_p("p2")
    sc.p.wait_ready()
    (fresh,) = sc.p.generate(prefill_requests([PROMPTS["reborn"]]))
    ticket = fresh["kv_transfer_params"]
    old = sc.tickets["old_ticket"]
    assert ticket["remote_engine_id"] == old["remote_engine_id"] == "prefill-0"
    assert ticket["remote_port"] == old["remote_port"] == sc.port
    assert ticket.get("remote_incarnation") != old.get("remote_incarnation")

    out, elapsed = sc.timed_generate("old_ticket", old)
    assert out["finish_reason"] == "error", out
    assert elapsed < LOAD_TIMEOUT_S + SLACK_S, elapsed

    before = sc.d.stats()
    out, _ = sc.timed_generate("reborn", ticket)
    after = sc.d.stats()
    assert out["token_ids"] == reference["reborn"]
    assert after["num_loads"] - before["num_loads"] == 1, after
    assert after["num_failed_loads"] == before["num_failed_loads"], after


def test_a_null_block_in_the_ticket_fails_the_request(scenario, reference):
    """A ticket whose full-attention list names P's null block (id 0) where D needs a block
    is a wrong ticket: under ``fail`` the request errors at once (no timeout: nothing is
    read for that position), P's lease is released, and D serves the next request."""
    sc = scenario
    (o,) = sc.p.generate(prefill_requests([PROMPTS["null_block"]]))
    ticket = dict(o["kv_transfer_params"])
    ticket["remote_block_ids"] = [list(ids) for ids in ticket["remote_block_ids"]]
    ticket["remote_block_ids"][0][1] = 0
    before = sc.d.stats()
    out, elapsed = sc.timed_generate("null_block", ticket)
    assert out["finish_reason"] == "error", out
    assert elapsed < LOAD_TIMEOUT_S, elapsed
    after = sc.d.stats()
    assert after["num_failed_loads"] - before["num_failed_loads"] == 1, after
    assert after["num_window_gaps"] == before["num_window_gaps"], after
    _served_and_drained(sc, "after_null_block", reference)
    p_state = sc.p.wait_drained()
    assert p_state["requests"] == 0 and p_state["free_blocks"] == p_state["num_blocks"] - 1


def test_another_prompts_ticket_fails_the_request_at_once(scenario, reference):
    """D gets x with P's ticket for y, which shares x's full blocks and differs only in the
    partial last block (no block hash guards it): under ``fail`` the request errors, at once
    (D refuses the ticket by its ``remote_prompt_digest`` and reads nothing), where before D
    loaded y's tail and answered with y's tokens. P's lease is released; D serves the next
    request and holds nothing."""
    sc = scenario
    (o,) = sc.p.generate(prefill_requests([PROMPTS["tail_y"]]))
    before = sc.d.stats()
    out, elapsed = sc.timed_generate("tail_x", o["kv_transfer_params"])
    assert out["finish_reason"] == "error", out
    assert elapsed < LOAD_TIMEOUT_S, elapsed
    after = sc.d.stats()
    assert after["num_failed_loads"] - before["num_failed_loads"] == 1, after
    assert after["num_blocks_received"] == before["num_blocks_received"], after
    _served_and_drained(sc, "after_wrong", reference)
    p_state = sc.p.wait_drained()
    assert p_state["requests"] == 0 and p_state["free_blocks"] == p_state["num_blocks"] - 1


def test_stalled_p_fails_the_load_within_the_deadline(scenario, reference):
    """The restarted P prefills, then stops answering for good: D's request ends with the
    failure policy within the load deadline, not when (if ever) P comes back, and D serves
    the next request."""
    sc = scenario
    (o,) = sc.p.generate(prefill_requests([PROMPTS["stalled"]]))
    sc.p.pause()
    out, elapsed = sc.timed_generate("stalled", o["kv_transfer_params"])
    assert out["finish_reason"] == "error", out
    assert elapsed < LOAD_TIMEOUT_S + SLACK_S, elapsed
    _served_and_drained(sc, "after_stall", reference)
