"""A wrong or stale ticket fails fast (issue 28, item 4), on kvbridge's own nodes.

P's holder refuses the blocks of a read whose ticket does not fit: another prompt's ticket (the
lease is held and names other hashes) or a stale one (the lease ended). Such a refusal is final:
the pull ends after the one read P answered, and the request follows the load-failure policy at
once ("recompute": the right tokens; "fail": ``finish_reason == "error"``). Only a lease P has
not been handed yet makes D ask again (``test_connector_pd``: a pull before the lease grant).

The lease, the load deadline and the sync-load deadline are all ``LONG_S`` here, so a failure
reported within ``FAST_S`` cannot come from a timeout; ``FAST_S`` bounds a hang, it is not a
timing benchmark. What tells a final refusal from retries is the number of reads P received
for the pull (before the fix: one, then five more over 0.38 s).
"""

from __future__ import annotations

import copy
import time

import pytest
from _engine_builders import reference_greedy
from _pd_builders import assert_pair_empty, decode, long_prompt, prefill, run_to_completion
from kvbridge.connector.lease import LeaseTable
from kvbridge.kvmanager import SamplingParams

MAX_TOKENS = 4
LONG_S = 30.0
FAST_S = 1.0


def _stats(engine):
    return engine.scheduler.connector.stats.snapshot()


def _reads_received(engine) -> int:
    return engine.runner.connector.worker_half.transport.num_reads_received


def _until_load_fails(pair, request_id, prompt, params):
    """D admits ``request_id`` with ``params`` and steps until its connector counts one more
    failed load; returns (seconds from admission, reads P received meanwhile, D's outputs)."""
    failed_before = _stats(pair.d)["num_failed_loads"]
    reads_before = _reads_received(pair.p)
    started = time.monotonic()
    pair.d.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
    outputs = []
    while _stats(pair.d)["num_failed_loads"] == failed_before:
        assert time.monotonic() - started < LONG_S, "the load never failed"
        outputs.extend(pair.d.step())
        time.sleep(0.001)
    elapsed = time.monotonic() - started
    return elapsed, _reads_received(pair.p) - reads_before, outputs


def _finish(pair, request_id, outputs):
    done = [o for o in outputs if o.request_id == request_id and o.finished]
    return done[0] if done else run_to_completion(pair.d, request_id)


@pytest.mark.parametrize(
    ("policy", "load_mode"),
    [("recompute", "async"), ("recompute", "sync"), ("fail", "async")],
)
def test_another_prompts_ticket_fails_after_one_read(pair_factory, policy, load_mode):
    pair = pair_factory(
        lease_s=LONG_S,
        load_timeout_s=LONG_S,
        sync_load_timeout_s=LONG_S,
        load_failure_policy=policy,
        load_mode=load_mode,
    )
    x, y = long_prompt(100), long_prompt(80, salt="Another prompt. ")
    assert len(x) >= len(y) and x[: len(y)] != y  # y's ticket passes x's admission
    pair.p.add_request("x", x, SamplingParams(max_tokens=1))  # P caches x too, elsewhere
    run_to_completion(pair.p, "x")
    ticket_y = prefill(pair, "y", y)
    # D gets x with y's ticket: P holds y's lease, whose blocks carry y's hashes, not x's.
    elapsed, num_reads, outputs = _until_load_fails(pair, "x", x, ticket_y)
    assert num_reads == 1, num_reads  # P's answer was final: D did not ask again
    assert elapsed < FAST_S, elapsed
    output = _finish(pair, "x", outputs)
    if policy == "recompute":
        assert output.token_ids == reference_greedy(x, MAX_TOKENS, hybrid=False)
        assert _stats(pair.d)["num_loads"] == 0
    else:
        assert output.finish_reason == "error"
    assert_pair_empty(pair)  # y's lease ended by D's notice; nothing leaks on either node


def test_a_stale_ticket_fails_after_one_read(pair_factory):
    pair = pair_factory(lease_s=LONG_S, load_timeout_s=LONG_S)
    prompt = long_prompt(40)  # 2 full blocks and a partial one, which only the lease guards
    params = prefill(pair, "req-0", prompt)
    stale = copy.deepcopy(params)  # a proxy's retry sends the ticket again, as it received it
    output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
    assert _stats(pair.d)["num_loads"] == 1  # the ticket's lease ends with this pull
    expected = reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert output.token_ids == expected
    assert pair.d.kv_cache_manager.reset_prefix_cache()
    # The same ticket again (a proxy's retry): the lease it names has ended on P.
    elapsed, num_reads, outputs = _until_load_fails(pair, "req-1", prompt, stale)
    assert num_reads == 1, num_reads
    assert elapsed < FAST_S, elapsed
    assert _finish(pair, "req-1", outputs).token_ids == expected
    assert_pair_empty(pair)


def test_only_a_lease_not_yet_granted_is_pending():
    """The holder's rule (``LeaseTable.grant_pending``): a read refused under a lease is worth
    asking again only while that lease may still be handed to the worker half."""
    now = [0.0]
    leases = LeaseTable(lease_s=10.0, clock=lambda: now[0])
    assert leases.grant_pending("r1", "tok")  # P answered the ticket, its next step grants
    leases.grant("r1", [[3, 4]], [b"h3"], token="tok")
    assert not leases.grant_pending("r1", "tok")  # held: its blocks are what they will be
    assert leases.grant_pending("r1", "guess")  # without the token: nothing learnt
    assert leases.release("r1", "tok")
    assert not leases.grant_pending("r1", "tok")  # ended by D's notice: a stale ticket
    leases.grant("r2", [[5]], token="tok")
    now[0] = 11.0
    assert leases.pop_finished() == ({"r1", "r2"}, 1)
    assert not leases.grant_pending("r2", "tok")  # expired
    assert not leases.release("r3", "tok")  # D gave up before P granted it
    assert not leases.grant_pending("r3", "tok")
