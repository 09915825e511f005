"""The block index on a real three-shard Redis Cluster (issue 14, part 2;
``tests/_redis_cluster_fixture.py``): the backend and three-node connector tests of the single
server run again on the cluster (imported below, with this module's fixtures: the eviction,
restart, outage and dropped-batch resync event tests and the sliding-window hit-rule tests
among them), a lookup stays one script call in one slot, and a stopped shard costs only the
prompts of its slots."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import redis
from _engine_builders import reference_greedy
from _pd_builders import assert_node_empty, long_prompt
from _redis_cluster_fixture import RedisClusterServers
from kvbridge.connector.index import BlockIndex, IndexNamespace, RedisClusterBlockIndex
from kvbridge.connector.index.protocol import events_to_ops
from kvbridge.connector.index.redis_cluster import bucket_of, parse_cluster_url
from kvbridge.kvmanager import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Request,
    SamplingParams,
)
from kvbridge.kvmanager.engine import Engine
from kvbridge.transport import BlockIdentity, LoopbackNetwork

# The single-server tests, run here against the cluster (pytest resolves their fixtures in this
# module: ``index``, ``redis_url``, ``redis_server``, ``hybrid_nodes`` and ``nodes`` below, and
# the imported ``node``, which builds on ``redis_url``). Every event test of
# test_index_events.py and both sliding-window tests of test_index_hit_rule.py run here but the
# in-memory one (test_a_remote_hit_is_counted_once...: a metric, no backend involved).
# Not test_stored_adds_and_removed_removes: it re-stores
# a middle block without its parent hash, which a block pool never does and which on a cluster
# puts the block in its own bucket (a miss there).
from test_block_index import (  # noqa: F401
    check_keys_of_another_type_are_garbage_not_an_outage,
    test_block_stored_without_its_parent_does_not_extend_a_run,
    test_cleared_drops_only_that_nodes_entries,
    test_equal_runs_report_every_holder_for_the_caller_to_break_ties,
    test_every_requested_group_must_be_held,
    test_longest_prefix_prefers_the_deepest_holder,
    test_node_that_stops_heart_beating_expires,
    test_restart_drops_old_entries_and_fences_the_old_incarnation,
    test_unknown_and_empty_prompts_have_no_hit,
)
from test_connector_index import (  # noqa: F401
    BLOCK_SIZE,
    index_client,
    make_node,
    serve,
    stats,
    test_a_node_of_another_block_identity_never_finds_the_blocks,
    test_blocks_are_published_only_after_the_forward_that_computes_them,
    test_request_pulls_the_longest_prefix_then_falls_back_to_local_apc,
    test_salt_and_lora_never_cross_hit_through_the_index,
    test_stale_index_entry_costs_a_recompute_not_wrong_output,
)
from test_index_events import (  # noqa: F401
    node,
    step_until_resynced,
    test_a_batch_dropped_on_a_full_publish_queue_is_repaired_by_a_resync,
    test_a_publish_that_times_out_but_lands_never_resurrects_an_evicted_block,
    test_after_a_redis_outage_the_resync_makes_the_index_say_exactly_what_the_node_holds,
    test_numbered_batches_apply_in_order_replays_are_ignored_gaps_refused,
)
from test_index_hit_rule import (  # noqa: F401
    build_hybrid_nodes,
    test_a_sliding_window_prompt_is_found_through_the_index_as_its_node_restores_it,
    test_when_the_window_blocks_are_gone_the_index_finds_what_the_node_restores,
)
from test_index_lookup_batch import (  # noqa: F401
    test_many_prompts_at_once_are_answered_as_each_alone,
)

NAMESPACE = IndexNamespace(identity=BlockIdentity(
    model_name="test-model", kv_cache_dtype="float32", block_size=16, hash_fn_name="sha256"
))


@pytest.fixture
def index(redis_cluster_url: str) -> Iterator[BlockIndex]:
    backend = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url)
    yield backend
    backend.close()


@pytest.fixture
def redis_url(redis_cluster_url: str) -> str:
    """The imported connector tests ask for ``redis_url``: here it is the cluster's."""
    return redis_cluster_url


