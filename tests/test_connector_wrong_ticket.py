"""A wrong or stale ticket fails fast (issue 28, item 4), on kvbridge's own nodes.

Another prompt's ticket is refused by D before anything is read: the ticket carries the digest
of the prompt it covers (``remote_prompt_digest``), which D compares with its own request's.
That also covers a prompt that shares every full block with the ticket's and differs only in
the partial last block, which has no hash for P to check (before, D loaded the other prompt's
tail there and answered with the other prompt's tokens). Under "recompute" D computes the
prompt at once; under "fail" the request errors, through a load that reads nothing.

What D cannot refuse itself (a ticket without a digest, a stale ticket whose lease ended) P's
holder refuses, and that refusal is final: the pull ends after the one read P answered. Only a
lease P has not been handed yet makes D ask again (``test_connector_pd``: a pull before the
lease grant).

The lease, the load deadline and the sync-load deadline are all ``LONG_S`` here, so a failure
reported within ``FAST_S`` cannot come from a timeout; ``FAST_S`` bounds a hang, it is not a
timing benchmark. What tells the paths apart is the number of reads P received for the pull
(before: one, then five more over 0.38 s).
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
FAST_S = 5.0  # far below LONG_S; a loaded CI host took up to 2.7 s


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
        assert not any(o.request_id == request_id and o.finished for o in outputs), (
            "the request finished without a failed load", outputs)
        outputs.extend(pair.d.step())
        time.sleep(0.001)
    elapsed = time.monotonic() - started
    return elapsed, _reads_received(pair.p) - reads_before, outputs


def _finish(pair, request_id, outputs):
    done = [o for o in outputs if o.request_id == request_id and o.finished]
    return done[0] if done else run_to_completion(pair.d, request_id)


def _prompts(kind: str) -> tuple[list[int], list[int]]:
    """(x, y): D gets x with y's ticket; x is at least as long as y, so the ticket passes
    admission."""
    x = long_prompt(100)
    if kind == "another prompt":
        y = long_prompt(80, salt="Another prompt. ")
    else:  # y shares x's 6 full blocks; its partial 7th block holds other tokens
        y = x[:96] + long_prompt(5, salt="Zz")[1:]
    assert len(x) >= len(y) and x[: len(y)] != y
    return x, y


def _pair_and_tickets(pair_factory, kind, **kwargs):
    pair = pair_factory(lease_s=LONG_S, load_timeout_s=LONG_S, sync_load_timeout_s=LONG_S,
                        **kwargs)
    x, y = _prompts(kind)
    pair.p.add_request("x", x, SamplingParams(max_tokens=1))  # P caches x too, elsewhere
    run_to_completion(pair.p, "x")
    return pair, x, prefill(pair, "y", y)


def _check_outcome(pair, output, x, policy):
    if policy == "recompute":
        assert output.token_ids == reference_greedy(x, MAX_TOKENS, hybrid=False)
        assert _stats(pair.d)["num_loads"] == 0
    else:
        assert output.finish_reason == "error"
    assert _stats(pair.d)["num_rejected_params"] == 0  # a failed load, not a malformed ticket
    assert_pair_empty(pair)  # y's lease ended by D's notice; nothing leaks on either node


@pytest.mark.parametrize("kind", ["another prompt", "another tail"])
@pytest.mark.parametrize(
    ("policy", "load_mode"),
    [("recompute", "async"), ("recompute", "sync"), ("fail", "async"), ("fail", "sync")],
)
def test_another_prompts_ticket_is_refused_before_any_read(pair_factory, kind, policy,
                                                           load_mode):
    pair, x, ticket_y = _pair_and_tickets(pair_factory, kind, load_failure_policy=policy,
                                          load_mode=load_mode)
    elapsed, num_reads, outputs = _until_load_fails(pair, "x", x, ticket_y)
    assert num_reads == 0, num_reads  # D refused the ticket itself
    assert elapsed < FAST_S, elapsed
    _check_outcome(pair, _finish(pair, "x", outputs), x, policy)


@pytest.mark.parametrize(
    ("policy", "load_mode"),
    [("recompute", "async"), ("recompute", "sync"), ("fail", "async")],
)
def test_a_ticket_without_a_digest_fails_after_one_read(pair_factory, policy, load_mode):
    """A P that sends no ``remote_prompt_digest``: P's hash check refuses the blocks of
    another prompt, and its answer is final."""
    pair, x, ticket_y = _pair_and_tickets(pair_factory, "another prompt",
                                          load_failure_policy=policy, load_mode=load_mode)
    del ticket_y["remote_prompt_digest"]
    elapsed, num_reads, outputs = _until_load_fails(pair, "x", x, ticket_y)
    assert num_reads == 1, num_reads  # P's answer was final: D did not ask again
    assert elapsed < FAST_S, elapsed
    _check_outcome(pair, _finish(pair, "x", outputs), x, policy)


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


def test_a_lease_some_decode_ranks_let_go_of_before_its_grant_is_still_pending():
    """Tensor parallel: decode rank 0 read its heads from prefill rank 0 and let go of every
    prefill rank, rank 1 included, before prefill rank 1's worker was handed the lease; decode
    rank 1 has still to read from it. Its read refused now must be asked again (it was final,
    and decode rank 1's load failed now and then: tests/vllm/test_pd_tp.py in CI)."""
    leases = LeaseTable(lease_s=10.0)
    assert not leases.release("r1", "tok", puller_rank=0, num_pullers=2)
    assert leases.grant_pending("r1", "tok")  # rank 1 of the puller may still read
    leases.grant("r1", [[3, 4]], [b"h3"], token="tok")
    assert leases.is_held("r1")  # one rank's release does not end it
    assert leases.release("r1", "tok", puller_rank=1, num_pullers=2)
    assert not leases.is_held("r1")
    # every rank let go before the grant: the lease is over before it starts
    assert not leases.release("r2", "tok", puller_rank=1, num_pullers=2)
    assert not leases.release("r2", "tok", puller_rank=0, num_pullers=2)
    assert not leases.grant_pending("r2", "tok")


def _request(tokens, **kwargs):
    from kvbridge.kvmanager.block_hash import get_request_block_hasher
    from kvbridge.kvmanager.request import Request

    hasher = get_request_block_hasher(16, "sha256_cbor")
    return Request("r", tokens, block_hasher=hasher, **kwargs)


def test_the_prompt_digest_covers_every_input_of_the_tokens_it_names():
    """Equal for the same prompt (P's and D's requests alike), different for a change anywhere
    in the covered tokens, the partial last block included, and for another LoRA or cache salt
    even with no full block; tokens past the covered ones do not count. A prompt whose inputs
    are not all token ids gets none (D then leaves the check to P's hash check)."""
    import torch
    from kvbridge.connector.prompt_digest import prompt_digest

    x = long_prompt(40)  # 2 full blocks of 16 and 8 tokens
    digest = prompt_digest(_request(x), 40, 16)
    assert len(digest) == 64 and digest == prompt_digest(_request(x), 40, 16)
    assert prompt_digest(_request([*x, 7, 8]), 40, 16) == digest  # D's longer prompt
    for changed in (0, 20, 39):  # a full block's token, the partial block's
        other = list(x)
        other[changed] += 1
        assert prompt_digest(_request(other), 40, 16) != digest, changed
    assert prompt_digest(_request(x), 39, 16) != digest
    short = x[:10]
    plain = prompt_digest(_request(short), 10, 16)
    assert prompt_digest(_request(short, lora_name="a"), 10, 16) != plain
    assert prompt_digest(_request(short, cache_salt="s"), 10, 16) != plain
    embeds = torch.zeros(len(x), 4)
    assert prompt_digest(_request(x, prompt_embeds=embeds), 40, 16) == ""
    with pytest.raises(ValueError, match="num_tokens 41"):
        prompt_digest(_request(x), 41, 16)


@pytest.mark.parametrize("digest", [7, "ab", "A" * 64, "g" * 64, "0" * 65])
def test_a_malformed_prompt_digest_is_refused_naming_the_field(pair_factory, digest):
    from kvbridge.connector.errors import KVTransferParamsError
    from kvbridge.connector.transfer_params import RemotePrefillParams

    pair = pair_factory()
    params = {**prefill(pair, "req-0", long_prompt(40)), "remote_prompt_digest": digest}
    with pytest.raises(KVTransferParamsError, match="remote_prompt_digest"):
        RemotePrefillParams.parse(params, num_groups=1, block_size=16)
    params["remote_prompt_digest"] = ""  # a P that sends none
    assert RemotePrefillParams.parse(params, num_groups=1, block_size=16).remote_prompt_digest == ""
