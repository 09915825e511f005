"""KVCacheManager with one full-attention group: the issue's exact scenarios and the seeds'.

Every lifecycle test ends with ``assert_all_free`` (integrity + leak check).
"""

from __future__ import annotations

import pytest
from _kvmanager_builders import (
    assert_all_free,
    decode_step,
    free_queue_ids,
    hashed_block_ids,
    make_manager,
    make_request,
    pool_snapshot,
    ref_cnts,
    schedule_prefill,
    unique_tokens,
)
from kvbridge.kvmanager import BlockRemoved, BlockStored, get_block_hash


def test_issue_scenario_two_requests_share_48_tokens() -> None:
    manager = make_manager(num_blocks=11, block_size=16)
    pool = manager.block_pool
    shared = unique_tokens(48)
    r0 = make_request(manager, "r0", prefix=shared, num_suffix_tokens=7)  # 55 tokens

    num_hit, new_blocks = schedule_prefill(manager, r0)
    # Nothing cached yet; 55 tokens need cdiv(55, 16) = 4 blocks, popped in id order from the
    # fresh queue [1..10] (block 0 is the null block).
    assert num_hit == 0
    assert new_blocks is not None and new_blocks.get_block_ids() == ([1, 2, 3, 4],)
    # Blocks 1-3 are full (48 tokens) and hashed; block 4 holds 7 tokens and is not.
    assert [pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [
        True, True, True, False
    ]

    r1 = make_request(manager, "r1", prefix=shared, num_suffix_tokens=5)  # 53 tokens
    num_hit, new_blocks = schedule_prefill(manager, r1)
    # The three shared full blocks hit (48 tokens); 53 tokens need 4 blocks, so one new block,
    # the queue head, block 5.
    assert num_hit == 48
    assert new_blocks is not None and new_blocks.get_block_ids() == ([5],)
    assert manager.get_block_ids("r1") == ([1, 2, 3, 5],)
    assert ref_cnts(pool, [1, 2, 3]) == [2, 2, 2]
    assert manager.get_num_free_blocks() == 5  # 10 usable - {1, 2, 3, 4, 5}
    manager.check_integrity()

    manager.free(r0)
    manager.free(r1)
    # r0 frees 4 (unhashed -> front), then 3, 2, 1 lose one reference each (still held by r1).
    # r1 frees in reverse: 5 (unhashed -> front, before 4), then 3, 2, 1 reach 0 and go to the
    # tail in that order, so the shared head block 1 is evicted last.
    assert free_queue_ids(pool) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert_all_free(manager)


def test_capacity_counts_evictable_hit_blocks_and_fails_without_side_effects() -> None:
    # Seed 000, "第二步": 3 free blocks, a request that hits 2 of them (ref_cnt 0) and needs 2
    # new ones. 2 <= 3 looks fine, but touching the hits leaves 1 free: 2 + 2 > 3 -> None.
    manager = make_manager(num_blocks=6, block_size=4)
    pool = manager.block_pool
    shared = unique_tokens(8)
    owner = make_request(manager, "owner", prefix=shared, num_suffix_tokens=1)  # 9 tokens
    schedule_prefill(manager, owner)  # blocks [1, 2, 3]; 1 and 2 hashed
    manager.free(owner)  # queue [3, 4, 5, 2, 1]
    holder = make_request(manager, "holder", num_suffix_tokens=8)
    schedule_prefill(manager, holder)  # takes 3 and 4 from the front
    assert free_queue_ids(pool) == [5, 2, 1]
    assert ref_cnts(pool, [1, 2]) == [0, 0]

    req = make_request(manager, "req", prefix=shared, num_suffix_tokens=8)  # 16 tokens
    hit_blocks, num_hit = manager.get_computed_blocks(req)
    assert num_hit == 8 and hit_blocks.get_block_ids() == ([1, 2],)
    before = pool_snapshot(pool)
    # 16 tokens need 4 blocks: 2 hits (both ref_cnt 0, so they consume free capacity) + 2 new.
    assert manager.allocate_slots(req, 8, num_hit, hit_blocks) is None
    assert pool_snapshot(pool) == before
    assert manager.get_block_ids("req") == ([],)
    manager.check_integrity()

    manager.free(holder)
    manager.free(req)  # never allocated: a no-op
    assert_all_free(manager)


@pytest.mark.parametrize(
    ("num_prompt_tokens", "expected_hit"),
    [
        (15, 0),  # no full block at all
        (16, 0),  # one full block, but the last token is recomputed -> cap 15 -> 0 blocks
        (17, 16),
        (31, 16),
        (32, 16),  # both blocks cached, cap 31 -> one block: the issue's case
        (33, 32),
    ],
)
def test_hit_is_capped_at_num_tokens_minus_one_and_block_aligned(
    num_prompt_tokens: int, expected_hit: int
) -> None:
    manager = make_manager(num_blocks=11, block_size=16)
    tokens = unique_tokens(num_prompt_tokens)
    first = make_request(manager, "first", token_ids=tokens)
    schedule_prefill(manager, first)
    manager.free(first)  # every full block of the prompt stays cached
    second = make_request(manager, "second", token_ids=tokens)
    num_hit, _ = schedule_prefill(manager, second)
    assert num_hit == expected_hit
    manager.free(second)
    assert_all_free(manager)


def test_lora_and_salt_live_in_different_hash_domains() -> None:
    manager = make_manager(num_blocks=20, block_size=4)
    tokens = unique_tokens(9)
    lora = make_request(manager, "lora", token_ids=tokens, lora_name="x")
    salt = make_request(manager, "salt", token_ids=tokens, cache_salt="x")
    # ("lora", "x") and ("cache_salt", "x") are different extra keys, so the same string in two
    # domains never yields the same first-block hash.
    assert lora.block_hashes[0] != salt.block_hashes[0]

    schedule_prefill(manager, salt)
    same_salt = make_request(manager, "same_salt", token_ids=tokens, cache_salt="x")
    other_salt = make_request(manager, "other_salt", token_ids=tokens, cache_salt="y")
    no_salt = make_request(manager, "no_salt", token_ids=tokens)
    assert schedule_prefill(manager, same_salt)[0] == 8  # two full blocks, cap 8
    assert schedule_prefill(manager, other_salt)[0] == 0
    assert schedule_prefill(manager, no_salt)[0] == 0
    assert schedule_prefill(manager, lora)[0] == 0  # lora "x" != salt "x"
    for req in (salt, same_salt, other_salt, no_salt, lora):
        manager.free(req)
    assert_all_free(manager)


def test_prompt_logprobs_skip_reading_but_still_write_the_cache() -> None:
    manager = make_manager(num_blocks=20, block_size=4)
    tokens = unique_tokens(9)
    warm = make_request(manager, "warm", token_ids=tokens)
    schedule_prefill(manager, warm)
    manager.free(warm)

    logprobs = make_request(
        manager, "logprobs", token_ids=[*tokens, 7, 7, 7, 7], prompt_logprobs=1
    )
    assert logprobs.skip_reading_prefix_cache
    num_hit, new_blocks = schedule_prefill(manager, logprobs)
    # Reading is skipped (it needs logits for every prompt token), so nothing hits even though
    # the first two blocks are cached; 13 tokens need 4 fresh blocks.
    assert num_hit == 0
    assert new_blocks is not None and len(new_blocks.blocks[0]) == 4
    # Writing still happens: its 3 full blocks are hashed and a later request hits them (12
    # tokens, below the cap of 13 - 1).
    later = make_request(manager, "later", token_ids=[*tokens, 7, 7, 7, 7, 8])
    assert manager.get_computed_blocks(later)[1] == 12
    manager.free(logprobs)
    assert_all_free(manager)


def test_delay_cache_blocks_hides_blocks_until_cache_blocks() -> None:
    manager = make_manager(num_blocks=20, block_size=4)
    tokens = unique_tokens(13)
    remote = make_request(manager, "remote", token_ids=tokens)
    # Decode-node path: 12 tokens come from a connector; no token is computed locally yet.
    new_blocks = manager.allocate_slots(
        remote, 0, num_external_computed_tokens=12, delay_cache_blocks=True
    )
    assert new_blocks is not None and new_blocks.get_block_ids() == ([1, 2, 3],)
    assert hashed_block_ids(manager.block_pool) == []
    probe = make_request(manager, "probe", token_ids=tokens)
    assert manager.get_computed_blocks(probe)[1] == 0  # not findable while the load is in flight

    # The load landed: publish, then progress is the loaded tokens.
    manager.cache_blocks(remote, 12)
    remote.num_computed_tokens = 12
    assert hashed_block_ids(manager.block_pool) == [1, 2, 3]
    assert manager.get_computed_blocks(probe)[1] == 12
    # The rest of the prompt (1 token) and the first output fit in a 4th block.
    assert manager.allocate_slots(remote, 1).get_block_ids() == ([4],)
    manager.free(remote)
    assert_all_free(manager)


def test_lookahead_slots_are_allocated_but_never_cached() -> None:
    manager = make_manager(num_blocks=20, block_size=4)
    req = make_request(manager, "req", num_suffix_tokens=6)
    # 6 tokens + 6 lookahead = 12 slots -> 3 blocks; only 6 real tokens -> only block 1 is full.
    new_blocks = manager.allocate_slots(req, 6, num_lookahead_tokens=6)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([1, 2, 3],)
    assert hashed_block_ids(manager.block_pool) == [1]
    manager.free(req)
    assert_all_free(manager)


def test_seed_moments_0_to_6_with_block_0_as_null_block() -> None:
    # Seed 000's walk-through, block size 4, ten usable blocks: every seed id is ours minus 1.
    manager = make_manager(num_blocks=11, block_size=4, enable_kv_cache_events=True)
    pool = manager.block_pool
    # Moment 0: fresh pool, queue in id order, nothing hashed.
    assert free_queue_ids(pool) == list(range(1, 11))
    assert hashed_block_ids(pool) == []

    # Moment 1: R0 with 15 tokens A..O takes cdiv(15, 4) = 4 blocks; 3 are full and hashed.
    a_to_o = unique_tokens(15)
    r0 = make_request(manager, "R0", token_ids=a_to_o)
    schedule_prefill(manager, r0)
    assert manager.get_block_ids("R0") == ([1, 2, 3, 4],)
    assert free_queue_ids(pool) == [5, 6, 7, 8, 9, 10]
    assert ref_cnts(pool, [1, 2, 3, 4]) == [1, 1, 1, 1]
    assert hashed_block_ids(pool) == [1, 2, 3]

    # Moment 2: P fills block 4 (now hashed: A..P); Q crosses the boundary and takes block 5.
    p_token, q_token = unique_tokens(2)
    assert decode_step(manager, r0, p_token).get_block_ids() == ([],)
    assert hashed_block_ids(pool) == [1, 2, 3, 4]
    assert decode_step(manager, r0, q_token).get_block_ids() == ([5],)
    assert manager.get_block_ids("R0") == ([1, 2, 3, 4, 5],)
    assert free_queue_ids(pool) == [6, 7, 8, 9, 10]

    # Moment 3: free in reverse: 5 (unhashed) to the front, 4, 3, 2, 1 (hashed) to the tail.
    manager.free(r0)
    assert free_queue_ids(pool) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    assert hashed_block_ids(pool) == [1, 2, 3, 4]
    assert ref_cnts(pool, range(1, 11)) == [0] * 10

    # Moment 4: R1 shares A..L then differs: hits 1, 2, 3 (touched off the tail), new block 5.
    r1 = make_request(manager, "R1", prefix=a_to_o[:12], num_suffix_tokens=3)
    num_hit, new_blocks = schedule_prefill(manager, r1)
    assert num_hit == 12 and new_blocks.get_block_ids() == ([5],)
    assert manager.get_block_ids("R1") == ([1, 2, 3, 5],)
    assert free_queue_ids(pool) == [6, 7, 8, 9, 10, 4]
    assert ref_cnts(pool, [1, 2, 3, 5]) == [1, 1, 1, 1]

    # Moment 5: R2 needs 7 blocks, 6 are free: None, and nothing moved.
    r2 = make_request(manager, "R2", num_suffix_tokens=28)
    before = pool_snapshot(pool)
    assert schedule_prefill(manager, r2) == (0, None)
    assert pool_snapshot(pool) == before
    assert manager.get_block_ids("R1") == ([1, 2, 3, 5],)

    # Moment 6: a 6-block allocation pops down to block 4; its hash (A..P) is evicted before it
    # is handed out, while the shorter prefixes A..D, A..H, A..L stay cached.
    manager.take_events()
    r3 = make_request(manager, "R3", num_suffix_tokens=24)
    assert schedule_prefill(manager, r3)[1].get_block_ids() == ([6, 7, 8, 9, 10, 4],)
    removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
    assert [(e.block_ids, e.group_id) for e in removed] == [([4], 0)]
    assert removed[0].block_hashes == [r0.block_hashes[3]]
    # Hashed now: R1's A..D, A..H, A..L (1-3) and R3's six full blocks (4 re-hashed as R3's).
    assert hashed_block_ids(pool) == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert [pool.get_cached_block(h, [0])[0].block_id for h in r0.block_hashes[:3]] == [1, 2, 3]
    assert pool.get_cached_block(r0.block_hashes[3], [0]) is None
    for req in (r1, r2, r3):
        manager.free(req)
    assert_all_free(manager)


def test_block_stored_event_shape() -> None:
    manager = make_manager(num_blocks=11, block_size=4, enable_kv_cache_events=True)
    req = make_request(manager, "req", num_suffix_tokens=9, lora_name="adapter")
    schedule_prefill(manager, req)
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    # One event for the two full blocks of the prefill; the first block has no parent.
    assert len(stored) == 1
    event = stored[0]
    assert event.block_hashes == req.block_hashes[:2]
    assert event.parent_block_hash is None
    assert event.token_ids == req.all_token_ids[:8]
    assert (event.block_size, event.lora_name, event.group_id) == (4, "adapter", 0)
    assert event.block_ids == [1, 2]
    for _i in range(3):
        decode_step(manager, req, 5)
    # Tokens 9..12 fill block 3: its parent is block 2's hash.
    (event,) = manager.take_events()
    assert event.block_ids == [3] and event.parent_block_hash == req.block_hashes[1]
    assert get_block_hash(manager.block_pool.blocks[3].block_hash) == req.block_hashes[2]
    manager.free(req)
    assert_all_free(manager)


def test_zero_new_tokens_without_lookahead_is_a_caller_error() -> None:
    manager = make_manager(num_blocks=11, block_size=4)
    req = make_request(manager, "req", num_suffix_tokens=4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(req, 0)
    with pytest.raises(ValueError, match="negative"):
        manager.allocate_slots(req, -1)
    assert_all_free(manager)


def test_block_freed_twice_raises_naming_the_block() -> None:
    manager = make_manager(num_blocks=11, block_size=4)
    req = make_request(manager, "req", num_suffix_tokens=4)
    schedule_prefill(manager, req)
    block = manager.get_blocks("req").blocks[0][0]
    manager.free(req)
    with pytest.raises(RuntimeError, match=f"block {block.block_id} .*ref_cnt 0"):
        manager.block_pool.free_blocks([block])
    assert_all_free(manager)


def test_ref_count_below_zero_is_reported_by_check_integrity() -> None:
    manager = make_manager(num_blocks=11, block_size=4)
    req = make_request(manager, "req", num_suffix_tokens=8)
    schedule_prefill(manager, req)
    manager.block_pool.blocks[2].ref_cnt = -1
    with pytest.raises(RuntimeError, match="block 2 has ref_cnt -1"):
        manager.check_integrity()
    manager.block_pool.blocks[2].ref_cnt = 2  # one more than the single table holding it
    with pytest.raises(RuntimeError, match="block 2 has ref_cnt 2 but 1 request tables"):
        manager.check_integrity()
    manager.block_pool.blocks[2].ref_cnt = 1
    manager.free(req)
    assert_all_free(manager)


def test_prefix_cache_stats_count_tokens_and_preempted_requests_apart() -> None:
    manager = make_manager(num_blocks=20, block_size=4)
    tokens = unique_tokens(9)
    first = make_request(manager, "first", token_ids=tokens)
    schedule_prefill(manager, first)
    second = make_request(manager, "second", token_ids=tokens)
    schedule_prefill(manager, second)
    second.num_preemptions = 1  # as the scheduler does when it preempts
    manager.free(second)
    second.num_computed_tokens = 0
    schedule_prefill(manager, second)
    stats = manager.make_prefix_cache_stats()
    # first: 9 queried, 0 hit; second: 9 queried, 8 hit; the re-lookup after preemption is
    # kept apart: 9 queried, 8 hit.
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    assert manager.make_prefix_cache_stats().requests == 0  # reset after being taken
    manager.free(first)
    manager.free(second)
    assert_all_free(manager)


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    manager = make_manager(num_blocks=11, block_size=4, enable_kv_cache_events=True)
    req = make_request(manager, "req", num_suffix_tokens=8)
    schedule_prefill(manager, req)
    assert manager.reset_prefix_cache() is False
    assert hashed_block_ids(manager.block_pool) == [1, 2]
    manager.free(req)
    manager.take_events()
    assert manager.reset_prefix_cache() is True
    assert hashed_block_ids(manager.block_pool) == []
    assert [type(e).__name__ for e in manager.take_events()] == ["AllBlocksCleared"]
    assert manager.make_prefix_cache_stats().reset is True
    assert_all_free(manager)


@pytest.mark.parametrize("hash_fn", ["sha256_cbor", "sha256", "xxhash_cbor"])
def test_every_hash_function_serves_hits(hash_fn: str) -> None:
    manager = make_manager(num_blocks=11, block_size=4, hash_fn=hash_fn)
    tokens = unique_tokens(9)
    a = make_request(manager, "a", token_ids=tokens)
    b = make_request(manager, "b", token_ids=tokens)
    schedule_prefill(manager, a)
    assert schedule_prefill(manager, b)[0] == 8
    manager.free(a)
    manager.free(b)
    assert_all_free(manager)


def test_caching_disabled_never_hashes_or_hits() -> None:
    manager = make_manager(num_blocks=11, block_size=4, enable_caching=False)
    tokens = unique_tokens(9)
    a = make_request(manager, "a", token_ids=tokens)
    b = make_request(manager, "b", token_ids=tokens)
    schedule_prefill(manager, a)
    assert schedule_prefill(manager, b)[0] == 0
    assert hashed_block_ids(manager.block_pool) == []
    manager.free(a)
    manager.free(b)
    assert_all_free(manager)


def test_usage_counts_held_blocks_only() -> None:
    manager = make_manager(num_blocks=11, block_size=4)
    req = make_request(manager, "req", num_suffix_tokens=9)
    schedule_prefill(manager, req)
    assert manager.usage == pytest.approx(3 / 10)  # 3 of 10 usable blocks held
    manager.free(req)
    assert manager.usage == 0.0  # cached-but-free blocks count as free
    assert_all_free(manager)


def test_max_model_len_caps_slots() -> None:
    manager = make_manager(num_blocks=11, block_size=4, max_model_len=10)
    req = make_request(manager, "req", num_suffix_tokens=8)
    # 8 tokens + 8 lookahead would need 4 blocks; capped at 10 tokens -> 3 blocks.
    assert len(manager.allocate_slots(req, 8, num_lookahead_tokens=8).blocks[0]) == 3
    manager.free(req)
    assert_all_free(manager)


def test_local_hit_then_external_tokens_are_laid_out_by_position() -> None:
    manager = make_manager(num_blocks=20, block_size=4)
    tokens = unique_tokens(17)
    warm = make_request(manager, "warm", token_ids=tokens[:5])
    schedule_prefill(manager, warm)  # caches block 1 = tokens 0-3
    manager.free(warm)  # queue [2, 3, ..., 19, 1]
    req = make_request(manager, "req", token_ids=tokens)
    hit, num_hit = manager.get_computed_blocks(req)
    assert (hit.get_block_ids(), num_hit) == (([1],), 4)
    # | hit 0-3 | external 4-15 | : the hit keeps position 0, the external tokens get positions
    # 1-3 from the queue head; nothing is published while the load is in flight.
    new_blocks = manager.allocate_slots(
        req, 0, num_hit, hit, num_external_computed_tokens=12, delay_cache_blocks=True
    )
    assert new_blocks.get_block_ids() == ([2, 3, 4],)
    assert manager.get_block_ids("req") == ([1, 2, 3, 4],)
    assert hashed_block_ids(manager.block_pool) == [1]
    manager.cache_blocks(req, 16)  # load confirmed: positions 1-3 are published after the hit
    assert hashed_block_ids(manager.block_pool) == [1, 2, 3, 4]
    manager.free(req)
    assert_all_free(manager)
