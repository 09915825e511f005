"""Prefix reuse across two stock vLLM engines through the Redis block index (issue 31).

A Redis server (the suite's fixture) and two vLLM engines, each its own process (in-process
executor), both configured as users write it (``kv_role: kv_both``, ``index_url``), started
once for the module: A serves 1,000-2,000-token prefixes, B the same prefixes each with a
suffix of its own (``_prompts.INDEX_PREFIXES``). A's KV cache is small (192 blocks of 32
tokens), so that A can be made to evict. Checked:

- B pulls the prefix from A: its greedy tokens equal a single plain instance's (the session's
  ``reference``), its ``num_cached_tokens`` covers the pulled blocks, vLLM counts them as
  another engine's (P2P), and A's and B's counters agree on the blocks and bytes moved;
- A holder that evicted the blocks after the index listed them (its entries put back in Redis
  as they were before the eviction): A refuses them, B recomputes, the tokens are right;
- malformed entries in Redis: skipped by B's lookup with a log line, B computes the prompt;
- Redis stopped mid-run: B keeps serving from its own cache and says so once; Redis back
  (empty): both register again, A lists its cached blocks again without a step (idle: its
  index thread resyncs what it had listed), and B pulls through the index again;
- an engine started while Redis is down starts and serves; on Redis again, being of another
  dtype, it sees none of A's entries (its own namespace);
- a holder that dies (paused, then killed) while a pull waits on it: B recomputes, the tokens
  are right, and the dead holder's registration (so its entries) lapses with its TTL.

After each test every engine still running holds no request and every block is free.

Holder-side counters reach A's scheduler half (``stats``) at A's next step: the tests give A a
one-token request before reading them.
"""

from __future__ import annotations

import time

import pytest
import redis
from _harness import (
    BLOCK,
    Node,
    assert_drained,
    free_port,
    kvbridge_config,
    request,
    start_nodes,
)
from _prompts import INDEX_PREFIXES, N_NEW, PROMPTS

TTL_S = 3.0  # index_ttl_s: heartbeats every second; a dead holder's entries go within 3 s
A_KV_BYTES = 6 << 20  # 192 blocks of 32 tokens (32 KiB a block: 2 layers, 2 KV heads, fp32)
TICK = [1, 2, 3]  # a 3-token prompt: makes an idle engine step once
OUTAGE_S = 3.5  # Redis stopped this long: three heartbeats and more
OUTAGE_LINES = (  # what an engine says when Redis goes: one line, once (issue 29, part 5),
    # for its lookups, publishes, heartbeats and announces alike (index/reachability.py)
    "kvbridge index: cannot reach",
)


def _config(engine_id: str, redis_url: str, **extra) -> dict:
    return kvbridge_config("both", engine_id, index_url=redis_url, index_ttl_s=TTL_S,
                           load_timeout_s=10.0, **extra)


@pytest.fixture(scope="module")
def engines(tiny_llama, log_dir, reference, redis_server):  # reference first: its engine is gone
    a_port = free_port()
    a = Node("index-a", model=tiny_llama, log_dir=log_dir,
             kv_transfer_config=_config("engine-a", redis_server.url, port=a_port),
             llm={"kv_cache_memory_bytes": A_KV_BYTES})
    b = Node("index-b", model=tiny_llama, log_dir=log_dir,
             kv_transfer_config=_config("engine-b", redis_server.url))
    start_nodes(a, b)
    a.port = a_port
    yield a, b
    b.stop()
    a.stop()


def _serve_prefix(node: Node, name: str) -> None:
    """A computes the prefix alone (one token; a prefix nobody holds yet), then its blocks are
    in the index: published on the index client's thread right after the step; a short wait
    covers that."""
    (out,) = node.generate([request(INDEX_PREFIXES[name], 1)])
    assert out["num_cached_tokens"] == 0, "A computed it itself"
    time.sleep(0.3)


def _tick(node: Node) -> None:
    node.generate([request(TICK, 1)])


def _index_resyncs(node: Node) -> int:
    """How many resyncs of its cached set the node's index client had land (``_node.py``)."""
    resyncs = node.call({"cmd": "stats"}, 60)["index_resyncs"]
    assert isinstance(resyncs, int), f"{node.name}: no index client found: {resyncs!r}"
    return resyncs


def _delta(after: dict, before: dict, *keys: str) -> tuple[int, ...]:
    return tuple(after[k] - before[k] for k in keys)


