"""The errors a user meets first, each one log line that says what to change (issue 29, part 5),
on kvbridge's own nodes over the loopback transport: a request sent to an engine whose
``kv_role`` ignores its ``kv_transfer_params``, and a ticket naming a prefill node that cannot be
reached. (An unknown extra key: ``test_connector_config.py``.)"""

from __future__ import annotations

import logging

import pytest
from _engine_builders import reference_greedy
from _pd_builders import assert_node_empty, decode, long_prompt, prefill
from kvbridge.kvmanager import SamplingParams

MAX_TOKENS = 3


def _warnings(caplog, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and fragment in r.getMessage()]


def test_a_ticket_sent_to_the_prefill_engine_is_served_plainly_and_said_once(pair_factory,
                                                                               caplog):
    # A proxy with P and D swapped sends D's requests (with P's ticket) to P: P computes each
    # prompt itself (right tokens) and says once what to change.
    pair = pair_factory()
    prompts = [long_prompt(40, salt=f"{i} ") for i in range(2)]
    tickets = [prefill(pair, f"p-{i}", p) for i, p in enumerate(prompts)]
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        for i, (prompt, ticket) in enumerate(zip(prompts, tickets, strict=True)):
            output = decode(pair.__class__(p=pair.d, d=pair.p, hybrid=False,
                                           p_faults=pair.p_faults, network=pair.network),
                            f"d-{i}", prompt, ticket, MAX_TOKENS)
            assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    (line,) = _warnings(caplog, "do_remote_prefill=true")
    assert "kv_role is 'kv_producer'" in line and "kv_consumer" in line
    assert pair.p.scheduler.connector.stats.snapshot()["num_role_mismatches"] == 2


def test_a_handover_request_sent_to_the_decode_engine_is_said_once(pair_factory, caplog):
    pair = pair_factory()
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        for i in range(2):
            pair.d.add_request(f"r-{i}", long_prompt(20, salt=f"{i} "),
                               SamplingParams(max_tokens=1),
                               kv_transfer_params={"do_remote_decode": True})
        while pair.d.has_unfinished_requests():
            pair.d.step()
    (line,) = _warnings(caplog, "do_remote_decode=true")
    assert "kv_role is 'kv_consumer'" in line and "kv_producer" in line
    assert pair.d.scheduler.connector.stats.snapshot()["num_role_mismatches"] == 2
    assert_node_empty(pair.d)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_ticket_naming_an_unreachable_prefill_node_says_what_to_check(pair_factory, caplog,
                                                                         policy):
    pair = pair_factory(load_failure_policy=policy)
    prompt = long_prompt(50)
    ticket = {**prefill(pair, "req-0", prompt), "remote_port": 999}  # nobody listens there
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        output = decode(pair, "req-0", prompt, ticket, MAX_TOKENS)
    assert output.finish_reason == ("length" if policy == "recompute" else "error")
    (line,) = _warnings(caplog, "unreachable")
    assert "is prefill-0 running" in line and "'host'/'port'" in line and ":999 " in line
    assert pair.d.scheduler.connector.stats.snapshot()["num_failed_loads"] == 1
    assert_node_empty(pair.d)
