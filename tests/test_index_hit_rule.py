"""Sliding-window groups through the block index (issue 14, part 3): a lookup finds the longest
length every group can restore under the local coordinator's rule (``kvmanager.PrefixHitRule``),
not the run held from block 0 in every group. In-memory and real Redis backends (and a real
Redis Cluster: ``tests/test_index_cluster.py`` runs these tests again)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest
from _engine_builders import reference_greedy, tiny_model
from _pd_builders import assert_node_empty, long_prompt, run_to_completion
from kvbridge.connector.factory import create_engine
from kvbridge.kvmanager import Request, SamplingParams
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.transport import LoopbackNetwork

BLOCK_SIZE = 16
_model_names = itertools.count()


def hybrid_node(
    engine_id: str, network: LoopbackNetwork, index_url: str, model_name: str
) -> Engine:
    """A ``tiny_hybrid`` node (full + sliding-window groups): 60 blocks, budget 64 tokens."""
    config = EngineConfig(
        num_blocks=60, block_size=BLOCK_SIZE, max_model_len=464, max_num_batched_tokens=64
    )
    kv_transfer_config = {
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "transport": "loopback",
            "index_url": index_url,
            "model_name": model_name,
            "index_ttl_s": 5.0,
            "index_lookup_timeout_s": 5.0,  # a loaded host must not turn a hit into a miss
            "load_timeout_s": 5.0,
        },
    }
    return create_engine(
        tiny_model(hybrid=True), config, kv_transfer_config, loopback_network=network
    )


def build_hybrid_nodes(index_url: str) -> Iterator[Callable[[str], Engine]]:
    """Yields ``build(engine_id)``, which makes a ``hybrid_node`` on ``index_url`` (all on one
    loopback network and a model name of their own); shuts every node down after the yield.
    The body of a ``hybrid_nodes`` fixture (``tests/test_index_cluster.py`` has the cluster's)."""
    model_name = f"hybrid-{next(_model_names)}"  # the in-process index is shared per namespace
    network = LoopbackNetwork()
    made: list[Engine] = []

    def build(engine_id: str) -> Engine:
        made.append(hybrid_node(engine_id, network, index_url, model_name))
        return made[-1]

    yield build
    for engine in made:
        engine.shutdown()


@pytest.fixture(params=["memory", "redis"])
def hybrid_nodes(request: pytest.FixtureRequest) -> Iterator[Callable[[str], Engine]]:
    url = "memory" if request.param == "memory" else request.getfixturevalue("redis_url")
    yield from build_hybrid_nodes(url)


def serve(engine: Engine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=2))
    token_ids = run_to_completion(engine, request_id).token_ids
    assert client_of(engine).flush()
    return token_ids


def client_of(engine: Engine):
    return engine.scheduler.connector.scheduler_half.index_client


def hashes_of(engine: Engine, prompt: list[int]) -> list[bytes]:
    probe = Request(
        "probe", prompt, SamplingParams(max_tokens=1),
        block_hasher=engine.kv_cache_manager.request_block_hasher,
    )
    return list(probe.block_hashes)


def local_hit_tokens(engine: Engine, hashes: list[bytes]) -> int:
    """What the node's own coordinator restores of ``hashes`` (the oracle)."""
    _, num_tokens = engine.kv_cache_manager.coordinator.find_longest_cache_hit(
        hashes, len(hashes) * BLOCK_SIZE
    )
    return num_tokens


def index_hit(engine: Engine, hashes: list[bytes]):
    client = client_of(engine)
    return client.index.longest_prefix(hashes, (0, 1), hit_rule=client.hit_rule)


def test_a_sliding_window_prompt_is_found_through_the_index_as_its_node_restores_it(hybrid_nodes):
    a = hybrid_nodes("node-a")
    first = long_prompt(323)
    serve(a, "first", first)
    serve(a, "second", long_prompt(193, salt="Something else entirely. "))
    hashes = hashes_of(a, first)  # 20 full blocks
    # (1) A's own cache restores 320 tokens (the full group from block 0, the sliding group only
    # the window before the end) ...
    assert local_hit_tokens(a, hashes) == 320
    # ... and so does the index: 20 blocks, A the holder, the sliding group's block ids null
    # (0) outside the window. Without the rule the run from block 0 in both groups is short.
    hit = index_hit(a, hashes)
    assert hit.num_blocks == 20
    holder = hit.best_holder
    assert holder is not None and holder.node_id == "node-a" and holder.block_ids is not None
    full_ids, window_ids = holder.block_ids
    pool = a.kv_cache_manager.block_pool
    assert list(full_ids) == [b.block_id for b in pool.get_cached_prefix(hashes, [0], 20)[0]]
    assert window_ids[-1] == pool.get_cached_block(hashes[19], [1])[0].block_id
    assert 0 in window_ids  # blocks the window no longer reads are not needed
    no_rule = client_of(a).index.longest_prefix(hashes, (0, 1))
    assert no_rule.num_blocks < 20

    # (2) A second hybrid node pulls it from A through the index and answers like a reference.
    c = hybrid_nodes("node-c")
    assert serve(c, "req", first) == reference_greedy(first, 2, hybrid=True)
    stats = c.scheduler.connector.stats.snapshot()
    assert (stats["num_index_hits"], stats["num_failed_loads"]) == (1, 0)
    assert stats["remote_hit_tokens"] > 0
    assert_node_empty(a)
    assert_node_empty(c)


def test_when_the_window_blocks_are_gone_the_index_finds_what_the_node_restores(hybrid_nodes):
    a = hybrid_nodes("node-a")
    first = long_prompt(323)
    serve(a, "first", first)
    hashes = hashes_of(a, first)
    assert index_hit(a, hashes).num_blocks == local_hit_tokens(a, hashes) // BLOCK_SIZE == 20
    # (1) The sliding group's blocks at the end (the window of every end from 17 on) go.
    pool = a.kv_cache_manager.block_pool
    gone = {pool.get_cached_block(hashes[i], [1])[0].block_id for i in (17, 18, 19)}
    pool.evict_blocks(gone)
    a.step()
    assert client_of(a).flush()
    # (2) The node restores less; the index finds exactly that (the same rule, one holder).
    expected = local_hit_tokens(a, hashes) // BLOCK_SIZE
    assert expected < 20
    assert index_hit(a, hashes).num_blocks == expected
    # (3) Every window block gone: neither restores anything beyond what the full group and
    # the rule allow (no window anywhere: nothing).
    window_ids = {
        blocks[0].block_id
        for h in hashes
        if (blocks := pool.get_cached_block(h, [1])) is not None
    }
    pool.evict_blocks(window_ids)
    a.step()
    assert client_of(a).flush()
    assert local_hit_tokens(a, hashes) == 0
    assert index_hit(a, hashes).num_blocks == 0
    assert_node_empty(a)
