"""Reliability cases 4 and 5 of issue 15 (the store tier), each from a report in another system:
store writes that fail or land partly, and a block reused while its store write is queued. The
store runs over the loopback transport beside kvbridge's own engines; every lifecycle test ends
with the engines empty (no request held, integrity true, every block free)."""

from __future__ import annotations

import re

import _store_builders
import pytest
import torch
from _engine_builders import reference_greedy, tiny_model
from _pd_builders import assert_node_empty, kv_bytes, long_prompt, run_to_completion
from kvbridge.connector.factory import create_engine
from kvbridge.connector.store.node import StoreNode, close_store_node
from kvbridge.kvmanager import Request, SamplingParams
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.transport import LoopbackFaults, LoopbackNetwork

BLOCK_SIZE = 16


@pytest.fixture
def network():
    return LoopbackNetwork()


@pytest.fixture
def model_name(request):
    return f"i15-{request.node.name}"


@pytest.fixture
def cleanup():
    engines: list[Engine] = []
    stores: list[StoreNode] = []
    yield engines, stores
    for engine in engines:
        engine.shutdown()
    for store in stores:
        close_store_node(store)


def make_store(network: LoopbackNetwork, model_name: str, *, capacity_blocks: int) -> StoreNode:
    return _store_builders.make_store(
        network, index_url="memory", capacity_blocks=capacity_blocks, model_name=model_name
    )


def make_engine(
    engine_id: str, role: str, network: LoopbackNetwork, model_name: str, *, num_blocks: int,
    **extra,
) -> Engine:
    """A node on ``network`` whose block index is the embedded one, in a namespace of its own
    (``model_name``: one per test, so no other test's entries are found)."""
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=min(256, (num_blocks - 1) * BLOCK_SIZE),
        max_num_batched_tokens=512,
    )
    kv_transfer_config = {
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "transport": "loopback",
            "model_name": model_name,
            "index_url": "memory",
            "heartbeat_interval_s": 0.05,
            "load_timeout_s": 5.0,
            "offload_blocks_per_step": 64,
            **extra,
        },
    }
    return create_engine(
        tiny_model(hybrid=False), config, kv_transfer_config, loopback_network=network
    )


def hashes_of(engine: Engine, prompt: list[int]) -> list[bytes]:
    probe = Request(
        "probe",
        prompt,
        SamplingParams(max_tokens=1),
        block_hasher=engine.kv_cache_manager.request_block_hasher,
    )
    return list(probe.block_hashes)


def store_rows(store: StoreNode, block_hash: bytes) -> list[torch.Tensor] | None:
    """The store's bytes for ``block_hash`` in group 0, every layer (None: not held)."""
    block_id = store.cache.block_id_of(0, block_hash)
    if block_id is None:
        return None
    return [cache[block_id].clone() for cache in store.kv_caches_by_group[0]]