class _WholeCluster:
    """The cluster as the imported outage test sees its ``redis_server``: ``stop`` kills every
    shard (SIGKILL, all keys lost), ``start`` brings them all back, empty, and waits for
    ``cluster_state:ok``."""

    def __init__(self, servers: RedisClusterServers) -> None:
        self._servers = servers

    def stop(self) -> None:
        self._servers.stop_all()

    def start(self) -> None:
        self._servers.start_stopped()


@pytest.fixture
def redis_server(redis_cluster: RedisClusterServers) -> _WholeCluster:
    return _WholeCluster(redis_cluster)


@pytest.fixture
def hybrid_nodes(redis_cluster_url: str) -> Iterator[Callable[[str], Engine]]:
    yield from build_hybrid_nodes(redis_cluster_url)


@pytest.fixture
def nodes(redis_cluster_url):
    network = LoopbackNetwork()
    made = []

    def build(engine_id: str, *, index_url: str | None = None, **extra):
        engine = make_node(engine_id, network, index_url or redis_cluster_url, **extra)
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.shutdown()


def test_cluster_urls_are_parsed_and_bad_ones_refused():
    assert parse_cluster_url("redis-cluster://a:1,b:2?buckets=8") == ([("a", 1), ("b", 2)], 8)
    assert parse_cluster_url("redis-cluster://127.0.0.1:7000")[1] == 32
    for bad in ("redis://a:1", "redis-cluster://a", "redis-cluster://a:0", "redis-cluster://:5",
                "redis-cluster://a:1?buckets=0"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def test_a_lookup_touches_one_slot_and_prompts_spread_over_the_shards(redis_cluster_url):
    index = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url)
    client = index._client
    # (1) Every bucket prefix is its own hash tag: keys built on it share the prefix's slot.
    prefix = index.bucket_prefixes[5]
    slot = client.keyslot(prefix)
    assert client.keyslot(prefix + ":e:0:" + "\x00\xff{x}") == slot
    assert client.keyslot(prefix + ":node:node-a") == slot
    # (2) The buckets' slots land on all three shards.
    shards = {
        client.nodes_manager.get_node_from_slot(client.keyslot(p)).name
        for p in index.bucket_prefixes
    }
    assert len(shards) == 3
    # (3) A lookup of a chain stored by one node: one script call answers it whole.
    assert index.register_node("node-a", 1, ttl_s=10.0) == "ok"
    hashes = [bytes([i]) * 32 for i in range(1, 41)]
    from test_block_index import _stored

    assert index.publish("node-a", 1, [_stored(hashes)]).status == "ok"
    owner = index.shard_of_prompt(hashes[0][:8])

    def scripts_run_per_shard() -> dict[str, dict[str, int]]:
        """EVALSHA and EVAL calls each shard ran since the last call (script reads not shown:
        the server counts them as commands of their own)."""
        out = {
            shard: {name[len("cmdstat_"):]: stats[name]["calls"]
                    for name in ("cmdstat_evalsha", "cmdstat_eval") if name in stats}
            for shard, stats in client.info("commandstats", target_nodes=client.PRIMARIES).items()
        }
        client.config_resetstat(target_nodes=client.PRIMARIES)
        return out

    client.execute_command("SCRIPT", "FLUSH", target_nodes=client.PRIMARIES)
    scripts_run_per_shard()
    # The first lookup on a shard that knows no script: EVALSHA, NOSCRIPT, then EVAL.
    assert index.longest_prefix(hashes).num_blocks == 40
    expected = {shard: {} for shard in shards}
    assert scripts_run_per_shard() == {**expected, owner: {"evalsha": 1, "eval": 1}}
    # (4) The next: one EVALSHA on the shard that owns the prompt's bucket, nothing elsewhere.
    assert index.longest_prefix(hashes).num_blocks == 40
    assert scripts_run_per_shard() == {**expected, owner: {"evalsha": 1}}
    index.close()


