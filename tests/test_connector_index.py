"""The block index in the connector (issue 6, part 4): three nodes over the loopback transport
and a real ``redis-server`` (fixture), each a full engine that publishes its block-pool events and
asks the index for a request's longest prefix before it falls back to local APC."""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch
from _engine_builders import reference_greedy, tiny_model
from _pd_builders import assert_node_empty, long_prompt, run_to_completion
from kvbridge.connector.factory import create_engine
from kvbridge.kernels.model import ReferenceDecoder
from kvbridge.kvmanager import BlockStored, Request, SamplingParams
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.transport import LoopbackNetwork

BLOCK_SIZE = 16
MAX_TOKENS = 3


def make_node(
    engine_id: str, network: LoopbackNetwork, index_url: str, *,
    model: ReferenceDecoder | None = None, **extra,
) -> Engine:
    """A ``kv_both`` node of ``model`` (the tiny one): serves its blocks to others, pulls theirs
    via the index."""
    config = EngineConfig(
        num_blocks=160, block_size=BLOCK_SIZE, max_model_len=1100, max_num_batched_tokens=1100
    )
    kv_transfer_config = {
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "transport": "loopback",
            "index_url": index_url,
            "index_ttl_s": 1.5,
            "heartbeat_interval_s": 0.1,
            "load_timeout_s": 5.0,
            **extra,
        },
    }
    return create_engine(
        model or tiny_model(hybrid=False), config, kv_transfer_config, loopback_network=network
    )


