"""P/D between two vLLM engines on a hybrid model: vLLM's hybrid allocator stays on (issue 13).

The model is the tiny Llama with sliding-window (64 tokens) and full-attention layers taking
turns (``_model.HYBRID``), so vLLM makes two KV cache groups, ``SlidingWindowSpec`` then
``FullAttentionSpec``, whose layers share one block pool (and, in pairs, one KV tensor: a
block id belongs to one group at a time). ``KVBridgeConnector`` is ``SupportsHMA``, so vLLM
keeps that allocator on instead of "Turning off hybrid kv cache manager because ...".

One plain engine decodes the reference first and is stopped; then one P/D pair (same-host
copy, both in-process) serves every prompt of ``HYBRID_PROMPTS`` in one batch.
"""

from __future__ import annotations

import pytest
from _harness import BLOCK, Node, kvbridge_config, prefill_requests, request, start_nodes
from _prompts import HYBRID_PROMPTS, N_NEW

WINDOW = 64  # _model.HYBRID["sliding_window"]
GROUP_KINDS = ["SlidingWindowSpec", "FullAttentionSpec"]
NAMES = list(HYBRID_PROMPTS)


@pytest.fixture(scope="module")
def hybrid_reference(tiny_hybrid_llama, log_dir) -> dict[str, list[int]]:
    node = Node("hybrid-reference", model=tiny_hybrid_llama, log_dir=log_dir)
    try:
        node.wait_ready()
        outs = node.generate([request(HYBRID_PROMPTS[n], N_NEW) for n in NAMES])
        assert node.state()["kv_cache_groups"] == GROUP_KINDS
    finally:
        node.stop()
    return {n: o["token_ids"] for n, o in zip(NAMES, outs, strict=True)}


@pytest.fixture(scope="module")
def hybrid_pair(tiny_hybrid_llama, log_dir, hybrid_reference):  # the reference is gone first
    p = Node("hybrid-p", model=tiny_hybrid_llama, log_dir=log_dir,
             kv_transfer_config=kvbridge_config("producer", "prefill-h", cma=True))
    d = Node("hybrid-d", model=tiny_hybrid_llama, log_dir=log_dir,
             kv_transfer_config=kvbridge_config("consumer", "decode-h", cma=True,
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
    """Both engines run two KV cache groups (one per attention kind) with kvbridge loaded, and
    neither logged vLLM's "Turning off hybrid kv cache manager"."""
    for node in hybrid_pair:
        assert node.state()["kv_cache_groups"] == GROUP_KINDS, node.name
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
    assert {n: o["token_ids"] for n, o in zip(NAMES, d_out, strict=True)} == hybrid_reference
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
        assert state["requests"] == 0, (node.name, state)
        assert state["free_blocks"] == state["num_blocks"] - 1, (node.name, state)
    assert p.stats()["num_expired_leases"] == 0