def test_a_lookup_follows_its_bucket_to_the_shard_its_slot_moved_to(redis_cluster,
                                                                     redis_cluster_url):
    """A lookup goes straight to the shard that owns its bucket by the client's slot map; when
    the slot has moved, the MOVED reply sends it the generic way (redis-py follows it and
    updates the map), and the next lookup goes straight to the new owner."""
    index = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url)
    client = index._client
    from test_block_index import _stored

    hashes = [bytes([i]) * 32 for i in range(1, 41)]
    assert index.register_node("node-a", 1, ttl_s=10.0) == "ok"
    assert index.publish("node-a", 1, [_stored(hashes)]).status == "ok"
    assert index.longest_prefix(hashes).num_blocks == 40
    slot = client.keyslot(index.bucket_prefixes[bucket_of(hashes[0][:8], index.num_buckets)])
    old_owner = redis_cluster.owner_of(slot)
    new_owner = (old_owner + 1) % 3
    new_owner_name = f"127.0.0.1:{redis_cluster.ports[new_owner]}"
    redis_cluster.move_slot(slot, new_owner)
    try:
        # (1) The map still names the old owner: MOVED, then the generic path finds the entries
        # on the new owner (the keys moved with the slot). No Redis trouble.
        assert index.shard_of_prompt(hashes[0][:8]) != new_owner_name
        hit = index.longest_prefix(hashes)
        assert (hit.num_blocks, hit.holders[0].node_id) == (40, "node-a")
        assert index.stats.errors_by_kind == {} and index.available
        # (2) The map was updated: the next lookup is one EVALSHA, on the new owner only.
        assert index.shard_of_prompt(hashes[0][:8]) == new_owner_name
        client.config_resetstat(target_nodes=client.PRIMARIES)
        assert index.longest_prefix(hashes).num_blocks == 40
        evalsha = {
            shard: stats.get("cmdstat_evalsha", {}).get("calls", 0)
            for shard, stats in client.info("commandstats", target_nodes=client.PRIMARIES).items()
        }
        assert evalsha == {shard: int(shard == new_owner_name) for shard in evalsha}
        assert index.get_block_ids("node-a", 1, hashes) == [list(range(1, 41))]
    finally:
        redis_cluster.move_slot(slot, old_owner)
        index.close()


def hashes_of(engine, prompt: list[int]) -> list[bytes]:
    probe = Request(
        "probe", prompt, SamplingParams(max_tokens=1),
        block_hasher=engine.kv_cache_manager.request_block_hasher,
    )
    return list(probe.block_hashes)


def _prompt_on(index: RedisClusterBlockIndex, engine, shard: str, *, other: bool, salt: str):
    """A prompt whose bucket is (or, with ``other``, is not) on shard ``shard``."""
    client = index._client
    for attempt in range(200):
        prompt = long_prompt(8 * BLOCK_SIZE + 3, salt=f"{salt} {attempt}. ")
        probe = Request(
            "probe", prompt, SamplingParams(max_tokens=1),
            block_hasher=engine.kv_cache_manager.request_block_hasher,
        )
        key = probe.block_hashes[0][: index.namespace.key_hash_bytes]
        prefix = index.bucket_prefixes[bucket_of(key, index.num_buckets)]
        name = client.nodes_manager.get_node_from_slot(client.keyslot(prefix)).name
        if (name == shard) != other:
            return prompt
    raise AssertionError("no prompt found for that shard")


