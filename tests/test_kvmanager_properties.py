"""Property test: random interleavings keep every kvmanager invariant.

Requests share a few prefixes (so hits, shared ref counts and evictions happen on a small pool),
run chunked prefill and decode with lookahead, load "remote" KV with ``delay_cache_blocks``,
finish, get preempted (freed and restarted), and the prefix cache is reset or blocks evicted in
between. After every operation ``check_integrity()`` must pass; at the end, once every request is
freed, every block except the null block is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from _kvmanager_builders import (
    assert_all_free,
    full_attention_spec,
    make_manager,
    make_request,
    mamba_spec,
    pool_snapshot,
    sliding_window_spec,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbridge.kvmanager import FullAttentionManager, KVCacheManager, KVCacheSpec, Request

_SPEC_SETS: dict[str, list[KVCacheSpec]] = {
    "full": [full_attention_spec(4)],
    "full+window": [full_attention_spec(4), sliding_window_spec(block_size=4, sliding_window=6)],
    "full+mamba": [full_attention_spec(4), mamba_spec(block_size=4)],
    "full4+full8": [full_attention_spec(4), full_attention_spec(8)],
    "window": [sliding_window_spec(block_size=2, sliding_window=5)],
}
_PREFIXES = [list(range(100, 112)), list(range(200, 220)), list(range(100, 108))]
# Steps dominate so that requests get far enough to share, fill and exhaust the pool.
_OPS = ("add", "add", "step", "step", "step", "step", "step", "finish", "preempt", "reset",
        "evict")


@dataclass
class _Live:
    request: Request
    state: str = "waiting"  # waiting | loading | running
    remote: bool = False


def _step(manager: KVCacheManager, live: _Live, knob: int) -> None:
    req = live.request
    if live.state == "loading":
        # The remote load landed: publish the blocks, then the progress (last token recomputed).
        num_loaded = req.num_tokens - 1
        manager.cache_blocks(req, num_loaded)
        req.num_computed_tokens = num_loaded
        live.state = "running"
        return
    if live.state == "waiting":
        hit, num_hit = manager.get_computed_blocks(req)
        block_size = manager.hash_block_size
        assert num_hit <= req.num_tokens - 1 and num_hit % block_size == 0
        num_external = req.num_tokens - 1 - num_hit if live.remote else 0
        if num_external > 0:
            new_blocks = manager.allocate_slots(
                req, 0, num_hit, hit, num_external_computed_tokens=num_external,
                delay_cache_blocks=True,
            )
            if new_blocks is not None:
                req.num_computed_tokens = num_hit
                live.state = "loading"
            return
        chunk = min(req.num_tokens - num_hit, 1 + knob % 9)
        if manager.allocate_slots(req, chunk, num_hit, hit) is not None:
            req.num_computed_tokens = num_hit + chunk
            live.state = "running"
        return
    if req.num_computed_tokens >= req.num_tokens:
        req.append_output_token_ids(knob % 50)
    chunk = min(req.num_tokens - req.num_computed_tokens, 1 + knob % 7)
    lookahead = knob % 3
    before = pool_snapshot(manager.block_pool)
    if manager.allocate_slots(req, chunk, num_lookahead_tokens=lookahead) is not None:
        req.num_computed_tokens += chunk
    elif all(isinstance(m, FullAttentionManager) for m in manager.coordinator.single_type_managers):
        # "No room" changes nothing (window and Mamba groups may first release skipped blocks,
        # a documented side effect that is independent of this step).
        assert pool_snapshot(manager.block_pool) == before


@pytest.mark.parametrize("spec_set", list(_SPEC_SETS))
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 10_000)), min_size=10,
                    max_size=80))
def test_random_interleavings_keep_integrity(spec_set: str, ops: list[tuple[str, int]]) -> None:
    manager = make_manager(num_blocks=16, specs=_SPEC_SETS[spec_set], max_model_len=128)
    live: dict[str, _Live] = {}
    counter = 0
    for op, knob in ops:
        ids = sorted(live)
        target = live[ids[knob % len(ids)]] if ids else None
        if op == "add" or target is None:
            counter += 1
            prefix = _PREFIXES[knob % len(_PREFIXES)]
            req = make_request(manager, f"r{counter}", prefix=prefix,
                               num_suffix_tokens=knob % 11,
                               cache_salt="s" if knob % 13 == 0 else None)
            live[req.request_id] = _Live(req, remote=knob % 5 == 0)
        elif op == "step":
            _step(manager, target, knob)
        elif op == "finish":
            manager.free(target.request)
            del live[target.request.request_id]
        elif op == "preempt":
            manager.free(target.request)
            target.request.num_computed_tokens = 0
            target.request.num_preemptions += 1
            target.state = "waiting"
        elif op == "reset":
            held = manager.block_pool.get_num_free_blocks() < manager.block_pool.num_gpu_blocks - 1
            assert manager.reset_prefix_cache() is (not held)
        elif op == "evict":
            manager.block_pool.evict_blocks([knob % manager.block_pool.num_gpu_blocks])
        manager.check_integrity()
    for entry in live.values():
        manager.free(entry.request)
    assert_all_free(manager)
