"""The Redis block index between vLLM engines on a hybrid model, and across block sizes (issue 31).

The model is the tiny Llama with sliding-window (64 tokens) and full-attention layers taking
turns (``tiny_checkpoint.HYBRID``: vLLM's hybrid allocator makes a ``SlidingWindowSpec`` group
and a ``FullAttentionSpec`` group). A Redis server (the module's fixture) and three engines,
each its own process, configured as users write it (``kv_role: kv_both``, ``index_url``) and
started once for the module. One engine serves 1,000-2,000-token prefixes
(``_prompts.HYBRID_INDEX``), another the same prefixes each with a suffix of its own; the
second pulls from the first only what vLLM's hit rule restores (``HybridKVCacheCoordinator``):
every block of the hit in the full-attention group, and in the sliding-window group only the
blocks the next token's window reaches. Its greedy tokens equal a plain engine's
(``conftest.hybrid_reference``), its ``num_cached_tokens`` is the pulled prefix, as long as
vLLM's own cache on the holder restores of the same prompt, and the two engines' counters
agree on the blocks and bytes moved.

- A (block size 32) keeps every sliding-window block it computed
  (``prefix_cache_retention_interval: None``, vLLM's dense retention), so it holds and lists
  many blocks no window reaches: B, pulling from A, takes only the window's.
- B (block size 32, vLLM's default sparse retention) keeps only the window's blocks before a
  prompt's last token: A, pulling from B, gets the hit B's own cache would give, one block
  short of a prefix that fills its last block (``_hit_blocks``).
- C: the same model and hash seed at block size 64. Its block identity differs in the block
  size alone, so its index namespace is its own: it finds none of A's entries, pulls nothing,
  and decodes the reference's tokens.

After each test every engine holds no request and every block is free.
"""

from __future__ import annotations

import collections
import time

import pytest
import redis
from _harness import (
    BLOCK,
    Node,
    assert_drained,
    kvbridge_config,
    request,
    start_nodes,
    stop_nodes,
)
from _prompts import HYBRID_INDEX_PREFIXES, HYBRID_INDEX_PROMPTS, N_NEW