@pytest.mark.parametrize("b_serves", ["before", "during"])
def test_a_stopped_shard_costs_only_its_slots_prompts(nodes, redis_cluster, b_serves):
    """B computes a prompt of the stopped shard's slots and one of a live shard's, before the
    shard stops or while it is down. ``during``: B's part for the dead shard's bucket is
    parked and the other lands at once, so C still pulls the live prompt; before, B's
    publishes all waited on the dead bucket, then stopped until a resync once the shard was
    back: nothing B computed during the outage was listed (and ``serve``'s flush timed out)."""
    # C's lookups may wait behind heartbeats that meet the dead shard (each failed call makes
    # redis-py re-read the cluster's topology): a lookup deadline that a loaded host keeps.
    b, c = nodes("node-b"), nodes("node-c", index_lookup_timeout_s=5.0)
    index = index_client(c).index
    down = f"127.0.0.1:{redis_cluster.ports[2]}"
    on_down = _prompt_on(index, b, down, other=False, salt="Down")
    on_live = _prompt_on(index, b, down, other=True, salt="Live")
    for when in ("before", "during"):
        if when == b_serves:
            serve(b, "warm-down", on_down)
            serve(b, "warm-live", on_live)
            assert index.longest_prefix(hashes_of(b, on_live)[:8]).num_blocks == 8
        if when == "before":  # (1) Shard 2 dies.
            redis_cluster.stop(2)
    # C asks for a prompt of the dead shard's slots: the lookup fails (counted) and C computes
    # it with local APC; the answer is still right.
    failed_before = index.stats.lookups_failed
    assert serve(c, "req-down", on_down) == reference_greedy(on_down, 3, hybrid=False)
    assert stats(c)["num_index_hits"] == 0
    assert index.stats.lookups_failed > failed_before
    # (2) A prompt of a live shard's slots still hits: C pulls it from B.
    assert serve(c, "req-live", on_live) == reference_greedy(on_live, 3, hybrid=False)
    s = stats(c)
    assert (s["num_index_hits"], s["num_loads"], s["num_failed_loads"]) == (1, 1, 0), (
        index.stats)
    assert s["remote_hit_tokens"] == 8 * BLOCK_SIZE
    # (3) The shard comes back empty: B resyncs its whole cached set, the prompt hits again.
    redis_cluster.start(2)
    step_until_resynced(b, min_resyncs=1, timeout_s=15.0)
    c.kv_cache_manager.reset_prefix_cache()  # C forgets its own copy: only B has it now
    time.sleep(1.1)  # C's back-off of the shard's buckets runs out
    assert serve(c, "req-down-2", on_down) == reference_greedy(on_down, 3, hybrid=False)
    assert stats(c)["num_index_hits"] == 2
    assert_node_empty(b)
    assert_node_empty(c)


def test_a_node_started_while_a_shard_is_down_is_listed_on_the_live_shards(nodes, redis_cluster):
    """One shard down when a node starts: its registration is answered by the live buckets, so
    it publishes there at once (before, it counted as unanswered until every shard answered,
    and the node was listed nowhere meanwhile). Once the shard is back, the node's next
    heartbeat registers it in that shard's buckets (before, that heartbeat was fenced, and the
    node registered everywhere and resynced its whole set), and its prompt of that shard hits
    too."""
    c = nodes("node-c", index_lookup_timeout_s=5.0)
    index = index_client(c).index
    down = f"127.0.0.1:{redis_cluster.ports[2]}"
    on_down = _prompt_on(index, c, down, other=False, salt="Down")
    on_live = _prompt_on(index, c, down, other=True, salt="Live")
    redis_cluster.stop(2)
    b = nodes("node-b")
    # (1) B serves a prompt of a live shard's slots: it is listed, and C pulls it from B.
    serve(b, "warm-live", on_live)
    assert serve(c, "req-live", on_live) == reference_greedy(on_live, 3, hybrid=False)
    s = stats(c)
    assert (s["num_index_hits"], s["num_loads"], s["num_failed_loads"]) == (1, 1, 0), (
        index.stats)
    # (2) The shard comes back, empty: B's heartbeat registers it there, with no resync. B
    # serves a prompt of that shard's slots, and C pulls it too.
    redis_cluster.start(2)
    deadline = time.monotonic() + 15.0
    while index_client(b).index._seqs["node-b"].unregistered:
        assert time.monotonic() < deadline, "B never registered in the revived shard's buckets"
        time.sleep(0.05)
    assert index_client(b).num_resyncs == 0
    serve(b, "warm-down", on_down)
    time.sleep(1.1)  # C's back-off of the shard's buckets runs out
    assert serve(c, "req-down", on_down) == reference_greedy(on_down, 3, hybrid=False)
    assert stats(c)["num_index_hits"] == 2
    assert_node_empty(b)
    assert_node_empty(c)


def test_cluster_servers_refuse_a_cross_slot_script(redis_cluster_url):
    """The layout matters: a script that touched two buckets' keys would be refused (by
    redis-py before it is sent, or by the server)."""
    index = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url)
    client = index._client
    a, b = index.bucket_prefixes[0], index.bucket_prefixes[1]
    if client.keyslot(a) == client.keyslot(b):
        pytest.fail("two buckets share a slot")
    with pytest.raises((redis.ResponseError, redis.exceptions.RedisClusterException)):
        client.eval("return redis.call('GET', KEYS[2])", 2, a + ":x", b + ":x")
    index.close()


