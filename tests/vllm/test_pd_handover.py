"""P/D between two stock vLLM engines with kvbridge's connector (issue 13, "What must hold").

P (``kv_producer``) and D (``kv_consumer``) are two vLLM processes alive at once, built from the
contract users write (``kv_connector: KVBridgeConnector``, ``kv_connector_module_path:
kvbridge.connector.vllm``). P prefills with ``{"do_remote_decode": true}`` and one token; D
decodes with P's ticket. One P/D pair per variant (module-scoped, shared by the tests below):

- ``cma``: the same-host copy path, both engines in-process, D's ``load_mode`` the default
  "auto" (once D is connected to P, a handoff it reads one-sided from P's block board loads
  inside the step that computes it);
- ``cma-async``: the same, with every pull over later steps (``load_mode`` "async");
- ``ucx``: ``cma: false`` (every read over UCX), P on vLLM's multiprocess executor (its worker
  half in another process than its scheduler half), D in-process;
- ``cma-mp-d``: the same-host copy path, D on the multiprocess executor;
- ``cma-sync``: the same-host copy path with D's ``load_mode`` "sync" (vLLM's synchronous
  external load: the pull runs inside the step whose forward reads it), both in-process.

What D's connector counted (``stats``) and what P's scheduler still holds (``state``) are read
only from in-process nodes; on an mp node those checks are left out and the tokens decide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from _harness import BLOCK, Node, kvbridge_config, prefill_requests, request, start_nodes
from _prompts import HANDOVER, N_NEW, PARTIAL_PREFIX_BLOCKS, PROMPTS, SHARED_PREFIX_BLOCKS

VARIANTS = {
    "cma": dict(cma=True, p_mode="inproc", d_mode="inproc", load_mode="auto"),
    "cma-async": dict(cma=True, p_mode="inproc", d_mode="inproc", load_mode="async"),
    "ucx": dict(cma=False, p_mode="mp", d_mode="inproc", load_mode="auto"),
    "cma-mp-d": dict(cma=True, p_mode="inproc", d_mode="mp", load_mode="auto"),
    "cma-sync": dict(cma=True, p_mode="inproc", d_mode="inproc", load_mode="sync"),
}


@dataclass
class Pair:
    p: Node
    d: Node
    cma: bool
    load_mode: str

    @property
    def sync(self) -> bool:
        """D may load a handoff inside the step ("sync", or "auto" over the same-host path)."""
        return self.load_mode == "sync" or (self.load_mode == "auto" and self.cma)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tiny_llama, log_dir, reference):  # reference first: its engine is gone
    v = VARIANTS[request.param]
    tag = request.param
    p = Node(f"{tag}-p", model=tiny_llama, log_dir=log_dir, mode=v["p_mode"],
             kv_transfer_config=kvbridge_config("producer", "prefill-0", cma=v["cma"]))
    d = Node(f"{tag}-d", model=tiny_llama, log_dir=log_dir, mode=v["d_mode"],
             kv_transfer_config=kvbridge_config("consumer", "decode-0", cma=v["cma"],
                                                load_timeout_s=30.0,
                                                load_mode=v["load_mode"]))
    start_nodes(p, d)
    yield Pair(p, d, v["cma"], v["load_mode"])
    d.stop()
    p.stop()


def _delta(after: dict, before: dict, key: str) -> int:
    return after[key] - before[key]


def _handover(pair: Pair, names: list[str], tickets_for: list[str] | None = None):
    """P prefills ``tickets_for`` (default ``names``); D decodes ``names`` with those tickets.
    Returns (P's outputs, D's outputs, D's stats before, D's stats after)."""
    tickets_for = tickets_for or names
    p_out = pair.p.generate(prefill_requests([PROMPTS[n] for n in tickets_for]))
    for o in p_out:
        assert o["kv_transfer_params"] and o["kv_transfer_params"]["do_remote_prefill"], o
    before = pair.d.stats()
    d_out = pair.d.generate([request(PROMPTS[n], N_NEW, o["kv_transfer_params"])
                             for n, o in zip(names, p_out, strict=True)])
    return p_out, d_out, before, pair.d.stats()


def test_d_decodes_single_instance_tokens(pair, reference):
    """>= 8 prompts (5, 31, 32, 33, 64, 2000 tokens, three sharing a 640-token prefix) in one
    batch: P's first token and D's 8 greedy tokens equal a plain engine's; the KV came over
    the configured path, and P ends up holding nothing (D's completion notices arrived)."""
    assert len(HANDOVER) >= 8
    p_out, d_out, before, after = _handover(pair, HANDOVER)
    for name, o in zip(HANDOVER, p_out, strict=True):
        assert o["token_ids"] == reference[name][:1], name
        assert o["kv_transfer_params"]["remote_num_tokens"] == len(PROMPTS[name])
    got = {n: o["token_ids"] for n, o in zip(HANDOVER, d_out, strict=True)}
    assert got == {n: reference[n] for n in HANDOVER}
    assert all(o["finish_reason"] == "length" for o in d_out)
    if after is not None:
        lengths = [len(PROMPTS[n]) for n in HANDOVER]
        assert _delta(after, before, "num_failed_loads") == 0
        assert _delta(after, before, "num_load_errors_blocks") == 0
        assert _delta(after, before, "num_loads") >= sum(n >= BLOCK for n in lengths)
        blocks = _delta(after, before, "num_blocks_received")
        # every full block but a block-aligned prompt's last (vLLM recomputes the last token)
        # at least; at most every block, partial ones included. A sync load's blocks enter
        # D's prefix cache at once (vLLM delays caching only for async loads), so the two
        # later prompts of the shared group may find the prefix there and pull only the rest.
        floor = sum((n - 1) // BLOCK for n in lengths)
        assert floor - (2 * SHARED_PREFIX_BLOCKS if pair.sync else 0) <= blocks
        assert blocks <= sum(-(-n // BLOCK) for n in lengths)
        received = _delta(after, before, "bytes_received")
        same_host = _delta(after, before, "bytes_received_same_host")
        assert received > 0
        assert same_host == (received if pair.cma else 0)
        # same-host pulls are checked on P's block board alone; one whose lease P's worker
        # had not yet been handed (its next step) asks P instead, and one that P then refused
        # for the same reason tries again (``LEASE_GRANT_RETRY_S``), maybe one-sided: a load
        # counts at most one one-sided read and at least one of the two
        one_sided = _delta(after, before, "num_one_sided_loads")
        asked = _delta(after, before, "num_board_fallbacks")
        num_loads = _delta(after, before, "num_loads")
        if pair.cma:
            assert 1 <= one_sided <= num_loads <= one_sided + asked
        else:
            assert one_sided == asked == 0
    p_state = pair.p.wait_drained()
    if p_state is not None:
        assert p_state["requests"] == 0, p_state
        assert p_state["free_blocks"] == p_state["num_blocks"] - 1, p_state
        p_stats = pair.p.stats()
        assert p_stats["num_expired_leases"] == 0, p_stats
    d_state = pair.d.wait_drained()
    if d_state is not None:
        assert d_state["requests"] == 0 and d_state["free_blocks"] == d_state["num_blocks"] - 1


def test_partial_local_hit_pulls_only_the_rest(pair, reference):
    """D first serves a prompt on its own (its 320-token prefix lands in D's prefix cache),
    then gets P's ticket for another prompt with that prefix: the tokens equal a plain
    engine's, and D pulls no block of the prefix it already had."""
    (local,) = pair.d.generate([request(PROMPTS["partial_local"], N_NEW)])
    assert local["token_ids"] == reference["partial_local"]
    _, (out,), before, after = _handover(pair, ["partial_remote"])
    assert out["token_ids"] == reference["partial_remote"]
    if after is not None:
        n_blocks = -(-len(PROMPTS["partial_remote"]) // BLOCK)
        pulled = _delta(after, before, "num_blocks_received")
        assert 0 < pulled <= n_blocks - PARTIAL_PREFIX_BLOCKS, (pulled, n_blocks)
        assert _delta(after, before, "num_failed_loads") == 0
        # D is connected to P by now: under "auto" the same-host handoff is read one-sided
        # and loads inside the step that computes it; under "async" it never does
        in_step = {"auto": int(pair.cma), "async": 0, "sync": 1}[pair.load_mode]
        assert _delta(after, before, "num_sync_loads") == in_step, after
        if pair.cma:  # one-sided, or asked P when its worker had not yet been handed the
            # lease (P's next step publishes it; the test harness steps P every 2 ms), and
            # after a refusal for that reason maybe one-sided on the retry
            one_sided = _delta(after, before, "num_one_sided_loads")
            asked = _delta(after, before, "num_board_fallbacks")
            assert _delta(after, before, "num_loads") == 1, after
            assert one_sided <= 1 <= one_sided + asked, after


def _wrong_ticket(pair: Pair, x_name: str, y_name: str, *, digest: bool = True,
                  granted: bool = False):
    """P prefills x (plainly) and y (for D); D decodes x with y's ticket (without its
    ``remote_prompt_digest`` unless ``digest``). Returns (D's output, its stats before, after,
    y's ticket). x is at least as long as y, so the ticket passes admission. ``granted``: P
    steps once more first (x again), which hands y's lease to P's worker (P's board shows it)."""
    x, y = PROMPTS[x_name], PROMPTS[y_name]
    assert x[: len(y)] != y and len(x) >= len(y)
    p_out = pair.p.generate([request(x, 1), *prefill_requests([y])])
    if granted:
        pair.p.generate([request(x, 1)])
    ticket_y = p_out[1]["kv_transfer_params"]
    assert ticket_y["remote_num_tokens"] == len(y)
    sent = dict(ticket_y) if digest else {
        k: v for k, v in ticket_y.items() if k != "remote_prompt_digest"}
    before = pair.d.stats()
    (out,) = pair.d.generate([request(x, N_NEW, sent)])
    return out, before, pair.d.stats(), ticket_y


def _assert_recomputed(pair: Pair, out, before, after, x_name: str, y_name: str,
                       reference: dict) -> None:
    """x's tokens (recomputed, the ``recompute`` policy), a failed load counted for y's blocks,
    none received, and P holding nothing once D's notice released y's lease."""
    assert out["token_ids"] == reference[x_name]
    assert out["finish_reason"] == "length"
    if after is not None:
        assert _delta(after, before, "num_rejected_params") == 0, after  # admitted
        assert _delta(after, before, "num_failed_loads") == 1, after
        assert _delta(after, before, "num_loads") == 0, after
        assert _delta(after, before, "num_blocks_received") == 0, after
        # y's 150 tokens are 5 blocks on P, all of them planned for x on D
        num_blocks = -(-len(PROMPTS[y_name]) // BLOCK)
        assert _delta(after, before, "num_load_errors_blocks") == num_blocks, after
    p_state = pair.p.wait_drained()
    if p_state is not None:
        assert p_state["requests"] == 0, p_state
        assert p_state["free_blocks"] == p_state["num_blocks"] - 1, p_state


def test_wrong_ticket_is_recomputed(pair, reference):
    """D gets prompt x with the ticket P gave for prompt y. D refuses it before reading
    anything (the ticket's ``remote_prompt_digest`` is y's), although P has x in its prefix
    cache too (in other blocks): under ``recompute`` D computes x in its first step, so the
    tokens are x's, no read asked P (``num_board_fallbacks``), and P's lease on y is released.
    The failure counts as a failed load, not as a rejected ticket. Then y, with a fresh ticket
    from a second prefill on P, is pulled and decoded like any handover."""
    out, before, after, ticket_y = _wrong_ticket(pair, "wrong_x", "wrong_y")
    _assert_recomputed(pair, out, before, after, "wrong_x", "wrong_y", reference)
    if after is not None:
        assert _delta(after, before, "num_board_fallbacks") == 0, after  # nothing asked P

    # D's release notice ended y's first lease; a second prefill gives y a fresh ticket.
    y = PROMPTS["wrong_y"]
    (p_again,) = pair.p.generate(prefill_requests([y]))
    ticket_again = p_again["kv_transfer_params"]
    assert ticket_again["remote_lease_token"] != ticket_y["remote_lease_token"]
    before = pair.d.stats()
    (out,) = pair.d.generate([request(y, N_NEW, ticket_again)])
    after = pair.d.stats()
    assert out["token_ids"] == reference["wrong_y"]
    if after is not None:
        assert _delta(after, before, "num_loads") == 1, after
        assert _delta(after, before, "num_failed_loads") == 0, after
        assert _delta(after, before, "num_blocks_received") >= (len(y) - 1) // BLOCK, after
    p_state = pair.p.wait_drained()
    if p_state is not None:  # both of y's leases ended (the failed pull's notice, then D's)
        assert p_state["requests"] == 0, p_state
        assert p_state["free_blocks"] == p_state["num_blocks"] - 1, p_state


def test_a_wrong_ticket_sharing_every_full_block_is_recomputed(pair, reference):
    """x and y share their 4 full blocks and differ only in the partial last block, which no
    block hash guards (P serves it under the lease alone). Before the ticket carried
    ``remote_prompt_digest``, D loaded y's tail there and answered with y's tokens; now D
    refuses the ticket and computes x."""
    out, before, after, _ = _wrong_ticket(pair, "tail_x", "tail_y")
    _assert_recomputed(pair, out, before, after, "tail_x", "tail_y", reference)


def test_a_ticket_without_a_digest_is_refused_before_a_step_waits_for_it(pair, reference):
    """A ticket for another prompt that carries no digest (a P that sends none). Once D reads P
    one-sided (a first handover connected them), D's scheduler half looks at P's block board
    before planning anything (``connector.ticket_board``): the board shows y's blocks where x's
    are expected, so D refuses the ticket and computes x in its first step, and asks P nothing
    (``num_board_fallbacks`` 0; before, a load planned into that step asked P once and failed,
    and x was computed one step later). Over UCX P's hash check refuses y's blocks, and that
    answer is final. (A ticket whose lease P has not handed its worker yet shows nothing on the
    board: its pull runs over later steps and P's answer ends it; ``granted`` rules that out.)"""
    _handover(pair, ["nodigest_y"])  # D connects to P and learns where P's board is
    out, before, after, _ = _wrong_ticket(pair, "nodigest_x", "nodigest_y", digest=False,
                                          granted=True)
    _assert_recomputed(pair, out, before, after, "nodigest_x", "nodigest_y", reference)
    if after is not None and pair.cma:
        assert _delta(after, before, "num_board_fallbacks") == 0, after
        assert _delta(after, before, "num_sync_loads") == 0, after  # no step took a load


def test_vllm_metrics_count_what_was_pulled(pair, reference):
    """kvbridge's statistics reach vLLM's own metrics (``get_kv_connector_stats`` ->
    ``build_kv_connector_stats`` -> ``build_prom_metrics``), read from D's Prometheus registry
    as ``llm.get_metrics()`` sees it, in both executor modes: after a handover of two prompts
    the pulls, blocks and bytes counted equal what D's connector moved (the bytes are the
    blocks times a block's bytes over every layer: 2 layers x K and V x 32 tokens x 2 KV heads
    x 32 dims x 4 bytes), one load time per pull, and the pulled tokens appear among vLLM's
    external prefix hits as ``p2p``."""
    names = ["metrics_a", "metrics_b"]
    m0 = pair.d.metrics()
    _, d_out, before, after = _handover(pair, names)
    assert [o["token_ids"] for o in d_out] == [reference[n] for n in names]
    m1 = pair.d.metrics()

    def grew(key: str) -> float:
        return m1.get(key, 0) - m0.get(key, 0)

    loads, blocks = grew("vllm:kvbridge_num_loads"), grew("vllm:kvbridge_num_blocks_received")
    assert loads == len(names), (m0, m1)
    assert blocks >= sum((len(PROMPTS[n]) - 1) // BLOCK for n in names)
    assert grew("vllm:kvbridge_bytes_received") == blocks * (2 * 2 * BLOCK * 2 * 32 * 4)
    assert grew("vllm:kvbridge_num_failed_loads") == 0
    assert grew("vllm:kvbridge_load_time_seconds_count") == loads
    assert grew("vllm:kvbridge_load_time_seconds_sum") > 0
    p2p = grew("vllm:prompt_tokens_cached_by_source:p2p")
    assert 0 < p2p == grew("vllm:external_prefix_cache_hits"), (m0, m1)
    if after is not None:  # in process: the connector's own counters say the same
        for key in ("num_loads", "num_blocks_received", "bytes_received"):
            assert grew(f"vllm:kvbridge_{key}") == _delta(after, before, key), key


def test_kvbridge_logs_read_like_vllms(pair):
    """The worker half's INFO line about its transport (Python's last-resort handler would drop
    it) is in D's log in vLLM's format: level, date and time, [file:line]."""
    pattern = re.compile(r"INFO \d\d-\d\d [\d:]+ \[[^\]]*worker_half\.py:\d+\] .*listening on")
    assert pattern.search(pair.d.log_path.read_text(errors="replace")), pair.d.log_tail()


def test_a_malformed_ticket_is_computed_locally_and_its_error_returned(pair, reference):
    """P's real ticket for a prompt, with its block size changed: D's admission refuses it
    (vLLM lets a connector refuse nothing, so D computes the prompt itself: the right tokens),
    tells P to release the lease, and the request's own returned ``kv_transfer_params`` name
    the field (``"kvbridge_error"``, through a real engine's ``RequestOutput``)."""
    name = "t64"
    (p_out,) = pair.p.generate(prefill_requests([PROMPTS[name]]))
    ticket = {**p_out["kv_transfer_params"], "remote_block_size": 2 * BLOCK}
    before = pair.d.stats()
    (out,) = pair.d.generate([request(PROMPTS[name], N_NEW, ticket)])
    after = pair.d.stats()
    assert out["token_ids"] == reference[name]
    error = (out["kv_transfer_params"] or {}).get("kvbridge_error", "")
    assert error.startswith("kv_transfer_params.remote_block_size"), out
    assert error.endswith("; computed locally"), error
    if after is not None:
        assert _delta(after, before, "num_rejected_params") == 1, after
        assert _delta(after, before, "num_loads") == 0, after
    p_state = pair.p.wait_drained()  # D's release notice ended the lease at once
    if p_state is not None:
        assert p_state["requests"] == 0, p_state
        assert p_state["free_blocks"] == p_state["num_blocks"] - 1, p_state


def test_a_null_block_in_the_ticket_is_a_load_error_recomputed(pair, reference):
    """P's real ticket with its full-attention list naming P's null block (id 0) where D needs
    a block: a wrong ticket, not a sliding window's gap. Under ``recompute`` D's load reports
    that block (and only the blocks from it on are recomputed): the right tokens, one failed
    load, no window gap, and P's lease released by D's failure notice."""
    name = "null_block"  # a prompt D never saw: no local hit trims the null position away
    (p_out,) = pair.p.generate(prefill_requests([PROMPTS[name]]))
    ticket = dict(p_out["kv_transfer_params"])
    ticket["remote_block_ids"] = [[ids[0], 0, *ids[2:]] for ids in ticket["remote_block_ids"]]
    before = pair.d.stats()
    (out,) = pair.d.generate([request(PROMPTS[name], N_NEW, ticket)])
    after = pair.d.stats()
    assert out["token_ids"] == reference[name]
    if after is not None:
        assert _delta(after, before, "num_failed_loads") == 1, after
        assert _delta(after, before, "num_window_gaps") == 0, after
        assert _delta(after, before, "num_load_errors_blocks") >= 1, after
    p_state = pair.p.wait_drained()
    if p_state is not None:
        assert p_state["requests"] == 0, p_state
        assert p_state["free_blocks"] == p_state["num_blocks"] - 1, p_state
