"""kvbridge.kernels: data-plane ops on paged KV tensors and the reference decoder.

The KV tensor layout is defined in ``layout`` (one tensor per layer,
``[num_blocks, 2, block_size, num_kv_heads, head_size]``). Each op runs a Triton kernel on CUDA
tensors and a torch twin on CPU tensors; ``dispatch`` holds the rule and the override.
"""

from .attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_decode,
    paged_attention_prefill,
)
from .cache_ops import copy_blocks, gather_blocks, reshape_and_cache, scatter_blocks
from .config import (
    BYTE_VOCAB_SIZE,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    layer_name,
    layer_names_by_type,
)
from .dispatch import set_default_use_triton, should_use_triton
from .layout import (
    KVCacheShape,
    block_nbytes,
    check_block_ids,
    check_kv_caches,
    kv_cache_shape,
    staging_nbytes,
    staging_shape,
)
from .model import ReferenceDecoder, allocate_kv_caches
from .sampling import (
    PromptLogprobs,
    compute_logprobs,
    greedy_sample,
    prompt_logprobs,
    token_logprobs,
)
from .tokenizer import ByteTokenizer

__all__ = [
    "BYTE_VOCAB_SIZE",
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "AttentionMetadata",
    "ByteTokenizer",
    "KVCacheShape",
    "ModelConfig",
    "PromptLogprobs",
    "ReferenceDecoder",
    "allocate_kv_caches",
    "block_nbytes",
    "check_block_ids",
    "check_kv_caches",
    "compute_logprobs",
    "copy_blocks",
    "gather_blocks",
    "greedy_sample",
    "kv_cache_shape",
    "layer_name",
    "layer_names_by_type",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "prompt_logprobs",
    "reshape_and_cache",
    "scatter_blocks",
    "set_default_use_triton",
    "should_use_triton",
    "staging_nbytes",
    "staging_shape",
    "token_logprobs",
]