def test_b_pulls_the_prefixes_a_computed_and_decodes_a_single_instance_s_tokens(
        engines, reference):
    a, b = engines
    names = ["index_a", "index_b", "index_c"]
    _tick(a)
    a_before, b_before = a.stats(), b.stats()
    m_before = b.metrics()
    for name in names:
        _serve_prefix(a, name)
    outs = b.generate([request(PROMPTS[name], N_NEW) for name in names])
    pulled_blocks = 0
    for name, out in zip(names, outs, strict=True):
        assert out["token_ids"] == reference[name], name
        num_blocks = len(INDEX_PREFIXES[name]) // BLOCK  # A's full blocks of the prefix
        # The prefix's full blocks came from A (never the last prompt token's block).
        assert out["num_cached_tokens"] >= num_blocks * BLOCK, (name, out["num_cached_tokens"])
        pulled_blocks += num_blocks
    _tick(a)  # A's worker half reports what it served at A's next step
    a_after, b_after = a.stats(), b.stats()
    received = _delta(b_after, b_before, "num_index_hits", "num_blocks_received",
                      "bytes_received", "num_failed_loads")
    assert received[:2] == (3, pulled_blocks) and received[3] == 0, received
    # Holder and puller agree on what moved.
    served = _delta(a_after, a_before, "num_index_blocks_served", "bytes_sent")
    assert served == (pulled_blocks, received[2]), (served, received)
    m_after = b.metrics()
    p2p = "vllm:prompt_tokens_cached_by_source:p2p"
    assert m_after[p2p] - m_before[p2p] == pulled_blocks * BLOCK
    assert (m_after["vllm:kvbridge_num_index_hits"]
            - m_before["vllm:kvbridge_num_index_hits"]) == 3
    assert_drained(a, b)


def _entries_of(client: redis.Redis, node_id: str) -> dict[bytes, bytes]:
    """Every index entry of ``node_id`` as Redis holds it: entry key -> the node's field."""
    out = {}
    for prefix_key in client.scan_iter(match=f"kvbridge:bi:*:keys:{node_id}"):
        for ekey in client.smembers(prefix_key):
            value = client.hget(ekey, node_id)
            if value is not None:
                out[ekey] = value
    return out


def test_a_holder_that_evicted_the_blocks_the_index_named_is_refused_and_b_recomputes(
        engines, reference, redis_server):
    a, b = engines
    client = redis.Redis.from_url(redis_server.url)
    try:
        _serve_prefix(a, "index_stale")
        listed = _entries_of(client, "engine-a")
        # A computes 6,000+ tokens of other prompts: its 192 blocks are all reused, and the
        # index drops every entry of index_stale.
        for seed in range(3):
            a.generate([request([(seed * 131 + i * 7) % 500 + 3 for i in range(2080)], 1)])
        time.sleep(0.3)
        gone = set(listed) - set(_entries_of(client, "engine-a"))
        assert len(gone) >= len(INDEX_PREFIXES["index_stale"]) // BLOCK
        # The index names A's old blocks again, as a lookup made before the eviction would.
        for ekey in gone:
            client.hset(ekey, "engine-a", listed[ekey])
        before = b.stats()
        (out,) = b.generate([request(PROMPTS["index_stale"], N_NEW)])
        assert out["token_ids"] == reference["index_stale"]
        after = b.stats()
        hits, failed, errors = _delta(after, before, "num_index_hits", "num_failed_loads",
                                      "num_load_errors_blocks")
        assert (hits, failed) == (1, 1) and errors > 0, (hits, failed, errors)
    finally:
        client.close()
    assert_drained(a, b)


def test_malformed_index_entries_are_skipped_with_a_log_line_and_b_computes(
        engines, reference, redis_server):
    a, b = engines
    client = redis.Redis.from_url(redis_server.url)
    try:
        listed = _entries_of(client, "engine-a")
        _serve_prefix(a, "index_garbage")
        new = set(_entries_of(client, "engine-a")) - set(listed)
        assert len(new) == len(INDEX_PREFIXES["index_garbage"]) // BLOCK
        for ekey in new:  # A's entries of the prefix, unreadable (another writer? corruption)
            client.hset(ekey, "engine-a", b"bad")
    finally:
        client.close()
    said = _log_lines(b, "malformed entr")
    before = b.stats()
    (out,) = b.generate([request(PROMPTS["index_garbage"], N_NEW)])
    assert out["token_ids"] == reference["index_garbage"]
    assert _delta(b.stats(), before, "num_index_lookups", "num_index_hits") == (1, 0)
    assert _log_lines(b, "malformed entr") == said + 1
    assert_drained(a, b)


def _log_lines(node: Node, text: str) -> int:
    return node.log_path.read_text(errors="replace").count(text)


