"""The store tier inside stock vLLM engines (issue 31 parts 4 and 5): offload on eviction,
restore through the index, a store killed mid-restore.

A Redis server (the suite's fixture), a store node (``kvbridge-store --index-url URL
--capacity-bytes N --write-port W``, its own process, no model or profile named: it takes its
geometry from A's first write) and two vLLM engines, each its own process, started once for the
module:

- A: ``offload: "evict"`` to the store, a KV cache of 192 blocks of 32 tokens, and an offload
  window of the 96 free-queue entries vLLM reuses next (``offload_scan_blocks``), at most 16
  blocks a step (``offload_blocks_per_step``). A serves six prompts of 1,500 tokens (48 blocks
  each, with the decoded tokens) one after another: the first prompts' blocks reach the cold end
  of the free queue and are copied to the store before later prompts evict them.
- C: a fresh engine on the same index (no store of its own) that serves prompts A has evicted,
  and, once A has exited, a prompt A still held.

The store starts first, with the plain command line; A is given its write port as ``store_url``.
Reference tokens: A's own, computed from scratch (a single instance; nothing was cached or
pulled for them).

Checked: no block is offloaded while the prompts' blocks are far from eviction; C restores an
evicted prompt from the store (A still running), its greedy tokens equal A's, the restored
blocks counted by C (``num_restored_blocks``, ``store_hit_tokens``, vLLM's
``external_unspecified`` hit source) and A counted its writes; store blocks whose hash no
longer matches the index's entry are refused by the store's re-check and the tail recomputed
(A restoring s2, with the store's entries' block ids rotated in Redis); A stopped, C restores
from the store a prompt that A still held; the store paused while C's restore waits on it, then
killed:
C recomputes, the tokens are right, the failure is counted. D, an engine of the same model in
bfloat16, offloads to the same store, which keeps its blocks on a shelf of their own: D finds
none of A's blocks and restores its own. vLLM's KV-event stream (ZMQ, on
A) carries a ``BlockStored`` of the medium ``KVBRIDGE_STORE`` for the blocks A wrote. After
each test the engines still running hold no request and every block is free.
"""

from __future__ import annotations

import json
import re
import signal
import struct
import threading
import time

import msgpack
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
    tokens,
)
from _store_process import StoreProcess

A_KV_BYTES = 6 << 20  # 192 blocks of 32 tokens (32 KiB a block: 2 layers, 2 KV heads, fp32)
N_NEW = 8
PROMPT_LEN = 1500  # 46 full blocks cached; 48 blocks in use with the decoded tokens
PROMPTS = {f"s{i}": tokens(300 + i, PROMPT_LEN) for i in range(1, 7)}
FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # what a lookup may restore (never the last token)
SHELVES = 2  # A's float32 blocks and D's bfloat16 ones
STORE_BYTES = 256 * 32768 * SHELVES  # 256 blocks a shelf


def _logged_profile(log_path, pattern: str, timeout_s: float = 30.0) -> dict:
    """The store profile JSON a log shows after ``pattern`` (A's: ``--profile '``; the store's,
    once it took a geometry: ``profile ``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern + r"(\{.*\})", log_path.read_text(errors="replace"))
        if found:
            return json.loads(found.group(1).rstrip("'"))
        time.sleep(0.2)
    raise AssertionError(f"{log_path} shows no store profile")


class _KVEvents:
    """A subscriber to vLLM's KV-event stream (``kv_events_config``, ZMQ): each published batch
    (``KVEventBatch``: ``[ts, events, data_parallel_rank]``, every event a map tagged with its
    ``type``) is kept, on a thread of its own."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.connect(endpoint)
        self.events: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _, _, payload = self._sub.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(msgpack.unpackb(payload, raw=False)[1])

    def of_medium(self, medium: str, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e.get("type") == kind
                and e.get("medium") == medium]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._context.term()


