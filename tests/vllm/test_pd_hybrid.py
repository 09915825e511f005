"""P/D between two vLLM engines on a hybrid model: vLLM's hybrid allocator stays on (issue 13).

The model is the tiny Llama with sliding-window (64 tokens) and full-attention layers taking
turns (``tiny_checkpoint.HYBRID``), so vLLM makes two KV cache groups, ``SlidingWindowSpec`` then
``FullAttentionSpec``, whose layers share one block pool (and, in pairs, one KV tensor: a
block id belongs to one group at a time). ``KVBridgeConnector`` is ``SupportsHMA``, so vLLM
keeps that allocator on instead of "Turning off hybrid kv cache manager because ...".

The session's plain hybrid engine (``conftest.hybrid_reference``) decodes the reference first and
is stopped; then one P/D pair per variant serves every prompt of ``HYBRID_PROMPTS`` in one batch:

- ``cma``: the same-host copy path, both engines in-process;
- ``ucx-mp-p``: ``cma: false`` (every read over UCX, two regions per group and layer), P on
  vLLM's multiprocess executor, so its scheduler half hands both groups' leases and hashes to a
  worker half in another process. P's own state is not reachable there; D's counters and
  tokens decide, and D's completion notices must still drain P (checked through P's metrics).
"""

from __future__ import annotations

import time

import pytest
from _harness import (
    BLOCK,
    HYBRID_GROUP_KINDS,
    Node,
    kvbridge_config,
    prefill_requests,
    request,
    start_nodes,
)
from _prompts import HYBRID_PROMPTS, N_NEW

WINDOW = 64  # tiny_checkpoint.HYBRID["sliding_window"]
NAMES = list(HYBRID_PROMPTS)


VARIANTS = {
    "cma": dict(cma=True, p_mode="inproc"),
    "ucx-mp-p": dict(cma=False, p_mode="mp"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def hybrid_pair(request, tiny_hybrid_llama, log_dir, hybrid_reference):  # reference gone first
    v = VARIANTS[request.param]
    p = Node(f"hybrid-{request.param}-p", model=tiny_hybrid_llama, log_dir=log_dir,
             mode=v["p_mode"],
             kv_transfer_config=kvbridge_config("producer", "prefill-h", cma=v["cma"]))
    d = Node(f"hybrid-{request.param}-d", model=tiny_hybrid_llama, log_dir=log_dir,
             kv_transfer_config=kvbridge_config("consumer", "decode-h", cma=v["cma"],
                                                load_timeout_s=30.0))
    start_nodes(p, d)
    yield p, d
    d.stop()
    p.stop()


def _skipped_blocks(num_tokens: int) -> int:
    """Leading blocks of a sliding-window table that vLLM has replaced by its null block once
    ``num_tokens`` are computed: those wholly before the next token's window."""
    return max(0, num_tokens - WINDOW + 1) // BLOCK


def test_hybrid_model_keeps_hma_with_kvbridge(hybrid_pair):
    """Both engines run two KV cache groups (one per attention kind) with kvbridge loaded (read
    from in-process nodes), and neither logged vLLM's "Turning off hybrid kv cache manager"."""
    for node in hybrid_pair:
        state = node.state()  # None on an mp node: its tickets name two groups (next test)
        assert state is None or state["kv_cache_groups"] == HYBRID_GROUP_KINDS, node.name
        assert "Turning off hybrid kv cache manager" not in node.log_path.read_text(), node.name


def _pulled_blocks(n: int) -> int:
    """Blocks D pulls for an ``n``-token prompt: it computes the last token itself, so it
    needs ``n - 1`` tokens' blocks in the full-attention group and, in the sliding-window
    group, those from the one holding position ``n - 1 - WINDOW + 1`` on."""
    end = -(-(n - 1) // BLOCK)
    return end + end - _skipped_blocks(n - 1)


def test_hybrid_handover_equals_single_engine(hybrid_pair, hybrid_reference):
    """Prompts of 40, 300, 319 and 1,000 tokens in one batch: P's ticket names both groups'
    blocks by position (the sliding-window group's out-of-window positions as null block 0),
    and D's greedy tokens equal a plain engine's. D pulled the KV of 40, 300 and 1,000 (both
    groups, only the window's blocks of the sliding one; no failed load) instead of
    recomputing it; for 319, P's table no longer holds the block D's window starts in (see
    ``_prompts.HYBRID_PROMPTS``), so D computes it itself and tells P to release. Both
    engines hold nothing at the end, and no lease expired."""
    p, d = hybrid_pair
    p_metrics = p.metrics()
    p_out = p.generate(prefill_requests([HYBRID_PROMPTS[n] for n in NAMES]))
    for name, o in zip(NAMES, p_out, strict=True):
        n = len(HYBRID_PROMPTS[name])
        assert o["token_ids"] == hybrid_reference[name][:1], name
        sliding, full = o["kv_transfer_params"]["remote_block_ids"]
        assert len(sliding) == len(full) == -(-n // BLOCK), name
        assert 0 not in full, name
        # vLLM frees P's out-of-window blocks before handing the table over: n tokens computed
        skipped = _skipped_blocks(n)
        assert sliding[:skipped] == [0] * skipped and 0 not in sliding[skipped:], name
    before = d.stats()
    d_out = d.generate([request(HYBRID_PROMPTS[n], N_NEW, o["kv_transfer_params"])
                        for n, o in zip(NAMES, p_out, strict=True)])
    after = d.stats()
    assert {n: o["token_ids"] for n, o in zip(NAMES, d_out, strict=True)} == {
        n: hybrid_reference[n] for n in NAMES}
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    pulled = [n for n in NAMES if n != "h319"]
    assert delta["num_loads"] == len(pulled), delta
    assert delta["num_failed_loads"] == 0 and delta["num_load_errors_blocks"] == 0, delta
    assert delta["num_window_gaps"] == 1, delta
    # 4 + 13 + 35: e.g. 1,000 tokens: 32 full-attention blocks and the window's last 3
    assert delta["num_blocks_received"] == sum(
        _pulled_blocks(len(HYBRID_PROMPTS[n])) for n in pulled) == 52, delta
    for node in (p, d):
        state = node.wait_drained()
        if state is not None:  # in-process nodes only
            assert state["requests"] == 0, (node.name, state)
            assert state["free_blocks"] == state["num_blocks"] - 1, (node.name, state)
    # P's leases, through vLLM's metrics (both executors): each ended by D's notice (three
    # completions and the window gap's release), none by expiry
    released = _wait_counter_delta(p, p_metrics, "vllm:kvbridge_num_released_leases", len(NAMES))
    assert released == len(NAMES), released
    assert p.metrics().get("vllm:kvbridge_num_expired_leases", 0) == p_metrics.get(
        "vllm:kvbridge_num_expired_leases", 0)


def _wait_counter_delta(node: Node, before: dict[str, float], key: str, want: float,
                        timeout_s: float = 20.0) -> float:
    """How much ``key`` of ``node.metrics()`` grew since ``before``, polled until it reaches
    ``want`` or ``timeout_s`` passes. An mp node's engine sends its counters with its step
    outputs, which vLLM's offline frontend reads only inside ``generate()`` (a served engine
    reads them all the time), so there each poll first runs a one-token request of its own."""
    deadline = time.monotonic() + timeout_s
    while True:
        if node.state() is None:  # mp: let the frontend read what the engine sent
            node.generate([request(HYBRID_PROMPTS["h40"][:8], 1)])
        grown = node.metrics().get(key, 0) - before.get(key, 0)
        if grown >= want or time.monotonic() > deadline:
            return grown
        time.sleep(0.2)