def test_redis_stopped_mid_run_b_keeps_serving_says_so_once_and_uses_the_index_again(
        engines, reference, redis_server):
    a, b = engines
    _serve_prefix(a, "index_before_outage")
    _serve_prefix(a, "index_after_outage")  # B asks for it once Redis is back
    resyncs = _index_resyncs(a)
    said = {text: _log_lines(b, text) for text in OUTAGE_LINES}
    redis_server.stop()
    stopped_at = time.monotonic()
    try:
        before = b.stats()
        for name in ("index_outage", "index_before_outage"):
            (out,) = b.generate([request(PROMPTS[name], N_NEW)])
            assert out["token_ids"] == reference[name], name
        during = b.stats()
        # Nothing pulled, nothing waited for: each lookup went on without an answer.
        assert _delta(during, before, "num_index_hits", "num_index_lookup_failures") == (0, 2)
        # Several heartbeats (one a second) go by without Redis: each trouble is said once.
        # (Said by B's engine process on its own threads: on a loaded host it may come late.)
        deadline = stopped_at + OUTAGE_S + 15.0
        while time.monotonic() < deadline and any(
                _log_lines(b, text) == said[text] for text in OUTAGE_LINES):
            time.sleep(0.2)
        time.sleep(max(0.0, stopped_at + OUTAGE_S - time.monotonic()))
        told = {text: _log_lines(b, text) - said[text] for text in OUTAGE_LINES}
        assert told == dict.fromkeys(OUTAGE_LINES, 1), (
            told, [line for line in b.log_path.read_text(errors="replace").splitlines()
                   if "kvbridge" in line][-15:])
    finally:
        redis_server.start()  # empty: every registration and entry is gone
    # Both register again (heartbeats: a second). A, idle (nothing steps it), lists its cached
    # blocks again from its index thread (a resync of what it had listed; before, only its next
    # step did), and B finds a prefix A computed before the outage through the index again.
    deadline = time.monotonic() + 30.0
    while _index_resyncs(a) == resyncs:
        assert time.monotonic() < deadline, "idle A never listed its blocks again"
        time.sleep(0.2)
    outs = b.generate([request(PROMPTS["index_after_outage"], N_NEW)])
    assert outs[0]["token_ids"] == reference["index_after_outage"]
    after = b.stats()
    assert _delta(after, during, "num_index_hits") == (1,)
    assert_drained(a, b)


def test_an_engine_started_while_redis_is_down_serves_and_another_dtype_sees_no_entries(
        engines, tiny_llama, log_dir, redis_server):
    a, _ = engines
    # C: the same model, block size and hash as A, so the same block hashes; only its KV bytes
    # (bfloat16) differ. Started while Redis is down: it starts and serves all the same.
    redis_server.stop()
    c = Node("index-c-bf16", model=tiny_llama, log_dir=log_dir,
             kv_transfer_config=_config("engine-c", redis_server.url),
             llm={"dtype": "bfloat16"})
    try:
        try:
            start_nodes(c, index_up=False)
            c.generate([request(PROMPTS["index_a"], 2)])
            assert c.stats()["num_index_lookup_failures"] == 1
        finally:
            redis_server.start()
        time.sleep(TTL_S / 3 + 1.0)  # every engine registers again at its next heartbeat
        _tick(a)
        _serve_prefix(a, "index_dtype")
        before = c.stats()
        c.generate([request(PROMPTS["index_dtype"], 2)])
        # Its own namespace: C asks the index, finds none of A's blocks, pulls nothing.
        asked, hits, failed = _delta(c.stats(), before, "num_index_lookups", "num_index_hits",
                                     "num_failed_loads")
        assert (asked, hits, failed) == (1, 0, 0)
        client = redis.Redis.from_url(redis_server.url)
        try:
            prefixes = {key.rsplit(b":node:", 1)[0]
                        for key in client.scan_iter(match="kvbridge:bi:*:node:*")}
        finally:
            client.close()
        assert len(prefixes) == 2, prefixes  # A and B in one namespace, C in another
        assert_drained(a, c)
    finally:
        c.stop()


def test_a_holder_that_dies_while_b_waits_on_its_pull_costs_a_recompute(
        engines, reference, redis_server):
    a, b = engines
    _serve_prefix(a, "index_died")
    a.pause()  # A stops answering; its entries stay listed until its TTL runs out
    try:
        before = b.stats()
        b.submit([request(PROMPTS["index_died"], N_NEW)])
        time.sleep(1.0)  # B's lookup has named A, its pull waits on A
        a.kill()
        (out,) = b.result()["outputs"]
    finally:
        a.kill()
    assert out["token_ids"] == reference["index_died"]
    after = b.stats()
    assert _delta(after, before, "num_index_hits", "num_failed_loads") == (1, 1)
    assert_drained(b)
    # A's registration ends with its last heartbeat's TTL: lookups ignore its entries after.
    client = redis.Redis.from_url(redis_server.url)
    try:
        deadline = time.monotonic() + TTL_S + 5.0
        while list(client.scan_iter(match="kvbridge:bi:*:node:engine-a")):
            assert time.monotonic() < deadline, "A's registration outlived its TTL"
            time.sleep(0.2)
    finally:
        client.close()