WINDOW = 64  # tiny_checkpoint.HYBRID["sliding_window"]
# vLLM's SlidingWindowManager: a hit needs this many cached blocks before its end (the next
# token's window reaches back WINDOW - 1 tokens); the blocks before them are its null block.
WINDOW_BLOCKS = -(-(WINDOW - 1) // BLOCK)
SLIDING, FULL = 0, 1  # the hybrid model's KV cache group ids (_harness.HYBRID_GROUP_KINDS)
TICK = [1, 2, 3]  # a 3-token prompt: makes an idle engine step once


def _config(engine_id: str, redis_url: str) -> dict:
    return kvbridge_config("both", engine_id, index_url=redis_url, index_ttl_s=3.0,
                           load_timeout_s=10.0)


@pytest.fixture(scope="module")
def engines(tiny_hybrid_llama, log_dir, hybrid_reference, redis_server):  # reference gone first
    a = Node("hybrid-index-a-dense", model=tiny_hybrid_llama, log_dir=log_dir,
             kv_transfer_config=_config("engine-a", redis_server.url),
             llm={"prefix_cache_retention_interval": None})
    b = Node("hybrid-index-b", model=tiny_hybrid_llama, log_dir=log_dir,
             kv_transfer_config=_config("engine-b", redis_server.url))
    c = Node("hybrid-index-c-block64", model=tiny_hybrid_llama, log_dir=log_dir,
             kv_transfer_config=_config("engine-c", redis_server.url),
             llm={"block_size": 2 * BLOCK})
    start_nodes(a, b, c)
    yield a, b, c
    stop_nodes(a, b, c)


def _delta(after: dict, before: dict, *keys: str) -> tuple[int, ...]:
    return tuple(after[k] - before[k] for k in keys)


def _serve_prefixes(node: Node, names: list[str]) -> None:
    """``node`` computes each prefix (one token); its blocks are then in the index, published
    on the index client's thread right after the step (a short wait covers that)."""
    node.generate([request(HYBRID_INDEX_PREFIXES[n], 1) for n in names])
    time.sleep(0.3)


def _listed(client: redis.Redis, node_id: str) -> collections.Counter:
    """KV cache group id -> how many entries the index lists for ``node_id``."""
    count: collections.Counter = collections.Counter()
    for keys_key in client.scan_iter(match=f"kvbridge:bi:*:keys:{node_id}"):
        for ekey in client.smembers(keys_key):  # <prefix>:e:<group id>:<hash key>
            count[int(ekey.split(b":e:", 1)[1].split(b":", 1)[0])] += 1
    return count


def _hit_blocks(name: str, *, dense: bool) -> int:
    """Blocks of the whole prompt that the holder's cache restores once it has computed the
    prefix alone. A dense holder: every full block of the prefix. vLLM's default
    (``prefix_cache_retention_interval`` 0) caches a sliding-window group's blocks only in the
    window before a replay boundary, here the prefix's last token (block ``(n - 1) // BLOCK``
    and the ``WINDOW_BLOCKS`` before it): a hit ends there, even where the prefix fills its
    last block."""
    n = len(HYBRID_INDEX_PREFIXES[name])
    return n // BLOCK if dense else (n - 1) // BLOCK


def _pull_and_check(holder: Node, puller: Node, names: list[str], *, dense_holder: bool,
                    reference: dict[str, list[int]]) -> None:
    """``holder`` has computed the prefixes of ``names`` (``_serve_prefixes``), ``puller``
    serves the whole prompts: see the module's docstring for what is checked."""
    holder.generate([request(TICK, 1)])  # what it served before is reported
    h_before, p_before, m_before = holder.stats(), puller.stats(), puller.metrics()
    outs = puller.generate([request(HYBRID_INDEX_PROMPTS[n], N_NEW) for n in names])
    pulled_blocks = pulled_tokens = 0
    for name, out in zip(names, outs, strict=True):
        assert out["token_ids"] == reference[name], name
        hit = _hit_blocks(name, dense=dense_holder)
        assert out["num_cached_tokens"] == hit * BLOCK, (name, out["num_cached_tokens"])
        # full attention: every block of the hit; sliding window: the window's last blocks
        pulled_blocks += hit + WINDOW_BLOCKS
        pulled_tokens += hit * BLOCK
    holder.generate([request(TICK, 1)])  # its worker half reports what it served at a step
    h_after, p_after = holder.stats(), puller.stats()
    received = _delta(p_after, p_before, "num_index_lookups", "num_index_hits",
                      "num_blocks_received", "bytes_received", "num_failed_loads",
                      "num_load_errors_blocks")
    k = len(names)
    assert received[:3] == (k, k, pulled_blocks) and received[4:] == (0, 0), received
    served = _delta(h_after, h_before, "num_index_blocks_served", "bytes_sent")
    assert served == (pulled_blocks, received[3]), (served, received)
    p2p = "vllm:prompt_tokens_cached_by_source:p2p"
    assert puller.metrics()[p2p] - m_before[p2p] == pulled_tokens
    # vLLM's own prefix cache on the holder restores exactly as much of the same prompts (it
    # pulls nothing: what the puller holds beyond that is less than min_remote_hit_tokens).
    own = holder.generate([request(HYBRID_INDEX_PROMPTS[n], 1) for n in names])
    assert [o["num_cached_tokens"] for o in own] == [o["num_cached_tokens"] for o in outs]
    assert _delta(holder.stats(), h_after, "num_index_hits") == (0,)
    assert_drained(holder, puller)


def test_b_pulls_the_full_attention_blocks_and_only_the_window_s_sliding_blocks(
        engines, hybrid_reference, redis_server):
    a, b, _ = engines
    names = ["hi1000", "hi1504", "hi1990"]
    client = redis.Redis.from_url(redis_server.url)
    try:
        before = _listed(client, "engine-a")
        _serve_prefixes(a, names)
        grown = _listed(client, "engine-a") - before
    finally:
        client.close()
    # A holds and lists every block of the prefixes in both groups, those outside any later
    # token's window included: B's pull takes WINDOW_BLOCKS of each prefix's sliding ones.
    full_blocks = sum(len(HYBRID_INDEX_PREFIXES[n]) // BLOCK for n in names)
    assert grown == {SLIDING: full_blocks, FULL: full_blocks}, grown
    _pull_and_check(a, b, names, dense_holder=True, reference=hybrid_reference)


def test_a_holder_with_vllm_s_default_retention_offers_what_its_own_cache_restores(
        engines, hybrid_reference):
    a, b, _ = engines
    _serve_prefixes(b, ["hs1504"])
    _pull_and_check(b, a, ["hs1504"], dense_holder=False, reference=hybrid_reference)


def _registrations(client: redis.Redis) -> dict[str, str]:
    """Engine id -> the index namespace (key prefix) it registered under."""
    out = {}
    for key in client.scan_iter(match="kvbridge:bi:*:node:*"):
        prefix, node_id = key.decode().rsplit(":node:", 1)
        out[node_id] = prefix
    return out


def test_an_engine_of_another_block_size_on_the_same_redis_sees_none_of_a_s_entries(
        engines, hybrid_reference, redis_server):
    a, _, c = engines
    name = "hi1504"
    _serve_prefixes(a, [name])  # A holds the prefix (from the first test, or now)
    before = c.stats()
    (out,) = c.generate([request(HYBRID_INDEX_PROMPTS[name], N_NEW)])
    assert out["token_ids"] == hybrid_reference[name]
    assert out["num_cached_tokens"] == 0
    time.sleep(0.3)  # C publishes its own blocks on its index client's thread
    # C asks the index and finds nothing: no hit, no pull.
    assert _delta(c.stats(), before, "num_index_lookups", "num_index_hits",
                  "num_blocks_received", "num_failed_loads") == (1, 0, 0, 0)
    client = redis.Redis.from_url(redis_server.url)
    try:
        spaces = _registrations(client)
        # A and B (and C) are registered; C in a namespace of its own
        assert spaces["engine-a"] == spaces["engine-b"] != spaces["engine-c"], spaces
        # A's entries live under A's namespace alone; C's (its 64-token blocks) under C's
        assert client.scard(f"{spaces['engine-a']}:keys:engine-a") > 0
        assert client.scard(f"{spaces['engine-c']}:keys:engine-a") == 0
        assert client.scard(f"{spaces['engine-c']}:keys:engine-c") > 0
    finally:
        client.close()
    assert_drained(a, c)
