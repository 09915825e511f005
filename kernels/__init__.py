"""kvbridge.kernels: data-plane ops on paged KV tensors (the reference decoder: ``model``).

The KV tensor layout is defined in ``layout`` (one tensor per layer,
``[num_blocks, 2, block_size, num_kv_heads, head_size]``). Each op runs a Triton kernel on CUDA
tensors and a torch twin on CPU tensors; ``dispatch`` holds the rule and the override.
``host_memory`` allocates huge-page host tensors for KV caches and staging buffers;
``device_binding`` binds a thread to the KV tensors' device before it touches them.
"""

from .attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_decode,
    paged_attention_prefill,
)
from .cache_ops import copy_blocks, gather_blocks, reshape_and_cache, scatter_blocks
from .dispatch import set_default_use_triton, should_use_triton
from .host_memory import HUGE_PAGE_BYTES, host_buffer, host_zeros
from .layout import (
    KVCacheShape,
    block_nbytes,
    check_block_ids,
    check_kv_caches,
    kv_cache_shape,
    staging_nbytes,
    staging_shape,
)

__all__ = [
    "HUGE_PAGE_BYTES",
    "AttentionMetadata",
    "KVCacheShape",
    "block_nbytes",
    "check_block_ids",
    "check_kv_caches",
    "copy_blocks",
    "gather_blocks",
    "host_buffer",
    "host_zeros",
    "kv_cache_shape",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "scatter_blocks",
    "set_default_use_triton",
    "should_use_triton",
    "staging_nbytes",
    "staging_shape",
]