@pytest.fixture(scope="module")
def tier(tiny_llama, log_dir, redis_server):
    write_port, events_port = free_port(), free_port()
    a = Node("store-a", model=tiny_llama, log_dir=log_dir,
             llm={"kv_cache_memory_bytes": A_KV_BYTES,
                  "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                       "endpoint": f"tcp://*:{events_port}"}},
             kv_transfer_config=kvbridge_config(
                 "both", "store-engine-a", index_url=redis_server.url,
                 store_url=f"127.0.0.1:{write_port}", offload="evict", offload_scan_blocks=96,
                 offload_blocks_per_step=16, load_timeout_s=10.0))
    c = Node("store-c", model=tiny_llama, log_dir=log_dir,
             kv_transfer_config=kvbridge_config("both", "store-engine-c",
                                                index_url=redis_server.url, load_timeout_s=5.0))
    store = StoreProcess(redis_server.url, write_port, log_dir / "store.log",
                         capacity_bytes=STORE_BYTES, max_shelves=SHELVES)
    try:
        start_nodes(a, c)
    except BaseException:
        store.kill()
        raise
    events = _KVEvents(f"tcp://127.0.0.1:{events_port}")  # vLLM binds a wildcard endpoint
    try:
        assert store.announced["store_url"] == f"127.0.0.1:{write_port}"
        # No geometry until A's first write: no pull address, no capacity in blocks.
        assert (store.announced["pull_address"], store.announced["capacity_blocks"]) == (
            None, None)
        yield a, c, store, events
    finally:
        events.close()
        store.kill()
        c.stop()
        a.stop()


@pytest.fixture(scope="module")
def served(tier):
    """A serves the six prompts in turn; their tokens (A computed each from scratch) and A's
    stats after the first two."""
    a = tier[0]
    outs, after_two = {}, None
    for name, prompt in PROMPTS.items():
        (out,) = a.generate([request(prompt, N_NEW)])
        assert out["num_cached_tokens"] == 0, name
        outs[name] = out["token_ids"]
        if name == "s2":
            after_two = a.stats()
    # The writes land on A's connector loop after the steps that planned them, and A's
    # scheduler half counts them at a later step (the worker's report): one-token requests
    # step A until s1's and s2's blocks are counted (on a fresh host the store's first write
    # also waits for the store to take its geometry), or a deadline the test then reports.
    deadline = time.monotonic() + 60.0
    while (a.stats()["num_offloaded_blocks"] < 2 * FULL_BLOCKS
           and time.monotonic() < deadline):
        time.sleep(0.5)
        a.generate([request([5, 6, 7], 1)])
    return outs, after_two


def test_a_offloads_only_blocks_near_eviction_and_c_restores_an_evicted_prompt(tier, served):
    a, c, store, events = tier
    outs, after_two = served
    # The store took A's geometry from A's first write: its profile (block identity, geometry,
    # index namespace) is exactly the one A logs.
    engine_profile = _logged_profile(a.log_path, "--profile '")
    assert _logged_profile(store.log_path, "profile ") == engine_profile
    assert engine_profile["identity"]["kv_layout"].startswith("vllm")  # vLLM's, not kvbridge's
    # Two prompts on a fresh pool: s1's blocks sit behind 95 never-used ones in the free queue
    # while s2 runs, outside the 96 entries vLLM reuses next: nothing copied yet (a window of
    # the whole queue would have copied s1 during s2's steps).
    assert after_two["num_offloaded_blocks"] == 0, after_two
    a_stats = a.stats()
    # s1 and s2 (and more) reached the cold end and were copied before s4 to s6 evicted them.
    assert a_stats["num_offloaded_blocks"] >= 2 * FULL_BLOCKS, a_stats
    assert a_stats["num_offload_failures"] == 0
    # vLLM's KV-event stream tells routers what the store holds: a BlockStored of the medium
    # KVBRIDGE_STORE for each block A wrote (those of A's last step are published later).
    stored = events.of_medium("KVBRIDGE_STORE", "BlockStored")
    assert 2 * FULL_BLOCKS <= len(stored) <= a_stats["num_offloaded_blocks"], len(stored)
    before, m_before = c.stats(), c.metrics()
    (out,) = c.generate([request(PROMPTS["s1"], N_NEW)])
    assert out["token_ids"] == outs["s1"]
    assert out["num_cached_tokens"] >= FULL_BLOCKS * BLOCK, out["num_cached_tokens"]
    after, m_after = c.stats(), c.metrics()
    moved = {k: after[k] - before[k] for k in ("num_index_hits", "num_restored_blocks",
                                               "store_hit_tokens", "remote_hit_tokens",
                                               "num_failed_loads")}
    assert moved == {"num_index_hits": 1, "num_restored_blocks": FULL_BLOCKS,
                     "store_hit_tokens": FULL_BLOCKS * BLOCK, "remote_hit_tokens": 0,
                     "num_failed_loads": 0}, moved
    source = "vllm:prompt_tokens_cached_by_source:external_unspecified"
    assert m_after.get(source, 0) - m_before.get(source, 0) == FULL_BLOCKS * BLOCK
    assert_drained(a, c)


STORE_ID = "store-0"  # kvbridge-store's default --engine-id
CORRUPT_FROM = 20  # the store's entries of every chain's blocks 20 and deeper name wrong blocks


def _store_entries(client: redis.Redis) -> dict[bytes, bytes]:
    """Every index entry of the store as Redis holds it: entry key -> the store's field
    (``index/redis_scripts.py``: incarnation [0:20], block id [20:24], tier [24], run [25:29])."""
    return {ekey: value
            for keys in client.scan_iter(match=f"kvbridge:bi:*:keys:{STORE_ID}")
            for ekey in client.smembers(keys)
            if (value := client.hget(ekey, STORE_ID)) is not None}


def test_store_blocks_whose_hash_no_longer_matches_are_refused_and_the_tail_recomputed(
        tier, served, redis_server):
    """Corrupt store data (issue 31, part 6): the index names, for every chain's blocks from
    ``CORRUPT_FROM`` on, a store block that holds another hash (the entries' block ids rotated
    among themselves, as a store whose blocks were rewritten behind the index would be). A,
    which still runs but evicted s2 long ago (all but its first blocks), restores s2: the
    store's hash re-check refuses the rotated blocks, A keeps the blocks before them and
    recomputes the rest; its tokens equal its own from scratch, the failure is counted."""
    a, _, _, _ = tier
    outs, _ = served
    client = redis.Redis.from_url(redis_server.url)
    listed: dict[bytes, bytes] = {}
    try:
        listed = _store_entries(client)
        deep = [k for k, v in listed.items() if struct.unpack(">I", v[25:29])[0] > CORRUPT_FROM]
        assert len(deep) >= FULL_BLOCKS - CORRUPT_FROM, len(deep)  # s2's at least
        for ekey, src in zip(deep, deep[1:] + deep[:1], strict=True):  # each: another's block
            client.hset(ekey, STORE_ID, listed[ekey][:20] + listed[src][20:24]
                        + listed[ekey][24:])
        before = a.stats()
        (out,) = a.generate([request(PROMPTS["s2"], N_NEW)])
        after = a.stats()
    finally:
        for ekey in listed:  # as the store published them, for the tests after this one
            client.hset(ekey, STORE_ID, listed[ekey])
        client.close()
    assert out["token_ids"] == outs["s2"]
    moved = {k: after[k] - before[k] for k in ("num_index_hits", "num_restored_blocks",
                                               "num_failed_loads", "num_load_errors_blocks")}
    # Restored: the blocks before the first refused one that A no longer cached (it still
    # held s2's first ones, freed last); every refused block counted. (vLLM's
    # num_cached_tokens counts the whole hit as the scheduler saw it, failed part included.)
    assert 0 < moved.pop("num_restored_blocks") <= CORRUPT_FROM
    assert moved == {"num_index_hits": 1, "num_failed_loads": 1,
                     "num_load_errors_blocks": FULL_BLOCKS - CORRUPT_FROM}, moved
    assert_drained(a)


def test_after_a_exits_c_restores_from_the_store_what_only_a_held_besides(tier, served):
    a, c, _, _ = tier
    outs, _ = served
    a.stop()  # s3 was still in A's cache (and copied to the store while it neared eviction)
    before = c.stats()
    (out,) = c.generate([request(PROMPTS["s3"], N_NEW)])
    assert out["token_ids"] == outs["s3"]
    after = c.stats()
    assert (after["num_restored_blocks"] - before["num_restored_blocks"],
            after["num_failed_loads"] - before["num_failed_loads"]) == (FULL_BLOCKS, 0)
    assert_drained(c)


def test_an_engine_of_another_dtype_keeps_its_blocks_on_a_shelf_of_its_own(
        tier, served, tiny_llama, log_dir, redis_server):
    """D: the same model in bfloat16 (another KV dtype: another block geometry) offloads to the
    store A wrote to. The store opens a second shelf for D's profile (docs/operations.md,
    "Several block geometries in one store"): D finds none of A's float32 blocks, though its
    prompts' block hashes are A's, and restores its own evicted prompt from its shelf."""
    _, c, store, _ = tier
    d = Node("store-d", model=tiny_llama, log_dir=log_dir,
             llm={"dtype": "bfloat16", "kv_cache_memory_bytes": A_KV_BYTES // 2},  # 192 blocks
             kv_transfer_config=kvbridge_config(
                 "both", "store-engine-d", index_url=redis_server.url,
                 store_url=store.announced["store_url"], offload="evict",
                 offload_scan_blocks=96, offload_blocks_per_step=16, load_timeout_s=10.0))
    try:
        d.wait_ready()
        d_outs = {}
        for name, prompt in PROMPTS.items():
            (out,) = d.generate([request(prompt, N_NEW)])
            assert out["num_cached_tokens"] == 0, name  # nothing of A's geometry reaches D
            d_outs[name] = out["token_ids"]
        deadline = time.monotonic() + 60.0
        while (d.stats()["num_offloaded_blocks"] < 2 * FULL_BLOCKS
               and time.monotonic() < deadline):
            time.sleep(0.5)
            d.generate([request([5, 6, 7], 1)])
        d_stats = d.stats()
        assert d_stats["num_offloaded_blocks"] >= 2 * FULL_BLOCKS, d_stats
        assert d_stats["num_offload_failures"] == 0, d_stats  # not refused by A's store
        assert d_stats["num_index_hits"] == 0, d_stats
        before = d.stats()
        (out,) = d.generate([request(PROMPTS["s1"], N_NEW)])  # evicted on D: from D's shelf
        assert out["token_ids"] == d_outs["s1"]
        after = d.stats()
        moved = {k: after[k] - before[k] for k in ("num_restored_blocks", "store_hit_tokens",
                                                   "num_failed_loads")}
        assert moved == {"num_restored_blocks": FULL_BLOCKS,
                         "store_hit_tokens": FULL_BLOCKS * BLOCK, "num_failed_loads": 0}, moved
        # The store logged two shelves: A's float32 geometry and D's bfloat16 one.
        logged = re.findall(r"pulls on \S+, profile (\{.*\})", store.log_path.read_text())
        dtypes = [json.loads(p)["identity"]["kv_cache_dtype"] for p in logged]
        assert dtypes == ["float32", "bfloat16"], dtypes
        assert_drained(c, d)
    finally:
        d.stop()


def test_the_store_killed_mid_restore_costs_a_recompute_with_the_right_tokens(tier, served):
    _, c, store, _ = tier
    outs, _ = served
    before = c.stats()
    store.signal(signal.SIGSTOP)  # the store stops answering; its index entries stay listed
    try:
        c.submit([request(PROMPTS["s2"], N_NEW)])
        time.sleep(1.5)  # C's lookup named the store; its restore waits on it
    finally:
        store.kill()
    (out,) = c.result()["outputs"]
    assert out["token_ids"] == outs["s2"]
    after = c.stats()
    assert (after["num_index_hits"] - before["num_index_hits"],
            after["num_failed_loads"] - before["num_failed_loads"]) == (1, 1)
    assert after["num_restored_blocks"] == before["num_restored_blocks"]
    assert_drained(c)