@pytest.mark.parametrize("policy", ["evict", "write_through"])
def test_case5_a_block_reused_before_its_store_write_never_lands_under_the_old_hash(
    network, model_name, cleanup, policy
):
    """Issue 15, case 5 (a vLLM report: reuse under an in-flight store write).

    Node N (7 usable blocks) offloads to a store. Request A (4 full blocks and a partial one)
    finishes with max_tokens=1; at that step's end the planner queues A's cached blocks for the
    store (cold blocks for ``evict``, newly cached ones for ``write_through``). The snapshot of
    those blocks is taken at the next step's ``start_load_kv``, but that step's schedule runs
    first: R, a request whose KV comes from P, takes 6 blocks, 3 of them A's, and R's pull may
    land in them before the snapshot. Here the snapshot waits until R's pull has settled (as
    a busy worker thread would let it), so R's bytes are in the reused blocks when it reads.
    The test first checks that this happened (R holds blocks that were queued for the store;
    the planner's fence withdrew exactly those); then the store must never hold R's bytes
    under A's hashes: every block the snapshot reads still holds the hash it is written under,
    and every A block the store holds has A's bytes.
    """
    engines, stores = cleanup
    store = make_store(network, model_name, capacity_blocks=32)
    stores.append(store)
    n = make_engine(
        "node-n", "kv_both", network, model_name, num_blocks=8,
        store_url=store.store_url, offload=policy,
    )
    p = make_engine("prefill-0", "kv_producer", network, model_name, num_blocks=32, lease_s=30.0)
    engines.extend([n, p])
    prompt_a = long_prompt(65)
    prompt_r = long_prompt(90, salt="A request whose KV comes from the prefill node. ")

    # (1) A runs on N; its 4 full blocks are cached. Its bytes, before anything reuses them.
    n.add_request("A", prompt_a, SamplingParams(max_tokens=1))
    run_to_completion(n, "A")
    pool = n.kv_cache_manager.block_pool
    hashes_a = hashes_of(n, prompt_a)
    a_block_ids = [
        pool.get_cached_block(hash_, [0])[0].block_id for hash_ in hashes_a  # type: ignore[index]
    ]
    a_bytes = {h: kv_bytes(n, 0, b) for h, b in zip(hashes_a, a_block_ids, strict=True)}

    # (2) P prefills R; R arrives at N with P's ticket.
    p.add_request("R", prompt_r, SamplingParams(max_tokens=1),
                  kv_transfer_params={"do_remote_decode": True})
    params = run_to_completion(p, "R").kv_transfer_params
    p.step()  # the lease reaches P's worker half
    n.add_request("R", prompt_r, SamplingParams(max_tokens=2), params)

    # What the planner queued for the store before R arrives (A's cold or newly cached
    # blocks), and what its fence withdraws once R's schedule has reused some of them.
    planner = n.scheduler.connector.scheduler_half.offload_planner
    queued = {item[0]: item[2] for item in n.scheduler.connector.scheduler_half._meta.offload_items}
    assert queued and set(queued.values()) <= set(hashes_a), queued
    drop_reused = planner.drop_reused
    dropped: list[tuple[int, bytes]] = []

    def recording_drop_reused(items, block_pool):
        kept = drop_reused(items, block_pool)
        dropped.extend((item[0], item[2]) for item in items if item not in kept)
        return kept

    planner.drop_reused = recording_drop_reused

    # R's blocks, read just before R frees them.
    manager = n.kv_cache_manager
    free = manager.free
    r_block_ids: set[int] = set()

    def recording_free(request):
        if request.request_id == "R":
            r_block_ids.update(manager.get_block_ids("R")[0])
        return free(request)

    manager.free = recording_free

    # The snapshot of the next step waits until R's pull (submitted just before it, in the
    # same ``start_load_kv``) has settled, then checks every block it reads against the pool
    # (same thread: the engine's). So R's bytes are in the reused blocks when it reads them.
    worker = n.runner.connector.worker_half
    sender = worker.offload_sender
    submit = sender.submit
    snapshotted: list[tuple[int, bytes]] = []
    stale: list[int] = []
    pull_settled_first: list[bool] = []  # one entry per snapshot taken with a pull in flight

    def slow_submit(items):
        if worker.puller.num_inflight:
            pull_settled_first.append(worker.puller.wait_for_any(30.0))
        for item in items:
            key = make_block_hash_with_group_id(item.block_hash, item.group_id)
            if pool.get_block(item.block_id).block_hash != key:
                stale.append(item.block_id)  # snapshotted under a hash it no longer holds
            snapshotted.append((item.block_id, item.block_hash))
        return submit(items)

    sender.submit = slow_submit

    # (3) R is admitted on the 6 free blocks at the queue's head: 3 of them were A's.
    output = run_to_completion(n, "R")
    assert output.token_ids == reference_greedy(prompt_r, 2, hybrid=False)
    sender.wait_idle()
    n.step()

    # (4) The scenario happened: R took blocks that were queued for the store, under A's
    # hashes, before the snapshot; the fence withdrew exactly those; nothing stale was read.
    reused = r_block_ids & set(queued)
    assert reused, (r_block_ids, queued)
    assert len(dropped) >= 1
    assert {block_id for block_id, _ in dropped} == reused
    assert all(queued[block_id] == block_hash for block_id, block_hash in dropped)
    assert pull_settled_first == [True], "the snapshot did not wait for R's pull to settle"
    assert stale == [], f"blocks {stale} snapshotted under a hash they no longer hold"
    # (a reused block may be snapshotted later under R's hash, never under A's)
    assert not {(block_id, queued[block_id]) for block_id in reused} & set(snapshotted)

    # (5) The store holds A's blocks only with A's bytes, and none of them was read after reuse.
    num_held = 0
    for block_hash in hashes_a:
        rows = store_rows(store, block_hash)
        if rows is None:
            continue
        num_held += 1
        for got, want in zip(rows, a_bytes[block_hash], strict=True):
            assert torch.equal(got, want), "the store holds other bytes under one of A's hashes"
    assert num_held >= 1  # A's blocks that were not reused did reach the store
    assert_node_empty(n)
    assert_node_empty(p)


