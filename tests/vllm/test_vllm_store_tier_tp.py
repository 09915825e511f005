"""The store tier for tensor-parallel vLLM engines (issue 30 part 3, issue 31 part 4).

A Redis server (the suite's fixture), a ``kvbridge-store`` (its own process, no geometry named)
and vLLM engines of the tiny Llama (2 KV heads), started one after another so that at most two
are alive at once:

- A: ``tensor_parallel_size`` 2 (one worker process per rank, one KV head each), ``offload:
  "evict"`` to the store, a KV cache small enough that its later prompts evict the first ones.
  Each rank writes its own head of every block the scheduler half plans; the store holds a
  block once both heads came.
- R: a plain engine (tensor_parallel_size 1) on the same Redis: the reference tokens, computed
  from scratch, which also shows that the store's blocks live in the TP=2 engines' domain
  (``kv_heads_layout`` "tp2h2"): R finds none of them.
- C: another tensor-parallel engine (TP=2, index only) that restores a prompt A evicted: each
  of its ranks reads its own head of each block from the store's whole blocks.

Checked: the store took the model's whole-block geometry (2 heads) in the TP=2 domain; A
counts each block offloaded once (not once per rank), with both ranks' bytes; C's greedy
tokens equal R's, the restored blocks counted once, each rank having read one head's bytes of
each; no failed load; after each test every block of every engine still running is free.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from _harness import BLOCK, Node, assert_drained, free_port, kvbridge_config, request, tokens
from _store_process import StoreProcess

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
RANK_BLOCK_BYTES = 16384  # one rank's block: 32 tokens x 1 KV head x (K, V) x 32 x fp32 x 2 layers
A_KV_BYTES = 192 * RANK_BLOCK_BYTES  # per worker: 192 blocks
N_NEW = 8
PROMPT_LEN = 1500  # 46 full blocks cached; 48 blocks in use with the decoded tokens
PROMPTS = {f"t{i}": tokens(700 + i, PROMPT_LEN) for i in range(1, 6)}
FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # what a lookup may restore (never the last token)
STORE_BYTES = 256 * 2 * RANK_BLOCK_BYTES  # 256 whole blocks (one shelf: kvbridge-store's default)
# The deadline bounds a hang; these tests check which bytes move, not how fast. 30 s, as in
# test_pd_tp, whose module says why: the connector's loop shares each TP worker's GIL with
# vLLM, which can starve it for seconds on a host with fewer cores than busy processes.
LOAD_TIMEOUT_S = 30.0
# Two TP=2 engines' workers, each spinning on vLLM's shared-memory queues, crowd these 2 cores
# and the Redis on them: under load a Redis call here ran past the index's 0.25 s socket timeout
# again and again, and each such call makes the engine leave the index alone for a second (its
# lookup then answers "no hit"). Which bytes move is checked here, not how fast the index is.
PATIENT_INDEX = {"index_socket_timeout_s": 2.0, "index_lookup_timeout_s": 10.0}
PATIENT_STORE = ("--index-socket-timeout-s", "2.0")  # the store's publishes, as patient
# C restores the first; the second only if the index did not answer C's lookup of the first
# (a Redis stalled for seconds on this crowded host: seen even with PATIENT_INDEX). A offloads
# its coldest blocks first, so these two (its first prompts) are in the store.
RESTORED = ("t1", "t2")


@pytest.fixture(scope="module")
def tp_tier(tiny_llama, log_dir, redis_server):
    write_port = free_port()
    a = Node("store-tp-a", model=tiny_llama, log_dir=log_dir,
             llm={**TP2, "kv_cache_memory_bytes": A_KV_BYTES},
             kv_transfer_config=kvbridge_config(
                 "both", "store-tp-engine-a", index_url=redis_server.url,
                 store_url=f"127.0.0.1:{write_port}", offload="evict", offload_scan_blocks=96,
                 offload_blocks_per_step=16, load_timeout_s=LOAD_TIMEOUT_S, **PATIENT_INDEX))
    store = StoreProcess(redis_server.url, write_port, log_dir / "store-tp.log",
                         capacity_bytes=STORE_BYTES, extra_args=PATIENT_STORE)
    try:
        a.wait_ready()
        yield a, store
    finally:
        store.kill()
        a.stop()


@pytest.fixture(scope="module")
def offloaded(tp_tier):
    """A serves the prompts in turn until its first ones were copied to the store."""
    a, _ = tp_tier
    for name, prompt in PROMPTS.items():
        (out,) = a.generate([request(prompt, N_NEW)])
        assert out["num_cached_tokens"] == 0, name
    deadline = time.monotonic() + 90.0
    while (a.stats()["num_offloaded_blocks"] < 2 * FULL_BLOCKS
           and time.monotonic() < deadline):
        time.sleep(0.5)
        a.generate([request([5, 6, 7], 1)])  # steps A: its scheduler half counts at steps
    return a.stats(), a.rank_stats()


def _store_profile(log_path, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"profile (\{.*\})", log_path.read_text(errors="replace"))
        if found:
            return json.loads(found.group(1))
        time.sleep(0.2)
    raise AssertionError(f"{log_path} shows no store profile")


def test_a_tp2_engine_offloads_whole_blocks_each_counted_once(tp_tier, offloaded):
    a, store = tp_tier
    stats, ranks = offloaded
    profile = _store_profile(store.log_path)
    # The model's whole blocks (both KV heads), in the TP=2 engines' index domain.
    assert profile["kv_heads_layout"] == "tp2h2"
    assert profile["kv_heads"]["first"] == 0 and profile["kv_heads"]["total"] == 2
    assert {g["block_shape"][2] for g in profile["groups"]} == {2}
    assert stats["num_offloaded_blocks"] >= 2 * FULL_BLOCKS, stats
    assert stats["num_offload_failures"] == 0
    # Once per block, when both ranks' heads were held: never more than either rank wrote.
    assert set(ranks) == {0, 1}, ranks
    assert stats["num_offloaded_blocks"] <= min(r["num_offloaded_blocks"] for r in ranks.values())
    assert stats["bytes_offloaded"] == sum(r["bytes_offloaded"] for r in ranks.values())
    assert all(r["bytes_offloaded"] == r["num_offloaded_blocks"] * RANK_BLOCK_BYTES
               for r in ranks.values()), ranks
    assert_drained(a)


def test_another_tp2_engine_restores_an_evicted_prompt_each_rank_its_head(
        tp_tier, offloaded, tiny_llama, log_dir, redis_server):
    a, _ = tp_tier
    # R: a single TP=1 instance; its lookups are in the TP=1 domain, where the store lists
    # nothing: it computes from scratch (the reference tokens).
    r = Node("store-tp-ref", model=tiny_llama, log_dir=log_dir,
             kv_transfer_config=kvbridge_config("both", "store-tp-ref",
                                                index_url=redis_server.url))
    try:
        r.wait_ready()
        refs = r.generate([request(PROMPTS[name], N_NEW) for name in RESTORED])
        assert [ref["num_cached_tokens"] for ref in refs] == [0] * len(RESTORED)
        assert r.stats()["num_index_hits"] == 0
    finally:
        r.stop()
    a.stop()  # A's own cache is gone: C can restore only from the store
    c = Node("store-tp-c", model=tiny_llama, log_dir=log_dir, llm=TP2,
             kv_transfer_config=kvbridge_config("both", "store-tp-engine-c",
                                                index_url=redis_server.url,
                                                load_timeout_s=LOAD_TIMEOUT_S,
                                                **PATIENT_INDEX))
    try:
        c.wait_ready()
        for name, ref in zip(RESTORED, refs, strict=True):
            before, ranks_before = c.stats(), c.rank_stats()
            (out,) = c.generate([request(PROMPTS[name], N_NEW)])
            assert out["token_ids"] == ref["token_ids"], name
            after, ranks_after = c.stats(), c.rank_stats()
            if out["num_cached_tokens"] or name == RESTORED[-1]:
                break
            # Only an index that did not answer C's lookup (the host's stall: PATIENT_INDEX)
            # earns the next prompt; a lookup answered "no hit" fails here.
            failed = after["num_index_lookup_failures"] - before["num_index_lookup_failures"]
            assert failed == 1, (name, failed, out["num_cached_tokens"])
        assert out["num_cached_tokens"] >= FULL_BLOCKS * BLOCK, out["num_cached_tokens"]
        moved = {k: after[k] - before[k] for k in ("num_index_hits", "num_restored_blocks",
                                                   "store_hit_tokens", "num_failed_loads")}
        assert moved == {"num_index_hits": 1, "num_restored_blocks": FULL_BLOCKS,
                         "store_hit_tokens": FULL_BLOCKS * BLOCK, "num_failed_loads": 0}, moved
        for rank in (0, 1):  # each rank read its own head of every block
            got = (ranks_after[rank]["bytes_restored"]
                   - ranks_before.get(rank, {}).get("bytes_restored", 0))
            assert got == FULL_BLOCKS * RANK_BLOCK_BYTES, (rank, got)
        assert_drained(c)
    finally:
        c.stop()
