"""kvbridge.kvmanager: one node's KV control plane (specs, hashing, block pool, managers).

Public names follow DESIGN.md, "kvmanager contract"; behaviour follows the seed articles and
vLLM v1 (vllm/v1/core/).
"""

from .block_hash import (
    HASH_FN_NAMES,
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    HashFn,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    get_request_block_hasher,
    get_root_hash,
    hash_block_tokens,
    make_block_hash_with_group_id,
)
from .kv_cache_spec import (
    AttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from .request import MultiModalFeature, Request, RequestStatus, SamplingParams

__all__ = [
    "HASH_FN_NAMES",
    "AttentionSpec",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "HashFn",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MambaSpec",
    "MultiModalFeature",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "SlidingWindowSpec",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "get_root_hash",
    "hash_block_tokens",
    "make_block_hash_with_group_id",
]
