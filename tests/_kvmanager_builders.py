"""Builders and labelled assertions for kvmanager tests (``import _kvmanager_builders``).

Keyword arguments name the scenario: ``make_manager(num_blocks=11, block_size=16)``,
``make_request(manager, "r1", prefix=shared, num_suffix_tokens=5, cache_salt="x")``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvbridge.kvmanager import (
    BlockPool,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    MultiModalFeature,
    Request,
    SamplingParams,
    SlidingWindowSpec,
)

# Token ids at or above this base never collide with the small ids prompts are built from.
_UNIQUE_TOKEN_BASE = 1_000_000
_unique_counter = [0]


def full_attention_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float16
    )


def sliding_window_spec(block_size: int = 2, sliding_window: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float16,
        sliding_window=sliding_window,
    )


def mamba_spec(block_size: int = 4) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((2, 3), (4,)), dtype=torch.float32)


def cross_attention_spec(block_size: int = 4) -> CrossAttentionSpec:
    return CrossAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                              dtype=torch.float16)


def make_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    """One group per spec, layers named ``g{i}.layer``."""
    groups = [KVCacheGroupSpec([f"g{i}.layer"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks, groups)


def make_manager(
    *,
    num_blocks: int = 11,
    block_size: int = 16,
    specs: Sequence[KVCacheSpec] | None = None,
    max_model_len: int = 8192,
    enable_caching: bool = True,
    enable_kv_cache_events: bool = False,
    hash_fn: str = "sha256_cbor",
) -> KVCacheManager:
    """A manager over ``num_blocks`` blocks (block 0 = null); one full-attention group of
    ``block_size`` unless ``specs`` names the groups."""
    specs = list(specs) if specs is not None else [full_attention_spec(block_size)]
    return KVCacheManager(
        make_config(num_blocks, *specs),
        max_model_len,
        enable_caching=enable_caching,
        enable_kv_cache_events=enable_kv_cache_events,
        hash_fn=hash_fn,
    )


def unique_tokens(n: int) -> list[int]:
    """``n`` token ids never used before in this process (a prompt nobody shares)."""
    start = _UNIQUE_TOKEN_BASE + _unique_counter[0]
    _unique_counter[0] += n
    return list(range(start, start + n))


def make_request(
    manager: KVCacheManager,
    request_id: str,
    *,
    token_ids: Sequence[int] | None = None,
    prefix: Sequence[int] = (),
    num_suffix_tokens: int = 0,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
    mm_features: Sequence[MultiModalFeature] | None = None,
    max_tokens: int = 16,
) -> Request:
    """A request hashed with ``manager``'s hasher. Its prompt is ``token_ids`` or
    ``prefix`` followed by ``num_suffix_tokens`` fresh unique tokens."""
    prompt = list(token_ids) if token_ids is not None else list(prefix) + unique_tokens(
        num_suffix_tokens
    )
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
        block_hasher=manager.request_block_hasher,
        lora_name=lora_name,
        cache_salt=cache_salt,
        mm_features=mm_features,
    )


def schedule_prefill(manager: KVCacheManager, request: Request) -> tuple[int, KVCacheBlocks | None]:
    """Look up the prefix cache, allocate the whole rest of the prompt in one step and, when it
    fits, mark the prompt computed (as a scheduler plus one forward pass would).

    Returns (hit tokens, new blocks or None)."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit, num_hit, hit_blocks
    )
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return num_hit, new_blocks


def decode_step(manager: KVCacheManager, request: Request, token_id: int) -> KVCacheBlocks | None:
    """Append ``token_id`` as sampled output and allocate the slot for it (one decode step)."""
    request.append_output_token_ids(token_id)
    new_blocks = manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return new_blocks


def free_queue_ids(pool: BlockPool) -> list[int]:
    """Block ids on the free queue, first (evicted first) to last."""
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(pool: BlockPool, block_ids: Sequence[int]) -> list[int]:
    return [pool.blocks[i].ref_cnt for i in block_ids]


def hashed_block_ids(pool: BlockPool) -> list[int]:
    """Ids of blocks listed in the prefix-cache map, sorted."""
    return sorted(block.block_id for _, block in pool.cached_block_hash_to_block.blocks())


def pool_snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything allocation may change: ref counts, free queue order, hash map, block hashes."""
    return (
        [block.ref_cnt for block in pool.blocks],
        free_queue_ids(pool),
        sorted((key, block.block_id) for key, block in pool.cached_block_hash_to_block.blocks()),
        [block.block_hash for block in pool.blocks],
    )


def assert_all_free(manager: KVCacheManager) -> None:
    """Leak check after every request is freed: integrity holds, no table is left, and every
    block except the null block is on the free queue."""
    manager.check_integrity()
    for single in manager.coordinator.single_type_managers:
        assert single.req_to_blocks == {}, f"group {single.kv_cache_group_id} leaks tables"
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert sorted(free_queue_ids(pool)) == list(range(1, pool.num_gpu_blocks))