def test_open_index_the_proxy_and_pd_pair_take_a_cluster_url(redis_cluster_url):

    from kvbridge.connector.index import block_index_for_url, open_index
    from kvbridge.connector.index.node_directory import NodeAddress
    from kvbridge.connector.index.redis_cluster_directory import RedisClusterNodeDirectory

    index, directory = open_index(redis_cluster_url, NAMESPACE)
    assert isinstance(index, RedisClusterBlockIndex)
    assert isinstance(directory, RedisClusterNodeDirectory)
    directory.announce("node-x", NodeAddress("10.0.0.9", 5555, 7), ttl_s=5.0)
    assert directory.lookup("node-x") == NodeAddress("10.0.0.9", 5555, 7)
    directory.withdraw("node-x")
    assert directory.lookup("node-x") is None
    tool = block_index_for_url(redis_cluster_url, NAMESPACE)
    assert isinstance(tool, RedisClusterBlockIndex)
    tool.close()
    with pytest.raises(ValueError, match="HOST:PORT"):
        open_index("redis-cluster://no-port", NAMESPACE)
    from kvbridge.connector.serve.demo import pd_pair
    pd_pair.check_redis(redis_cluster_url)  # the cluster answers PING: no UsageError
    index.close()


def test_replay_trace_runs_on_the_cluster_and_names_the_namespaces_it_wrote(
    redis_cluster_url, tmp_path
):
    import json

    from kvbridge.connector.serve.replay import trace as replay_trace
    # Six conversations of three turns; each turn extends its conversation's prefix.
    trace = tmp_path / "trace.jsonl"
    lines = []
    for turn in range(3):
        for conv in range(6):
            hash_ids = [1000 * conv + k for k in range(2 + 2 * turn)]
            lines.append({"timestamp": 1000 * (6 * turn + conv),
                          "input_length": 512 * len(hash_ids), "output_length": 4,
                          "hash_ids": hash_ids})
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = replay_trace.main([str(trace), "--index-url", redis_cluster_url,
                                 "--policies", "index,pull", "--nodes", "2"])
    assert summary["index_url"] == "redis-cluster"
    assert summary["pull"]["hit_ratio"] > 0 and summary["index"]["hit_ratio"] > 0
    # The index-routing policy's entries are where the summary says (the cluster benchmark
    # counts them there).
    index = RedisClusterBlockIndex(
        IndexNamespace(identity=BlockIdentity(**summary["index_namespaces"]["index"])),
        redis_cluster_url,
    )
    try:
        assert sum(index.keys_per_shard().values()) > 0
    finally:
        index.close()


def _stored_chain(chain: list[bytes]) -> BlockStored:
    return BlockStored(block_hashes=chain, parent_block_hash=None, token_ids=[], block_size=16,
                       lora_name=None, medium=None, group_id=0, block_ids=[1, 2])


def _chains_with_two_in_one_bucket(index: RedisClusterBlockIndex) -> list[list[bytes]]:
    """Two-block chains, the first and the last in one bucket, the rest in others."""
    k = index.namespace.key_hash_bytes

    def bucket(chain: list[bytes]) -> int:
        return bucket_of(chain[0][:k], index.num_buckets)

    made = [[hashlib.sha256(f"{p}/{i}".encode()).digest() for i in range(2)] for p in range(400)]
    first, rest = made[0], made[1:]
    others = [chain for chain in rest if bucket(chain) != bucket(first)][:7]
    last = next(chain for chain in rest if bucket(chain) == bucket(first))
    return [first, *others, last]


