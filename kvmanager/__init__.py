"""kvbridge.kvmanager: one node's KV control plane (specs, hashing, block pool, managers).

Public names follow docs/architecture.md, "The kvmanager contract"; behaviour follows the seed
articles and vLLM v1 (vllm/v1/core/).
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
    pack_token_ids,
)
from .block_hash_map import BlockHashToBlockMap
from .block_pool import BlockPool, CachedBlock
from .coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    PrefixHitRule,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from .integrity import check_manager_integrity, check_pool_integrity
from .kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock
from .kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
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
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .request import MultiModalFeature, Request, RequestStatus, SamplingParams
from .single_type_managers import (
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)

__all__ = [
    "HASH_FN_NAMES",
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CachedBlock",
    "CrossAttentionManager",
    "CrossAttentionSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "HashFn",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "MambaManager",
    "MambaSpec",
    "MultiModalFeature",
    "PrefixCacheStats",
    "PrefixHitRule",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "UnitaryKVCacheCoordinator",
    "check_manager_integrity",
    "check_pool_integrity",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_kv_cache_coordinator",
    "get_manager_for_kv_cache_spec",
    "get_request_block_hasher",
    "get_root_hash",
    "hash_block_tokens",
    "make_block_hash_with_group_id",
    "pack_token_ids",
]

# Scheduler, connector interface, block tables, model runner and engine (issue 3 parts 2, 4-6).
from .block_table import NULL_BLOCK_ID, BlockTable, MultiGroupBlockTable
from .connector_interface import (
    ForwardContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVLoadFailurePolicy,
    KVRole,
    MatchedTokens,
    NoOpConnector,
    RequestFinishedResult,
)
from .engine import Engine, EngineConfig, RequestOutput
from .model_runner import ModelRunner, make_kv_cache_config
from .scheduler import Scheduler
from .scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

__all__ += [
    "NULL_BLOCK_ID",
    "BlockTable",
    "CachedRequestData",
    "Engine",
    "EngineConfig",
    "EngineCoreOutput",
    "ForwardContext",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVLoadFailurePolicy",
    "KVRole",
    "MatchedTokens",
    "ModelRunner",
    "ModelRunnerOutput",
    "MultiGroupBlockTable",
    "NewRequestData",
    "NoOpConnector",
    "RequestFinishedResult",
    "RequestOutput",
    "Scheduler",
    "SchedulerOutput",
    "make_kv_cache_config",
]
