"""Triton kernels for the KV cache ops; twins of ``cache_ops_torch``.

Conventions (Triton tutorials): ``name_kernel`` is the kernel and ``name_triton`` its host
wrapper; ``*_ptr`` / ``*_stride`` arguments; UPPER_CASE ``tl.constexpr``; every tail masked;
offsets computed in int64 (a KV cache easily exceeds 2**31 elements). Wrappers assume arguments
validated by ``cache_ops`` (layout, ranges) and launch one grid per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_COPY_CHUNK = 1024
"""Elements of a block moved by one program of ``block_copy_kernel``."""


@triton.jit
def block_copy_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_block_stride,
    dst_block_stride,
    block_numel,
    CHUNK: tl.constexpr,
):
    """Program ``(i, c)`` copies chunk ``c`` of block ``src_ids[i]`` of ``src`` into block
    ``dst_ids[i]`` of ``dst``; a block is ``block_numel`` contiguous elements."""
    pair_idx = tl.program_id(0)
    chunk_idx = tl.program_id(1)
    src_block = tl.load(src_ids_ptr + pair_idx).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair_idx).to(tl.int64)
    offsets = chunk_idx.to(tl.int64) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    mask = offsets < block_numel
    values = tl.load(src_ptr + src_block * src_block_stride + offsets, mask=mask)
    tl.store(dst_ptr + dst_block * dst_block_stride + offsets, values, mask=mask)


def _copy_blocks_between(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    block_numel = src[0].numel()
    if src.stride(0) != block_numel or dst.stride(0) != block_numel:
        raise ValueError("block_copy_kernel needs contiguous blocks (stride(0) == block numel)")
    grid = (src_ids.shape[0], triton.cdiv(block_numel, _COPY_CHUNK))
    block_copy_kernel[grid](
        src, dst, src_ids, dst_ids, src.stride(0), dst.stride(0), block_numel, CHUNK=_COPY_CHUNK
    )


def copy_blocks_triton(kv_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Twin of ``copy_blocks_torch`` (sources and destinations are disjoint, checked upstream)."""
    src_ids = block_mapping[:, 0].contiguous()
    dst_ids = block_mapping[:, 1].contiguous()
    for kv_cache in kv_caches:
        _copy_blocks_between(kv_cache, kv_cache, src_ids, dst_ids)


def gather_blocks_triton(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, staging: torch.Tensor
) -> torch.Tensor:
    """Twin of ``gather_blocks_torch``."""
    block_ids = block_ids.contiguous()
    rows = torch.arange(block_ids.shape[0], device=block_ids.device, dtype=torch.int64)
    for layer_idx, kv_cache in enumerate(kv_caches):
        _copy_blocks_between(kv_cache, staging[layer_idx], block_ids, rows)
    return staging


def scatter_blocks_triton(
    staging: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """Twin of ``scatter_blocks_torch``."""
    block_ids = block_ids.contiguous()
    rows = torch.arange(block_ids.shape[0], device=block_ids.device, dtype=torch.int64)
    for layer_idx, kv_cache in enumerate(kv_caches):
        _copy_blocks_between(staging[layer_idx], kv_cache, rows, block_ids)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    cache_block_stride,
    cache_kv_stride,
    cache_slot_stride,
    cache_head_stride,
    num_kv_heads,
    head_size,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
):
    """Program ``t`` writes ``key[t]`` and ``value[t]`` (``[num_kv_heads, head_size]``) into slot
    ``slot_mapping[t]``; a slot of -1 writes nothing."""
    token_idx = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot >= 0:
        block_idx = slot // BLOCK_SIZE
        block_offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD).to(tl.int64)[:, None]
        dims = tl.arange(0, HEAD_SIZE_PAD).to(tl.int64)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_size)
        key = tl.load(key_ptr + token_idx * key_token_stride + heads * key_head_stride + dims,
                      mask=mask)
        value = tl.load(
            value_ptr + token_idx * value_token_stride + heads * value_head_stride + dims,
            mask=mask,
        )
        dst = (kv_cache_ptr + block_idx * cache_block_stride + block_offset * cache_slot_stride
               + heads * cache_head_stride + dims)
        tl.store(dst, key, mask=mask)
        tl.store(dst + cache_kv_stride, value, mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Twin of ``reshape_and_cache_torch``. A key/value of another dtype than the cache is cast
    by torch first (round to nearest even, as the twin; the interpreter's casts may differ), so
    the kernel only moves bits."""
    key = key.to(kv_cache.dtype)
    value = value.to(kv_cache.dtype)
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    slot_mapping = slot_mapping.contiguous()
    reshape_and_cache_kernel[(key.shape[0],)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_size,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PAD=triton.next_power_of_2(head_size),
    )