@pytest.mark.parametrize("ran", [False, True], ids=["part-never-ran", "part-ran-late"])
def test_a_part_one_bucket_leaves_unanswered_waits_alone_and_lands_in_order(
    redis_cluster_url, ran
):
    """One bucket leaves its part of a publish unanswered (a timeout: its shard may have run
    it or not). The other buckets apply theirs at once; the part is parked, with its number,
    and the node's next part for that bucket queues behind it; the node's worker sends both
    again, in order (``send_parked``): a part that ran answers "replayed", and the bucket
    sees no gap. (Before, the whole publish answered "unavailable" and the node held every
    later batch behind it, for every bucket; past 3 s it stopped publishing until a resync
    once every bucket answered.)"""
    index = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url, retry_interval_s=0.0)
    k = NAMESPACE.key_hash_bytes
    chains = _chains_with_two_in_one_bucket(index)
    dropped = index.bucket_prefixes[bucket_of(chains[0][0][:k], index.num_buckets)]
    real, tries = index._publish_at, []

    def publish_at(prefix, *args):
        if prefix == dropped and len(tries) < 2:  # its first two tries go unanswered
            tries.append(real(prefix, *args) if ran and not tries else None)
            return None
        return real(prefix, *args)

    try:
        assert index.register_node("n", 1, ttl_s=30.0) == "ok"
        with mock.patch.object(index, "_publish_at", publish_at):
            first = [_stored_chain(chain) for chain in chains[:8]]
            assert index.publish("n", 1, first, seq=(1, 1)).status == "ok"
            for chain in chains[1:8]:  # the live buckets' chains: listed at once
                assert index.longest_prefix(chain).num_blocks == 2
            assert index.longest_prefix(chains[0]).num_blocks == (2 if ran else 0)
            # (the parked part is tried first, unanswered again: the new one queues behind it)
            assert index.publish("n", 1, [_stored_chain(chains[8])], seq=(2, 2)).status == "ok"
            assert index.longest_prefix(chains[8]).num_blocks == 0
        assert tries == [1 if ran else None, None]
        assert index.parked_parts("n") == (2, 0, 1)  # its oldest: two calls (flush waits no more)
        assert index.send_parked("n", 1) == "ok"  # both, oldest first (the node's worker)
        assert index.parked_parts("n") == (0, 0, 0)
        assert index.stats.publishes_gap == 0 and index.stats.publishes_fenced == 0
        for chain in chains:
            assert index.longest_prefix(chain).num_blocks == 2
        assert index.publish("n", 1, [_stored_chain(chains[0])], seq=(3, 3)).status == "ok"
    finally:
        index.close()


def test_an_unnumbered_publish_is_never_parked(redis_cluster_url):
    """A node without a resync source numbers no batch: a part a bucket leaves unanswered is
    dropped and counted (the call answers "unavailable"), never sent again (its first try may
    still run late, and without numbers a second try could apply twice or out of order). The
    other buckets apply theirs."""
    index = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url, retry_interval_s=0.0)
    k = NAMESPACE.key_hash_bytes
    chains = _chains_with_two_in_one_bucket(index)
    dropped = index.bucket_prefixes[bucket_of(chains[0][0][:k], index.num_buckets)]
    real = index._publish_at
    try:
        assert index.register_node("n", 1, ttl_s=30.0) == "ok"
        with mock.patch.object(index, "_publish_at",
                               lambda prefix, *a: None if prefix == dropped else real(prefix, *a)):
            events = [_stored_chain(chains[0]), _stored_chain(chains[1])]
            assert index.publish("n", 1, events).status == "unavailable"
        assert index.parked_parts("n") == (0, 0, 0)
        assert index.send_parked("n", 1) == "ok"
        assert [index.longest_prefix(c).num_blocks for c in chains[:2]] == [0, 2]
    finally:
        index.close()


