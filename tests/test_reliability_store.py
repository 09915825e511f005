"""Reliability cases 4 and 5 of issue 15 (the store tier), each from a report in another system:
store writes that fail or land partly, and a block reused while its store write is queued. The
store runs over the loopback transport beside kvbridge's own engines; every lifecycle test ends
with the engines empty (no request held, integrity true, every block free)."""

from __future__ import annotations

import time

import pytest
import torch
from _engine_builders import reference_greedy, tiny_model
from _pd_builders import assert_node_empty, kv_bytes, long_prompt, run_to_completion
from kvbridge.connector.factory import create_engine
from kvbridge.connector.store.node import StoreNode, close_store_node, start_store_node
from kvbridge.kvmanager import Request, SamplingParams
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.transport import LoopbackNetwork

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


def make_store(
    network: LoopbackNetwork, model_name: str, *, capacity_blocks: int, **kw
) -> StoreNode:
    model = tiny_model(hybrid=False).config
    per_block = 2 * BLOCK_SIZE * model.num_kv_heads * model.head_dim * 4 * model.num_layers
    node = StoreNode(
        model,
        block_size=BLOCK_SIZE,
        capacity_bytes=capacity_blocks * per_block,
        transport="loopback",
        loopback_network=network,
        model_name=model_name,
        index_url="memory",
        **kw,
    )
    return start_store_node(node)


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
    land in them before the snapshot. Here the snapshot waits for R's pull (a busy worker
    thread). The store must never hold R's bytes under A's hashes: every block the snapshot
    reads still holds the hash it is written under, and every A block the store holds has A's
    bytes.
    """
    engines, stores = cleanup
    store = make_store(network, model_name, capacity_blocks=32)
    stores.append(store)
    host, port = store.write_address
    n = make_engine(
        "node-n", "kv_both", network, model_name, num_blocks=8, store_url=f"{host}:{port}", offload=policy
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

    # The snapshot of the next step waits until R's pull has landed, and checks every block it
    # reads against the pool (same thread: the engine's).
    worker = n.runner.connector.worker_half
    sender = worker.offload_sender
    submit = sender.submit
    snapshotted: list[tuple[int, bytes]] = []

    def slow_submit(items):
        time.sleep(0.3)  # R's loopback pull of 5 blocks lands meanwhile
        for item in items:
            key = make_block_hash_with_group_id(item.block_hash, item.group_id)
            assert pool.get_block(item.block_id).block_hash == key, (
                f"block {item.block_id} snapshotted under a hash it no longer holds"
            )
            snapshotted.append((item.block_id, item.block_hash))
        return submit(items)

    sender.submit = slow_submit

    # (3) R is admitted on the 6 free blocks at the queue's head: 3 of them were A's.
    output = run_to_completion(n, "R")
    assert output.token_ids == reference_greedy(prompt_r, 2, hybrid=False)
    sender.wait_idle()
    n.step()

    # (4) The store holds A's blocks only with A's bytes, and none of them was read after reuse.
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