def serve(engine: Engine, request_id: str, prompt: list[int], **kwargs) -> list[int]:
    """Run the request to completion, then wait until the node's block events have reached the
    index (publishing is asynchronous), so the next node's lookup sees them."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS), **kwargs)
    token_ids = run_to_completion(engine, request_id).token_ids
    assert index_client(engine).flush()
    return token_ids


def stats(engine: Engine) -> dict:
    return engine.scheduler.connector.stats.snapshot()


def index_client(engine: Engine):
    return engine.scheduler.connector.scheduler_half.index_client


@pytest.fixture
def nodes(redis_url):
    network = LoopbackNetwork()
    made: list[Engine] = []

    def build(engine_id: str, *, index_url: str | None = None, **extra) -> Engine:
        engine = make_node(engine_id, network, index_url or redis_url, **extra)
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.shutdown()


def blocks_of(prompt: list[int]) -> int:
    return len(prompt) // BLOCK_SIZE


def test_request_pulls_the_longest_prefix_then_falls_back_to_local_apc(nodes):
    a, b, c = nodes("node-a"), nodes("node-b"), nodes("node-c")
    prompt = long_prompt(62 * BLOCK_SIZE + 5)
    # (1) A holds the prompt's first 40 blocks, B its first 60 (both hashed and published).
    serve(a, "warm-a", prompt[: 40 * BLOCK_SIZE + 3])
    serve(b, "warm-b", prompt[: 60 * BLOCK_SIZE + 3])

    # (2) C has nothing local: the index names B (60 > 40 blocks), C pulls 60 blocks from B.
    tokens = serve(c, "req-0", prompt)
    assert tokens == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    s = stats(c)
    assert (s["num_index_hits"], s["num_loads"], s["num_failed_loads"]) == (1, 1, 0)
    assert s["num_blocks_received"] == 60
    assert s["remote_hit_tokens"] == 60 * BLOCK_SIZE
    assert c.scheduler.connector.stats.pulls_by_holder() == {  # B, found through the index
        "node-b": {"pulls": 1, "blocks": 60, "index_pulls": 1}
    }

    # (3) A prompt nobody holds: the lookup misses and C computes it with local APC only.
    other = long_prompt(10 * BLOCK_SIZE, salt="Nobody has seen this text. ")
    assert serve(c, "req-1", other) == reference_greedy(other, MAX_TOKENS, hybrid=False)
    s = stats(c)
    assert (s["num_index_lookups"], s["num_index_hits"], s["num_loads"]) == (2, 1, 1)
    for node in (a, b, c):
        assert_node_empty(node)


def test_a_sync_node_loads_an_index_hit_inside_the_step_it_was_told(nodes):
    # load_mode "sync": get_num_new_matched_tokens tells the engine the load is synchronous, so
    # the step that allocates the blocks computes the request at once. The pull must then be
    # planned sync too, so that the worker waits for it before that forward (before the fix
    # an index hit was planned async: the forward read blocks whose bytes had not landed).
    a, c = nodes("node-a"), nodes("node-c", load_mode="sync")
    prompt = long_prompt(30 * BLOCK_SIZE + 5)
    serve(a, "warm-a", prompt)
    assert serve(c, "req-0", prompt) == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    s = stats(c)
    assert (s["num_index_hits"], s["num_loads"], s["num_sync_loads"]) == (1, 1, 1)
    assert s["num_blocks_received"] == 30
    for node in (a, c):
        assert_node_empty(node)


def test_eviction_and_restart_remove_entries_and_fence_the_old_incarnation(nodes, redis_url):
    a = nodes("node-a")
    prompt = long_prompt(20 * BLOCK_SIZE + 2)
    serve(a, "warm", prompt)
    # The prompt's block hashes, from a request built with the node's own hasher.
    probe = Request(
        "probe",
        prompt,
        SamplingParams(max_tokens=1),
        block_hasher=a.kv_cache_manager.request_block_hasher,
    )
    hashes = probe.block_hashes[:20]
    index = index_client(a).index

    def depth() -> int:
        return index.longest_prefix(hashes, (0,)).num_blocks

    assert depth() == 20
    # (1) Evicting block 5's hash on A removes it from the index at A's next step.
    block_id = a.kv_cache_manager.block_pool.get_cached_block(hashes[5], [0])[0].block_id
    a.kv_cache_manager.block_pool.evict_blocks({block_id})
    a.step()
    assert index_client(a).flush()
    assert depth() == 5
    # (2) A restarts: the new incarnation drops every entry of the old one ...
    old_client = index_client(a)
    a.shutdown()
    a2 = nodes("node-a")
    assert depth() == 0
    # ... and a zombie publish from the old incarnation is refused.
    zombie = BlockStored(
        block_hashes=list(hashes[:3]),
        parent_block_hash=None,
        token_ids=[],
        block_size=BLOCK_SIZE,
        lora_name=None,
        medium=None,
        group_id=0,
        block_ids=[1, 2, 3],
    )
    result = old_client.index.publish("node-a", old_client.incarnation, [zombie])
    assert result.status == "fenced"
    assert depth() == 0
    assert_node_empty(a2)


def test_stale_index_entry_costs_a_recompute_not_wrong_output(nodes):
    b, c = nodes("node-b"), nodes("node-c")
    prompt = long_prompt(12 * BLOCK_SIZE + 7)
    serve(b, "warm", prompt)
    # (1) B drops the blocks' hashes but the removal never reaches the index (lost publish).
    pool = b.kv_cache_manager.block_pool
    pool.evict_blocks({blk.block_id for blk in pool.blocks if blk.block_hash is not None})
    client = index_client(b)
    client.publish = lambda events: None  # the step's removals are lost on the way
    b.step()  # B's worker half learns of the evictions (its hash mirror drops them)
    del client.publish
    # (2) C follows the stale entry; B's hash check refuses the blocks; C recomputes.
    assert serve(c, "req-0", prompt) == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    s = stats(c)
    assert (s["num_index_hits"], s["num_failed_loads"]) == (1, 1)
    assert_node_empty(b)
    assert_node_empty(c)


def test_redis_outage_falls_back_to_local_apc_and_recovers(nodes, redis_server):
    b, c = nodes("node-b"), nodes("node-c")
    # (1) Redis goes away: requests still complete through local APC, lookups count failures.
    redis_server.stop()
    prompt = long_prompt(8 * BLOCK_SIZE + 3)
    assert serve(b, "warm", prompt) == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert serve(c, "req-0", prompt) == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert stats(c)["num_index_hits"] == 0
    assert index_client(c).index.stats.lookups_failed >= 1
    # (2) Redis is back (empty, as after a crash): nodes register again and publish new blocks.
    redis_server.start()
    time.sleep(1.1)  # the index retries a down backend after its back-off interval
    prompt2 = long_prompt(9 * BLOCK_SIZE + 3, salt="After the outage. ")
    serve(b, "warm-2", prompt2)
    assert serve(c, "req-1", prompt2) == reference_greedy(prompt2, MAX_TOKENS, hybrid=False)
    assert stats(c)["num_index_hits"] == 1
    assert_node_empty(b)
    assert_node_empty(c)


@pytest.mark.parametrize(
    "b_kwargs, c_kwargs, hit",
    [
        ({"cache_salt": "tenant-1"}, {"cache_salt": "tenant-2"}, False),
        ({"cache_salt": "tenant-1"}, {"cache_salt": "tenant-1"}, True),
        ({"lora_name": "adapter-x"}, {}, False),
        ({}, {"cache_salt": "x"}, False),
    ],
)
def test_salt_and_lora_never_cross_hit_through_the_index(nodes, b_kwargs, c_kwargs, hit):
    b, c = nodes("node-b"), nodes("node-c")
    prompt = long_prompt(6 * BLOCK_SIZE + 1)
    serve(b, "warm", prompt, **b_kwargs)
    serve(c, "req-0", prompt, **c_kwargs)
    assert stats(c)["num_index_hits"] == int(hit)
    assert_node_empty(b)
    assert_node_empty(c)


@functools.cache
def _bfloat16_model() -> ReferenceDecoder:
    """The tiny model's weights in bfloat16: its KV cache is bfloat16, the block identity's
    ``kv_cache_dtype`` too."""
    return ReferenceDecoder(dataclasses.replace(tiny_model(hybrid=False).config,
                                                dtype=torch.bfloat16))


@pytest.mark.parametrize("index_url", ["redis", "memory"])
@pytest.mark.parametrize(
    "c_kwargs, hit",
    [
        ({}, True),  # the same block identity: C pulls A's blocks
        ({"model_revision": "5d0f2ab1"}, False),  # another revision of the same weights
        ({"model": "bfloat16"}, False),  # another KV cache dtype
    ],
)
def test_a_node_of_another_block_identity_never_finds_the_blocks(nodes, c_kwargs, hit, index_url):
    # Issue 28 item 7: blocks whose bytes differ under one hash never cross through the index.
    # Before, the namespace held the model name, block size and hash function only: the
    # bfloat16 node found A's float32 blocks, pulled, and its handshake refused them (a
    # failed load, then a recompute); the revision was no setting at all.
    if c_kwargs.get("model") == "bfloat16":
        c_kwargs = {**c_kwargs, "model": _bfloat16_model()}
    url = {"redis": None, "memory": "memory"}[index_url]
    model_name = f"identity-{index_url}-{hit}-{sorted(c_kwargs)}"  # "memory": its own backend
    a = nodes("node-a", index_url=url, model_name=model_name)
    c = nodes("node-c", index_url=url, model_name=model_name, **c_kwargs)
    prompt = long_prompt(6 * BLOCK_SIZE + 1)
    serve(a, "warm", prompt)
    tokens = serve(c, "req-0", prompt)
    s = stats(c)
    assert (s["num_index_hits"], s["num_loads"], s["num_failed_loads"]) == (hit, hit, 0)
    if "model" not in c_kwargs:  # the reference is the float32 model's
        assert tokens == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert_node_empty(a)
    assert_node_empty(c)


def test_blocks_are_published_only_after_the_forward_that_computes_them(nodes):
    a, c = nodes("node-a"), nodes("node-c")
    prompt = long_prompt(6 * BLOCK_SIZE + 4)
    a.add_request("warm", prompt, SamplingParams(max_tokens=1))
    # (1) A schedules the prompt (once its asynchronous index lookup has answered: until then
    # a step skips it): its blocks are hashed now, before the forward writes their KV.
    scheduler_output = a.scheduler.schedule()
    while not scheduler_output.num_scheduled_tokens:
        a.scheduler.update_from_output(scheduler_output, a.runner.execute_model(scheduler_output))
        time.sleep(0.001)
        scheduler_output = a.scheduler.schedule()
    probe = Request(
        "probe",
        prompt,
        SamplingParams(max_tokens=1),
        block_hasher=a.kv_cache_manager.request_block_hasher,
    )
    index = index_client(a).index
    # (2) Mid-step (A's forward not run yet) nobody can find them through the index, even
    # once everything A queued so far has been sent ...
    assert index_client(a).flush()
    assert index.longest_prefix(probe.block_hashes[:6], (0,)).num_blocks == 0
    # (3) ... and once the forward has run and the step is applied, they are published.
    a.scheduler.update_from_output(scheduler_output, a.runner.execute_model(scheduler_output))
    assert index_client(a).flush()
    assert index.longest_prefix(probe.block_hashes[:6], (0,)).num_blocks == 6
    assert serve(c, "req-0", prompt) == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    assert stats(c)["num_index_hits"] == 1
    assert_node_empty(a)  # "warm" (max_tokens=1) finished in the step applied above
    assert_node_empty(c)


# Redis stops answering for _PAUSE_S: long against a step of the tiny model (tens of ms; a few
# hundred on a loaded 2-core host), so a step that waited for its lookup cannot pass for a slow
# one, and shorter than what the waiting lookup allows (index_lookup_timeout_s 8 s, a socket
# timeout of 10 s), so it is answered once the pause ends. Steps are started until
# _PAUSE_MARGIN_S before the end, so the last one has that long to return while still paused.
_PAUSE_S = 2.0
_PAUSE_MARGIN_S = 0.8


def test_a_paused_redis_never_stalls_a_step_and_the_lookup_lands_later(
    nodes, pause_redis, redis_url
):
    # The nodes' Redis clients wait up to 10 s for an answer (a redis-py URL option: it wins
    # over the index's 0.25 s), so a lookup made during the pause is answered when the pause
    # ends instead of falling back on local APC as "unavailable".
    patient_url = f"{redis_url}?socket_timeout=10"
    b = nodes("node-b", index_url=patient_url, index_ttl_s=10.0)
    c = nodes("node-c", index_url=patient_url, index_ttl_s=10.0, index_lookup_timeout_s=8.0)
    prompt = long_prompt(20 * BLOCK_SIZE + 5)
    serve(b, "warm", prompt)
    # (1) C runs a local request (its own lookup answered before the pause; enough tokens to
    # decode through the whole pause) ...
    c.add_request("other", long_prompt(40, salt="other"), SamplingParams(max_tokens=1000))
    while c.scheduler.requests["other"].num_output_tokens == 0:
        c.step()
    # (2) ... Redis stops answering; a request B holds arrives at C.
    ends_at = pause_redis(int(_PAUSE_S * 1000))
    c.add_request("req-0", prompt, SamplingParams(max_tokens=MAX_TOKENS))
    step_s: list[float] = []
    other_tokens = 0
    while time.monotonic() < ends_at - _PAUSE_MARGIN_S:
        started = time.monotonic()
        outputs = c.step()
        step_s.append(time.monotonic() - started)
        other_tokens += sum(len(o.new_token_ids) for o in outputs if o.request_id == "other")
    # No step waited for the pause: the last one (so every one) returned while Redis was still
    # paused, each far shorter than the pause (a step that waited would have lasted until the
    # pause ended: up to _PAUSE_S). Meanwhile the other request kept decoding, and req-0 still
    # waits for its answer.
    left_s = ends_at - time.monotonic()
    assert left_s > 0, f"the steps returned only {-left_s:.2f} s after Redis answered again"
    assert max(step_s) < _PAUSE_S / 2, f"slowest step {max(step_s):.3f} s while Redis was paused"
    assert len(step_s) >= 2 and other_tokens >= 2, (len(step_s), other_tokens)
    assert c.scheduler.requests["req-0"].num_computed_tokens == 0
    # (3) Once Redis answers, the lookup lands on a later step: C pulls B's prefix.
    tokens = run_to_completion(c, "req-0").token_ids
    assert tokens == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
    s = stats(c)
    assert (s["num_index_hits"], s["num_loads"], s["num_failed_loads"]) == (1, 1, 0)
    c.abort_request("other")
    assert_node_empty(c)
    assert_node_empty(b)
