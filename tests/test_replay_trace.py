"""kvbridge-replay on a generated tiny Mooncake-format trace (issue 6, trace replay)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvbridge.connector.serve.replay import trace as replay


def _write_trace(
    path: Path, *, num_conversations: int, num_turns: int, turn_gap_s: float,
    output_length: int,
) -> Path:
    """Conversation c, turn t: ids ``[1000 c, ..., 1000 c + 2 (t + 1) - 1]`` (each turn repeats
    the previous turn's blocks and adds two), ``input_length`` a whole number of 512-token
    blocks. Turn t of every conversation arrives at ``t * turn_gap_s + c`` seconds."""
    lines = []
    for turn in range(num_turns):
        for conv in range(num_conversations):
            num_ids = 2 * (turn + 1)
            lines.append(json.dumps({
                "timestamp": int((turn * turn_gap_s + conv) * 1000),
                "input_length": 512 * num_ids,
                "output_length": output_length,
                "hash_ids": [1000 * conv + j for j in range(num_ids)],
            }))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("index_kind", ["memory", "redis"])
def test_index_routing_keeps_conversations_on_their_node(
    tmp_path: Path, index_kind: str, request: pytest.FixtureRequest
) -> None:
    # 3 conversations x 3 turns; a turn decodes for 1000 x 0.02 s = 20 s, the next turn comes
    # 30 s later, so a node is busy with at most one request of each round.
    trace = _write_trace(tmp_path / "tiny.jsonl", num_conversations=3, num_turns=3,
                         turn_gap_s=30.0, output_length=1000)
    index_url = "memory" if index_kind == "memory" else request.getfixturevalue("redis_url")
    summary = replay.main([str(trace), "--blocks-per-node", "64", "--index-url", index_url])
    # Unbounded cache: turns hit 0, 2 and 4 of their 2, 4, 6 blocks (capped at 6 - 1 = 5):
    # 3 x (0 + 2 + 4) / 3 x (2 + 4 + 6) = 18 / 36.
    assert summary["unbounded_hit_ratio"] == 0.5
    # Index: turn 0 spreads by load to nodes 0, 1, 2; later turns follow their prefix there,
    # so every possible hit is a hit.
    assert summary["index"]["hit_ratio"] == 0.5
    assert summary["index"]["fraction_of_unbounded"] == 1.0
    assert summary["index"]["requests_per_node"] == [3, 3, 3, 0]
    # Round robin sends request i to node i mod 4; with 3 conversations no turn meets its
    # previous turn's node (c0: 0, 3, 2; c1: 1, 0, 3; c2: 2, 1, 0), so nothing hits.
    assert summary["round_robin"]["hit_ratio"] == 0.0
    assert summary["round_robin"]["requests_per_node"] == [3, 2, 2, 2]
    assert summary["index"]["num_dropped"] == summary["round_robin"]["num_dropped"] == 0


def test_small_pools_evict_oldest_first(tmp_path: Path) -> None:
    # Requests finish in 10 x 0.02 s, long before the next arrives, so every node is idle and
    # index routing sends all nine requests to node 0 (no prefix elsewhere; ties go to node 0).
    trace = _write_trace(tmp_path / "tiny.jsonl", num_conversations=3, num_turns=3,
                         turn_gap_s=30.0, output_length=10)
    summary = replay.main([str(trace), "--blocks-per-node", "6"])
    assert summary["index"]["requests_per_node"] == [9, 0, 0, 0]
    # Node 0's 6 blocks after turn 0: free queue [A1 A0 B1 B0 C1 C0] (each request frees in
    # reverse). c0 turn 1 hits A0 A1 and evicts B1 B0 for 2 new blocks: 2 hits. From then on
    # every request needs more blocks than the others left it: c1 turn 1 evicts C and A2 A3, and
    # so on; no other hit. 2 / 36 prompt blocks.
    assert summary["index"]["hit_ratio"] == round(2 / 36, 4)
    assert summary["round_robin"]["hit_ratio"] == 0.0


def test_prompt_expansion_is_deterministic_and_shares_prefixes() -> None:
    expander = replay.TokenExpander(block_size=16)
    first = replay.TraceRequest(0.0, 1000, 1, (7, 8))
    second = replay.TraceRequest(0.0, 1500, 1, (7, 8, 9))
    # 1000 tokens at 512 -> 16: ceil(31.25) = 32 tokens; 1500: ceil(46.875) = 47 tokens.
    assert len(expander.prompt(first)) == 32
    assert len(expander.prompt(second)) == 47
    assert expander.prompt(second)[:32] == expander.prompt(first)
    assert replay.TokenExpander(block_size=16).prompt(first) == expander.prompt(first)


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                    '{"timestamp": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        replay.read_trace(path)


def _write_records(path: Path, records: list[tuple[float, int, list[int]]]) -> Path:
    """(arrival s, output_length, hash_ids) per request; ``input_length`` whole 512-token
    blocks."""
    path.write_text("".join(
        json.dumps({"timestamp": int(t * 1000), "input_length": 512 * len(ids),
                    "output_length": out, "hash_ids": ids}) + "\n"
        for t, out, ids in records
    ))
    return path


def test_pull_takes_the_prefix_from_its_holder_and_caches_it_on_the_puller(
    tmp_path: Path,
) -> None:
    # (1) t=0: A0 = [0, 1] runs on node 0 (all idle; ties go to node 0) for 1000 x 0.02 = 20 s.
    # (2) t=30: F = [900, 901], unrelated, takes node 0 (idle again) until t=50.
    # (3) t=31: A1 = [0, 1, 2, 3] goes to the least-loaded node, node 1, whose own cache has
    #     nothing; the index names node 0 with blocks 0..1, so node 1 pulls 2 blocks.
    trace = _write_records(tmp_path / "pull.jsonl", [
        (0.0, 1000, [0, 1]), (30.0, 1000, [900, 901]), (31.0, 1000, [0, 1, 2, 3]),
    ])
    args = replay.parse_args([str(trace), "--blocks-per-node", "64", "--policies", "pull"])
    requests = replay.read_trace(trace)
    expander = replay.TokenExpander(args.block_size)
    args.max_model_len = 65
    index = replay.InMemoryBlockIndex(replay.IndexNamespace(identity=replay.BlockIdentity(
        model_name="replay", kv_cache_dtype="float16", block_size=args.block_size,
        hash_fn_name=args.hash_fn,
    )))
    run = replay.Replay(args, index, "pull")
    result = run.run(requests, expander)
    assert result.requests_per_node == [2, 1, 0, 0]
    assert (result.num_pulls, result.num_pulled_blocks) == (1, 2)
    assert result.pulls_per_holder == [1, 0, 0, 0]
    assert result.num_stale_hits == 0
    # Hits: A1's 2 pulled blocks of 2 + 2 + 4 prompt blocks; the unbounded cache has the same.
    assert (result.hit_blocks, result.total_blocks) == (2, 8)
    # The pulled blocks (and A1's own) are cached on node 1 after it finished, and published:
    # the index now names node 1 with all 4 blocks and node 0 with the 2 it had.
    a1 = replay.Request("probe", expander.prompt(requests[2]), block_hasher=run.hasher)
    pool = run.nodes[1].manager.block_pool
    assert len(pool.get_cached_prefix(a1.block_hashes, (0,), 4)[0]) == 4
    hit = index.longest_prefix(a1.block_hashes, all_holders=True)
    assert [(h.node_id, h.num_blocks) for h in hit.holders] == [
        ("pull-node1", 4), ("pull-node0", 2),
    ]
    index.close()


def test_pull_reports_its_counts_next_to_index_routing(tmp_path: Path) -> None:
    trace = _write_records(tmp_path / "pull.jsonl", [
        (0.0, 1000, [0, 1]), (30.0, 1000, [900, 901]), (31.0, 1000, [0, 1, 2, 3]),
    ])
    summary = replay.main([str(trace), "--blocks-per-node", "64"])
    assert summary["unbounded_hit_ratio"] == 0.25  # 2 of 8 prompt blocks
    # Index routing sends A1 to node 0 (2 blocks there beat the idle node 1 by 2): the same 2
    # hits without a pull; round robin sends A1 to node 2: nothing.
    assert summary["index"]["hit_ratio"] == summary["pull"]["hit_ratio"] == 0.25
    assert summary["round_robin"]["hit_ratio"] == 0.0
    pull = summary["pull"]
    assert pull["fraction_of_unbounded"] == 1.0
    assert pull["pulled_blocks_per_request"] == round(2 / 3, 3)
    assert pull["pulls_per_holder"] == [1, 0, 0, 0]
    # One lookup per request: routing asks for the deepest run (A0 and F look up 1 of their 2
    # blocks, A1 3 of its 4: the last block is never looked up), and admission, right after
    # routing, takes the holder to pull from out of that same answer.
    assert pull["lookups_per_request"] == 1.0
    assert pull["num_relookups"] == 0


def _pull_replay(
    trace: Path, *flags: str
) -> tuple[object, replay.InMemoryBlockIndex, list[replay.TraceRequest]]:
    """A ``pull`` replay of ``trace`` on a memory index, run; (its Replay, the index, the
    requests). The index's own ``stats.lookups`` counts every ``longest_prefix`` call."""
    args = replay.parse_args([str(trace), "--policies", "pull", *flags])
    requests = replay.read_trace(trace)
    expander = replay.TokenExpander(args.block_size)
    args.max_model_len = max(expander.num_tokens(r) for r in requests) + 1
    index = replay.InMemoryBlockIndex(replay.IndexNamespace(identity=replay.BlockIdentity(
        model_name="replay", kv_cache_dtype="float16", block_size=args.block_size,
        hash_fn_name=args.hash_fn,
    )))
    run = replay.Replay(args, index, "pull")
    run.run(requests, expander)
    return run, index, requests


def test_pull_admitted_at_arrival_reuses_the_routing_lookup(tmp_path: Path) -> None:
    # The pull trace above, plus a one-block prompt G (t=60; nothing to look up: its only block
    # is recomputed for its logits). A0, F and A1 are admitted the moment they arrive, so the
    # routing lookup is the admission's too: 3 lookups for 4 requests. An admission that asked
    # again would make A0, F and A1 (each missing a block locally) look up twice: 6.
    trace = _write_records(tmp_path / "pull.jsonl", [
        (0.0, 1000, [0, 1]), (30.0, 1000, [900, 901]), (31.0, 1000, [0, 1, 2, 3]),
        (60.0, 10, [700]),
    ])
    run, index, _ = _pull_replay(trace, "--blocks-per-node", "64")
    result = run.result
    assert index.stats.lookups == result.num_lookups == 3
    assert result.num_relookups == 0
    # The reused answer still names node 0 as A1's holder: the same pull as before.
    assert (result.num_pulls, result.num_pulled_blocks) == (1, 2)
    assert result.pulls_per_holder == [1, 0, 0, 0]
    index.close()


def test_pull_looks_up_again_for_a_request_that_waited(tmp_path: Path) -> None:
    # 2 nodes x 4 blocks; X, Y and A decode for 1000 x 0.02 = 20 s, each holding 2 blocks.
    # (1) t=0: X = [900, 901] on node 0; t=0.5: Y = [800, 801] on node 1 (least loaded).
    # (2) t=1: B = [0, 1, 2, 3] ties on load; nothing holds its prefix (the routing answer:
    #     no hit), so node 0 by order, where only 2 of its 4 blocks are free: B waits.
    # (3) t=2: A = [0, 1] goes to node 1 (load 1 against node 0's 2) and is cached there.
    # (4) t=20: X ends, B is admitted on node 0: its routing answer is stale, so it asks again
    #     and pulls A's 2 blocks from node 1. Reusing the stale answer would pull nothing.
    trace = _write_records(tmp_path / "wait.jsonl", [
        (0.0, 1000, [900, 901]), (0.5, 1000, [800, 801]), (1.0, 10, [0, 1, 2, 3]),
        (2.0, 1000, [0, 1]),
    ])
    run, index, _ = _pull_replay(trace, "--nodes", "2", "--blocks-per-node", "4")
    result = run.result
    assert result.requests_per_node == [2, 2]
    # One routing lookup per request plus B's re-lookup.
    assert index.stats.lookups == result.num_lookups == 4 + 1
    assert result.num_relookups == 1
    assert (result.num_pulls, result.num_pulled_blocks) == (1, 2)
    assert result.pulls_per_holder == [0, 1]
    assert result.num_stale_hits == 0
    index.close()


def test_pull_breaks_load_ties_by_the_longest_local_prefix(tmp_path: Path) -> None:
    # (1) t=0: X = [900, 901] takes node 0 (all idle; no prefix anywhere; node order) for
    #     1000 x 0.02 = 20 s.
    # (2) t=1: A0 = [0, 1] goes to node 1 (nodes 1-3 idle, none holds a prefix), done at 1.2 s.
    # (3) t=30: A1 = [0, 1, 2, 3] finds all four nodes idle; node 1 holds its first 2 blocks, so
    #     it goes there and hits them locally: no pull, no second copy. (Node order alone would
    #     send it to node 0, which would pull the same 2 blocks from node 1.)
    trace = _write_records(tmp_path / "tie.jsonl", [
        (0.0, 1000, [900, 901]), (1.0, 10, [0, 1]), (30.0, 1000, [0, 1, 2, 3]),
    ])
    summary = replay.main([str(trace), "--blocks-per-node", "64", "--policies", "pull"])
    pull = summary["pull"]
    assert pull["requests_per_node"] == [1, 2, 0, 0]
    assert (pull["num_pulls"], pull["num_pulled_blocks"]) == (0, 0)
    # A1's 2 local hits of 2 + 2 + 4 prompt blocks: everything the unbounded cache has.
    assert pull["hit_ratio"] == summary["unbounded_hit_ratio"] == 0.25


_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


@pytest.mark.skipif(
    not _TRACE.is_file(),
    reason="the Mooncake conversation trace is not shipped with kvbridge; it is read from "
    "shared/traces/ beside the repository (there on CI and the developers' machines)",
)
def test_pull_on_a_slice_of_the_conversation_trace() -> None:
    # 300 requests; pools large enough that nothing is evicted: every prefix seen before is
    # held by some node, so pulling from whichever holds it reaches the unbounded cache exactly,
    # while index routing loses the prefixes it left for load.
    summary = replay.main([str(_TRACE), "--limit", "300", "--blocks-per-node", "16384",
                           "--policies", "index,pull"])
    assert summary["pull"]["hit_ratio"] >= summary["index"]["hit_ratio"]
    assert summary["pull"]["fraction_of_unbounded"] == 1.0
    assert summary["pull"]["num_pulled_blocks"] > 0
    assert summary["pull"]["num_stale_hits"] == 0
    # Nothing waits in pools this large: one lookup a request at most (none for a one-block
    # prompt), each both the routing's and the admission's.
    assert summary["pull"]["num_relookups"] == 0
    assert summary["pull"]["lookups_per_request"] <= 1.0
    assert sum(summary["pull"]["pulls_per_holder"]) == summary["pull"]["num_pulls"]


# A conversation whose second turn finds its node's pool reused by an unrelated request:
# 1 node x 4 blocks. (1) t=0: A0 = [0, 1] runs and frees its 2 blocks (free queue: the 2 never
# used, then A0's tail, then its head). (2) t=10: F = [900, 901, 902, 903] takes all 4 blocks,
# evicting A0's 2: the node writes them to the store (tail first, so the store publishes them
# once A0's first block, the chain's anchor, arrives). (3) t=20: A1 = [0, 1, 2, 3] has no local
# hit; the index names the store with A0's 2 blocks, so A1 pulls them from there, and its 4
# blocks evict F's, which the node writes to the store too.
_STORE_RECORDS = [(0.0, 10, [0, 1]), (10.0, 10, [900, 901, 902, 903]), (20.0, 10, [0, 1, 2, 3])]


def test_pull_takes_a_second_turn_from_the_store(tmp_path: Path) -> None:
    trace = _write_records(tmp_path / "store.jsonl", _STORE_RECORDS)
    run, index, requests = _pull_replay(trace, "--nodes", "1", "--blocks-per-node", "4",
                                        "--store-blocks", "8")
    result = run.result
    assert (result.num_pulls, result.num_pulled_blocks) == (1, 2)
    assert (result.num_store_pulls, result.num_store_pulled_blocks) == (1, 2)
    assert result.pulls_per_holder == [0, 1]  # node 0, then the store
    assert result.num_stale_hits == 0
    # A1's 2 pulled blocks of 2 + 4 + 4 prompt blocks: the unbounded cache's 2 as well.
    assert (result.hit_blocks, result.total_blocks) == (2, 10)
    # Written: A0's 2 (evicted by F) and F's 4 (evicted by A1); nothing dropped in 8 blocks.
    assert (result.num_offloaded_blocks, result.num_store_dropped_blocks) == (6, 0)
    assert result.num_store_held_blocks == result.num_store_listed_blocks == 6  # all anchored
    assert run.store.num_unknown_parent == 0  # every evicted block's parent was learned
    # The index lists the store as a holder of tier "store", besides node 0 (A1's 4 blocks).
    a1 = replay.Request("probe", replay.TokenExpander(16).prompt(requests[2]),
                        block_hasher=run.hasher)
    hit = index.longest_prefix(a1.block_hashes, all_holders=True)
    assert [(h.node_id, h.num_blocks, h.tier) for h in hit.holders] == [
        ("pull-node0", 4, "device"), ("pull-store", 2, "store"),
    ]
    index.close()


def test_a_shared_first_block_that_no_node_evicts_still_anchors_the_stores_chains(
    tmp_path: Path,
) -> None:
    # The bug the Mooncake trace showed, in small: every request starts with block 0 (a
    # system prompt), which each touches, so the node never evicts it. 1 node x 4 blocks, a
    # store of 8. (1) t=0: A0 = [0, 1, 2] runs; freed in reverse, the free queue is the unused
    # block, a2, a1, s0. (2) t=10: B0 = [0, 5, 6] hits s0 and evicts the unused block and a2:
    # the node writes a2's ancestors that it still caches, s0 (in use by B0) and a1, root
    # first, then a2, so the store anchors the chain at s0 and lists all 3. (3) t=20:
    # C = [0, 7, 8] hits s0 and evicts a1 (remembered as offloaded: not written again) and b6,
    # written after its ancestor b5 (s0 is remembered). (4) t=30: A1 = [0, 1, 2, 3] hits s0 on
    # the node; the index names the store with s0, a1, a2, so A1 pulls a1, a2 from it. Its 3
    # new blocks evict b5 (remembered), c8 and c7 (whose parent s0 is remembered): written.
    # (A writer of evicted blocks alone never writes s0, so the store lists nothing and A1
    # hits s0 only.)
    trace = _write_records(tmp_path / "shared.jsonl", [
        (0.0, 10, [0, 1, 2]), (10.0, 10, [0, 5, 6]), (20.0, 10, [0, 7, 8]),
        (30.0, 10, [0, 1, 2, 3]),
    ])
    run, index, _ = _pull_replay(trace, "--nodes", "1", "--blocks-per-node", "4",
                                 "--store-blocks", "8")
    result = run.result
    assert (result.num_store_pulls, result.num_store_pulled_blocks) == (1, 2)
    # Hits: s0 for B0, C and A1, and A1's 2 pulled blocks; the unbounded cache's 5 as well.
    assert (result.hit_blocks, result.total_blocks) == (1 + 1 + 3, 3 + 3 + 3 + 4)
    # Written: 3 (s0, a1 as ancestors), 2 (b5 as an ancestor), 2; nothing dropped in 8.
    assert (result.num_offloaded_blocks, result.num_ancestor_blocks) == (3 + 2 + 2, 2 + 1)
    assert result.num_store_dropped_blocks == 0
    assert result.num_store_held_blocks == result.num_store_listed_blocks == 7  # all anchored
    index.close()


def test_without_a_store_the_second_turn_misses(tmp_path: Path) -> None:
    # The same trace, --store-blocks 0 (the default): A0's evicted blocks are gone, so nothing
    # hits, and the report is the one without a store (no store entry, a holder per node).
    trace = _write_records(tmp_path / "store.jsonl", _STORE_RECORDS)
    flags = ["--nodes", "1", "--blocks-per-node", "4", "--policies", "pull"]
    summary = replay.main([str(trace), *flags, "--store-blocks", "0"])
    assert summary["unbounded_hit_ratio"] == 0.2  # A1's 2 of 10 prompt blocks
    pull = summary["pull"]
    assert (pull["hit_ratio"], pull["num_pulls"]) == (0.0, 0)
    assert pull["pulls_per_holder"] == [0]
    assert "store" not in pull and "store_blocks" not in summary
    default = replay.main([str(trace), *flags])
    assert _without_timings(default) == _without_timings(summary)
    # With the store: everything the unbounded cache has.
    with_store = replay.main([str(trace), *flags, "--store-blocks", "8"])
    assert with_store["pull"]["fraction_of_unbounded"] == 1.0
    assert with_store["pull"]["store"]["num_pulled_blocks"] == 2


def _without_timings(summary: dict) -> dict:
    """A replay summary without what differs from run to run (times, namespaces)."""
    out = {k: v for k, v in summary.items() if k not in ("wall_s", "index_namespaces")}
    for policy in ("index", "round_robin", "pull"):
        if policy in out:
            out[policy] = {k: v for k, v in out[policy].items() if "_us" not in k}
    return out


def test_index_and_round_robin_ignore_the_store(tmp_path: Path) -> None:
    # They never pull, so a store changes nothing of theirs (only pull gets one).
    trace = _write_records(tmp_path / "store.jsonl", _STORE_RECORDS)
    flags = ["--nodes", "1", "--blocks-per-node", "4", "--policies", "index,round_robin"]
    plain = replay.main([str(trace), *flags])
    with_store = replay.main([str(trace), *flags, "--store-blocks", "8"])
    assert with_store["store_blocks"] == 8
    del with_store["store_blocks"]
    assert _without_timings(with_store) == _without_timings(plain)
    assert "store" not in with_store["index"] and "store" not in with_store["round_robin"]


def test_a_full_store_drops_its_oldest_writes_and_stays_within_its_blocks(
    tmp_path: Path,
) -> None:
    # The trace above plus F1 = F at t=30, with a store of 2 blocks (LRU). F's admission
    # writes A0's 2 blocks; A1 pulls them (touching them) and evicts F's 4, written tail
    # first (none has a cached ancestor left to write before it): f3 and f2 drop A0's 2,
    # then f1 and f0 drop f3 and f2. The store keeps f0 and f1 (a chain's head: the pool
    # evicts a request's tail first), so F1, with no local hit (the node holds A1), pulls 2 of
    # the 3 blocks it may hit (the unbounded cache: 3). Its admission evicts A1's 4 blocks,
    # but the node's planner remembers a0 and a1 as offloaded (the store reported them held),
    # so only a3 and a2 are written: they drop f1 and f0 and are held unlisted (their parent
    # a1 is gone; the put names it missing, but the node no longer caches it). 8 written, 6
    # dropped, none written again.
    trace = _write_records(tmp_path / "store.jsonl", [
        *_STORE_RECORDS, (30.0, 10, [900, 901, 902, 903]),
    ])
    run, index, _ = _pull_replay(trace, "--nodes", "1", "--blocks-per-node", "4",
                                 "--store-blocks", "2", "--store-remember-blocks", "100")
    result = run.result
    assert result.num_store_held_blocks == run.store.num_held_blocks == 2
    assert result.num_store_listed_blocks == 0  # a3 and a2, under the missing a1
    assert (result.num_offloaded_blocks, result.num_store_dropped_blocks) == (2 + 4 + 2, 4 + 2)
    assert result.num_ancestor_blocks == result.num_store_rewritten_blocks == 0
    assert (result.num_store_pulls, result.num_store_pulled_blocks) == (2, 2 + 2)
    assert result.hit_blocks == 2 + 2
    run.store.check_integrity()
    index.close()


def test_a_node_remembers_only_its_share_of_the_store_and_writes_an_older_block_again(
    tmp_path: Path,
) -> None:
    # The run above with the default memory: one node, a store of 2, so the planner remembers
    # its last 2 writes as held (offload_remember_blocks = store blocks / nodes). By F1's
    # admission those are F's, so A1's evicted a0 and a1 (written at F's admission, dropped
    # since) are not remembered: all 4 of A1's blocks are written, tail first, and the store
    # ends with a1 and a0, a listed chain (above: nothing listed). 10 written, 8 dropped.
    trace = _write_records(tmp_path / "store.jsonl", [
        *_STORE_RECORDS, (30.0, 10, [900, 901, 902, 903]),
    ])
    run, index, _ = _pull_replay(trace, "--nodes", "1", "--blocks-per-node", "4",
                                 "--store-blocks", "2")
    result = run.result
    assert run.store.num_remembered == 2
    assert (result.num_offloaded_blocks, result.num_store_dropped_blocks) == (2 + 4 + 4, 6 + 2)
    assert result.num_store_held_blocks == result.num_store_listed_blocks == 2
    assert result.hit_blocks == 2 + 2  # the same hits: no later request asks for a0, a1
    run.store.check_integrity()
    index.close()


def test_a_pull_from_the_store_touches_what_it_reads(tmp_path: Path) -> None:
    # 1 node x 4 blocks, a store of 5. A0 = [0, 1] and B0 = [500, 501] run one after the other;
    # F = [900, 901, 902, 903] evicts both: the store holds, coldest first, a1 a0 b1 b0 (each
    # chain's head after its tail). A1 = [0, 1, 2] pulls a0, a1 from the store (its first 2
    # blocks, the most it may hit): the read makes them the most recently used, head last:
    # b1 b0 a1 a0. A1's admission evicts f3, f2, f1; f0, still cached on the node, is written
    # before f1 (its ancestor: the store anchors F's chain with it), so 4 writes (f3 into the
    # free block, f2, f0, f1) drop b1, b0, then a1. B1 = [500, 501, 502] then finds nothing;
    # had the read not touched A0's blocks, a1, a0 and b1 would have gone instead and B1 would
    # have pulled b0.
    trace = _write_records(tmp_path / "touch.jsonl", [
        (0.0, 10, [0, 1]), (10.0, 10, [500, 501]), (20.0, 10, [900, 901, 902, 903]),
        (30.0, 10, [0, 1, 2]), (40.0, 10, [500, 501, 502]),
    ])
    run, index, _ = _pull_replay(trace, "--nodes", "1", "--blocks-per-node", "4",
                                 "--store-blocks", "5", "--store-remember-blocks", "100")
    result = run.result
    assert (result.num_store_pulls, result.num_store_pulled_blocks) == (1, 2)
    assert (result.hit_blocks, result.total_blocks) == (2, 14)  # unbounded: B1's 2 too
    # Written: F's admission 4, A1's 4 (f0 as f1's ancestor), B1's 1: of f0, a2, a1, which
    # its 3 new blocks evict, the node's planner remembers f0 and a1 as offloaded. Dropped:
    # b1, b0, a1 at A1, then a0 at B1.
    assert (result.num_offloaded_blocks, result.num_store_dropped_blocks) == (4 + 4 + 1, 3 + 1)
    assert result.num_ancestor_blocks == 1
    index.close()