def _offload_node(network, model_name, store, **extra) -> Engine:
    """Node N: 7 usable blocks, offloading cold blocks to ``store`` (policy evict)."""
    return make_engine(
        "node-n", "kv_both", network, model_name, num_blocks=8,
        store_url=store.store_url, offload="evict", **extra,
    )


def _serve_and_offload(engine: Engine, request_id: str, prompt: list[int]) -> list[int]:
    """Run ``prompt`` (max_tokens=1) on ``engine`` and let its freed blocks reach the store."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    output = run_to_completion(engine, request_id)
    engine.step()  # the step after the finish: its cold blocks are snapshotted and sent
    engine.runner.connector.worker_half.offload_sender.wait_idle()
    engine.step()  # the outcomes reach the scheduler half
    return output.token_ids


def store_depth(store: StoreNode, hashes: list[bytes]) -> int:
    """Blocks of ``hashes`` the index lists for the store, from block 0 (after the store's
    queued publishes reached the index: ``IndexClient.publish`` returns at once)."""
    assert store.index_client.flush()
    hit = store.index_client.index.longest_prefix(hashes, (0,), all_holders=True)
    return max((h.num_blocks for h in hit.holders if h.node_id == store.engine_id), default=0)


def test_case4_a_block_whose_store_write_fails_cuts_the_chain_there(network, model_name, cleanup):
    """Issue 15, case 4, first half (an LMCache report: store writes that fail).

    N offloads the 4 full blocks of a 65-token prompt in one put; the store's write of block 2
    fails (refused, as when no block can be taken for it). Blocks 0-1 are stored and published;
    block 3 is stored but never published, since its parent is missing; so a later lookup finds
    at most blocks 0-1 on the store, and the store serves no block under block 2's key.
    """
    engines, stores = cleanup
    store = make_store(network, model_name, capacity_blocks=32)
    stores.append(store)
    n = _offload_node(network, model_name, store)
    engines.append(n)
    prompt = long_prompt(65)
    hashes = hashes_of(n, prompt)
    assert len(hashes) == 4
    put = store.cache.put

    def put_failing_block_2(group_id, block_hashes, parent_hashes, staging, heads=None):
        keep = [i for i, h in enumerate(block_hashes) if h != hashes[2]]
        result = put(
            group_id,
            [block_hashes[i] for i in keep],
            [parent_hashes[i] for i in keep],
            staging.index_select(1, torch.tensor(keep, dtype=torch.int64)),
            heads,
        )
        lost = (hashes[2],) if len(keep) < len(block_hashes) else ()
        return result._replace(refused=result.refused + lost)

    store.cache.put = put_failing_block_2

    _serve_and_offload(n, "A", prompt)
    assert store.cache.block_id_of(0, hashes[2]) is None
    assert store.cache.block_id_of(0, hashes[1]) is not None
    assert store_depth(store, hashes) == 2  # blocks 0-1; block 3 is held but unreachable
    # A read under block 2's key is refused whatever block id it names.
    num_rows = store.cache.num_store_blocks + 1
    assert store.cache.validate(0, list(range(1, num_rows)), [hashes[2]] * (num_rows - 1)) == (
        list(range(num_rows - 1))
    )
    planner = n.scheduler.connector.scheduler_half.offload_planner
    assert not planner.is_offloaded(0, hashes[2])  # N may offer it again later
    assert planner.is_offloaded(0, hashes[1])
    assert_node_empty(n)


def test_case4_a_restore_that_lands_partly_is_a_hit_of_what_landed_only(
    network, model_name, cleanup, caplog
):
    """Issue 15, case 4, second half (an LMCache report: a restore whose staging had room for
    part of the blocks, yet reported the whole hit).

    A kvbridge restore cannot run short of room: N allocates every target block before the
    pull starts (``allocate_slots`` is all or nothing), and staging is per chunk
    (``transport/staging.py``: ``StagingPool.acquire`` never fails, and a chunk holds at least
    one whole block). So a stall mid-restore stands in for the short staging.

    The store holds the 4 full blocks of A's prompt and N no longer does. N asks for A again: it
    finds the 4 blocks on the store and pulls them in reads of 2 blocks per chunk; the store
    sends the first chunk (2 blocks) and then nothing. N's deadline ends the pull; the hit it
    keeps is what landed and was confirmed (2 blocks, or 0: the store's ``ReadDone`` never came),
    never 4 with stale bytes; its tokens equal a single-node run.
    """
    engines, stores = cleanup
    store = make_store(network, model_name, capacity_blocks=32)
    stores.append(store)
    n = _offload_node(network, model_name, store, load_timeout_s=0.5)
    engines.append(n)
    prompt_a = long_prompt(65)
    hashes = hashes_of(n, prompt_a)

    # (1) A's 4 full blocks reach the store; another prompt then takes N's blocks back.
    _serve_and_offload(n, "A", prompt_a)
    assert store_depth(store, hashes) == 4
    _serve_and_offload(n, "B", long_prompt(100, salt="Another document. "))
    pool = n.kv_cache_manager.block_pool
    assert all(pool.get_cached_block(h, [0]) is None for h in hashes)
    # N's removals reach the index before its lookup: the store is the only holder of A.
    assert n.scheduler.connector.scheduler_half.index_client.flush()

    # (2) N restores A from the store, 2 blocks per chunk; the store stalls after one chunk.
    block_nbytes = sum(c[0].numel() * c.element_size() for c in n.runner.kv_caches.values())
    n.runner.connector.worker_half.transport.chunk_bytes = 2 * block_nbytes
    store.transport.faults = LoopbackFaults(stall_after_chunks=1)
    with caplog.at_level("WARNING", logger="kvbridge"):
        n.add_request("A2", prompt_a, SamplingParams(max_tokens=4))
        output = run_to_completion(n, "A2")
    stats = n.scheduler.connector.stats.snapshot()
    assert stats["store_hit_tokens"] == 64  # planned: the 4 blocks the store listed
    assert stats["num_failed_loads"] == 1
    cut = [
        int(m.group(1))
        for r in caplog.records
        if (m := re.search(r"KV load failed from token (\d+)", r.getMessage()))
    ]
    assert len(cut) == 1 and cut[0] in (0, 32), cut  # what landed: 2 blocks, or none
    assert output.token_ids == reference_greedy(prompt_a, 4, hybrid=False)
    store.transport.faults = LoopbackFaults()
    assert_node_empty(n)