def test_parked_parts_past_the_limit_lose_their_bucket_until_it_answers(redis_cluster_url):
    """A bucket down for long: its parked parts are bounded (``MAX_PARKED_OPS``). Past it they
    are dropped, counted, and the bucket is lost: its later parts are dropped as they come,
    while the other buckets take theirs and the heartbeat still says "ok" (some bucket
    answered). Once the lost bucket answers, the heartbeat says "fenced": the node registers
    again and resyncs, which clears it. (Before, one dead shard's bucket made every publish and
    heartbeat "unavailable", and the node stopped publishing anywhere until every shard was
    back.)"""
    index = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url, retry_interval_s=0.0)
    k = NAMESPACE.key_hash_bytes
    chains = _chains_with_two_in_one_bucket(index)
    dropped = index.bucket_prefixes[bucket_of(chains[0][0][:k], index.num_buckets)]
    real_publish, real_call = index._publish_at, index._call

    def publish_at(prefix, *args):
        return None if prefix == dropped else real_publish(prefix, *args)

    def call(what, script, prefix, *args, **kwargs):
        return None if prefix == dropped else real_call(what, script, prefix, *args, **kwargs)

    try:
        assert index.register_node("n", 1, ttl_s=30.0) == "ok"
        with mock.patch.object(index, "_publish_at", publish_at), \
                mock.patch.object(index, "_call", call), \
                mock.patch("kvbridge.connector.index.redis_cluster.MAX_PARKED_OPS", 3):
            assert index.publish("n", 1, [_stored_chain(chains[0])], seq=(1, 1)).status == "ok"
            assert index.parked_parts("n") == (1, 1, 1)  # one call so far
            dropped_before = index.stats.publish_ops_dropped
            assert index.publish("n", 1, [_stored_chain(chains[8])], seq=(2, 2)).status == "ok"
            assert index.parked_parts("n") == (0, 0, 0)  # 4 ops: over the limit, the bucket lost
            assert index.stats.publish_ops_dropped == dropped_before + 4
            events = [_stored_chain(chains[1]), _stored_chain(chains[0])]  # live, lost
            assert index.publish("n", 1, events, seq=(3, 3)).status == "ok"
            assert index.stats.publish_ops_dropped == dropped_before + 6
            assert index.parked_parts("n") == (0, 0, 0)
            assert index.longest_prefix(chains[1]).num_blocks == 2
            assert index.heartbeat("n", 1, ttl_s=30.0) == "ok"
        assert index.heartbeat("n", 1, ttl_s=30.0) == "fenced"  # the lost bucket answers
        assert index.register_node("n", 1, ttl_s=30.0) == "ok"
        resync = [AllBlocksCleared(medium=None), *(_stored_chain(c) for c in chains[:2])]
        assert index.publish("n", 1, resync, seq=(4, 4), resync=True).status == "ok"
        assert index.heartbeat("n", 1, ttl_s=30.0) == "ok"
        for chain in chains[:2]:
            assert index.longest_prefix(chain).num_blocks == 2
        assert index.longest_prefix(chains[8]).num_blocks == 0
    finally:
        index.close()


def test_keys_of_another_type_in_a_bucket_are_garbage_not_an_outage(redis_cluster_url):
    index = RedisClusterBlockIndex(NAMESPACE, redis_cluster_url)
    try:
        check_keys_of_another_type_are_garbage_not_an_outage(index, index.client)
    finally:
        index.close()


def test_a_repeated_store_or_remove_leaves_the_chain_roots_exact():
    # A store node's resync may be followed by the events of a put it already covered: the
    # same "stored" twice. The chain roots publishing keeps (which bucket a block goes to)
    # count holders per KV cache group, so the block's "removed" still forgets its root.
    index = RedisClusterBlockIndex(NAMESPACE, "redis-cluster://127.0.0.1:1",
                                   client=mock.MagicMock())
    k = NAMESPACE.key_hash_bytes
    block0, block1 = bytes([1]) * 32, bytes([2]) * 32

    def ops(*events):
        return events_to_ops(events, "store")

    def stored(h: bytes, parent: bytes | None, group_id: int = 0) -> BlockStored:
        return BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=[],
                           block_size=16, lora_name=None, medium=None, group_id=group_id,
                           block_ids=[1])

    root_bucket = bucket_of(block0[:k], index.num_buckets)
    for _ in range(2):
        assert list(index._split("s", ops(stored(block0, None), stored(block1, block0)),
                                 False)) == [root_bucket]
    index._split("s", ops(stored(block1, block0, group_id=1)), False)
    removed = [BlockRemoved(block_hashes=[h], medium=None, group_id=0, block_ids=[1])
               for h in (block1, block0)]
    index._split("s", ops(*removed), False)
    assert index._roots["s"] == {block1[:k]: (block0[:k], {1})}  # group 1 still holds it
