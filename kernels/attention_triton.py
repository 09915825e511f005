"""Triton paged attention kernels (prefill over a varlen batch, and decode); twins of
``attention_torch``.

Both kernels walk the context in tiles of ``TILE_N`` token positions, independent of the page
block size: the physical block of every position in a tile is looked up in the block table
(``block_table[r, pos // BLOCK_SIZE]``), so any block size works and blocks outside the
causal / sliding-window range are never loaded. Softmax is online (Milakov & Gimelshein 2018, as
in FlashAttention, Dao et al. 2022) and accumulated in float32. Masked scores are a large finite
negative number, not -inf, so a tile in which a row sees nothing yet produces no NaN; its
weights are wiped by the rescale once the row meets a visible key (every valid row sees at least
its own position). Offsets are int64; every tail is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASKED = tl.constexpr(-1.0e30)  # a global a compiled kernel may read must be a constexpr


@triton.jit
def _load_kv_tile(
    kv_cache_ptr,
    block_table_ptr,
    req_idx,
    kv_head_idx,
    key_pos,
    key_mask,
    dims,
    dim_mask,
    cache_block_stride,
    cache_kv_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    BLOCK_SIZE: tl.constexpr,
):
    """Keys and values ``[TILE_N, HEAD_SIZE_PAD]`` of KV head ``kv_head_idx`` at token positions
    ``key_pos`` of request ``req_idx``, through its block table (int64 offsets). Rows with
    ``key_mask`` False touch neither the table nor the cache and hold zeros."""
    physical = tl.load(
        block_table_ptr + req_idx * block_table_stride + key_pos // BLOCK_SIZE,
        mask=key_mask,
        other=0,
    ).to(tl.int64)
    kv_offsets = (
        physical[:, None] * cache_block_stride
        + (key_pos % BLOCK_SIZE)[:, None] * cache_slot_stride
        + kv_head_idx * cache_head_stride
        + dims[None, :]
    )
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(kv_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(kv_cache_ptr + cache_kv_stride + kv_offsets, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def paged_attention_prefill_kernel(
    out_ptr,
    query_ptr,
    kv_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    sliding_window,
    query_token_stride,
    query_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_kv_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    head_size,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program ``(r, h, m)``: query rows ``m*BLOCK_M ..`` of request ``r``, query head ``h``."""
    req_idx = tl.program_id(0)
    head_idx = tl.program_id(1)
    tile_m = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req_idx).to(tl.int64)
    q_end = tl.load(query_start_loc_ptr + req_idx + 1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req_idx).to(tl.int64)
    query_len = q_end - q_start
    if tile_m * BLOCK_M < query_len:
        kv_head_idx = head_idx // NUM_QUERIES_PER_KV
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < query_len
        # | cached context ...... | this step's queries |
        # 0              seq_len - query_len          seq_len
        query_pos = seq_len - query_len + rows
        dims = tl.arange(0, HEAD_SIZE_PAD).to(tl.int64)
        dim_mask = dims < head_size
        q = tl.load(
            query_ptr + (q_start + rows)[:, None] * query_token_stride
            + head_idx * query_head_stride + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], _MASKED, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], dtype=tl.float32)

        first_pos = seq_len - query_len + tile_m * BLOCK_M
        last_pos = tl.minimum(first_pos + BLOCK_M, seq_len) - 1
        # Keys any row of this tile may see: [window_start, last_pos]. Positions outside are
        # never loaded: their blocks may be the null block (sliding window) holding anything.
        window_start = first_pos * 0
        if USE_SLIDING_WINDOW:
            window_start = tl.maximum(first_pos - sliding_window + 1, 0)
        key_begin = (window_start // TILE_N) * TILE_N
        for tile_start in range(key_begin, last_pos + 1, TILE_N):
            key_pos = tile_start + tl.arange(0, TILE_N).to(tl.int64)
            key_in_seq = (key_pos >= window_start) & (key_pos <= last_pos)
            k, v = _load_kv_tile(
                kv_cache_ptr, block_table_ptr, req_idx, kv_head_idx, key_pos, key_in_seq,
                dims, dim_mask, cache_block_stride, cache_kv_stride, cache_slot_stride,
                cache_head_stride, block_table_stride, BLOCK_SIZE,
            )

            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            visible = (key_pos[None, :] <= query_pos[:, None]) & row_mask[:, None]
            if USE_SLIDING_WINDOW:
                visible = visible & (query_pos[:, None] - key_pos[None, :] < sliding_window)
            scores = tl.where(visible, scores, _MASKED)
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(v.dtype), v, input_precision=DOT_PRECISION
            )
            m_i = m_new

        result = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + rows)[:, None] * out_token_stride
            + head_idx * out_head_stride + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )


@triton.jit
def paged_attention_decode_kernel(
    out_ptr,
    query_ptr,
    kv_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    scale,
    sliding_window,
    query_token_stride,
    query_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_kv_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    head_size,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
):
    """Program ``(r, g)``: the query heads of KV head ``g`` for request ``r``'s one new token
    (position ``seq_len - 1``); products are broadcast-and-sum, so any group size works."""
    req_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req_idx).to(tl.int64)
    query_pos = seq_len - 1
    heads = kv_head_idx * NUM_QUERIES_PER_KV + tl.arange(0, GROUP_PAD).to(tl.int64)
    head_mask = tl.arange(0, GROUP_PAD) < NUM_QUERIES_PER_KV
    dims = tl.arange(0, HEAD_SIZE_PAD).to(tl.int64)
    dim_mask = dims < head_size
    q = tl.load(
        query_ptr + req_idx.to(tl.int64) * query_token_stride
        + heads[:, None] * query_head_stride + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full([GROUP_PAD], _MASKED, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_SIZE_PAD], dtype=tl.float32)

    key_begin = query_pos * 0
    if USE_SLIDING_WINDOW:
        key_begin = tl.maximum(query_pos - sliding_window + 1, 0)
    key_begin = (key_begin // TILE_N) * TILE_N
    for tile_start in range(key_begin, seq_len, TILE_N):
        key_pos = tile_start + tl.arange(0, TILE_N).to(tl.int64)
        visible = key_pos < seq_len
        if USE_SLIDING_WINDOW:
            visible = visible & (query_pos - key_pos < sliding_window)
        k, v = _load_kv_tile(
            kv_cache_ptr, block_table_ptr, req_idx, kv_head_idx, key_pos, visible,
            dims, dim_mask, cache_block_stride, cache_kv_stride, cache_slot_stride,
            cache_head_stride, block_table_stride, BLOCK_SIZE,
        )
        k = k.to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(visible[None, :], scores, _MASKED)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    result = acc / l_i[:, None]
    tl.store(
        out_ptr + req_idx.to(tl.int64) * out_token_stride
        + heads[:, None] * out_head_stride + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dim_mask[None, :],
    )


_BLOCK_M = 16
_TILE_N = 16


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def paged_attention_prefill_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    max_query_len: int,
) -> torch.Tensor:
    """Twin of ``paged_attention_prefill_torch``; ``tl.dot`` in IEEE fp32 for float32 inputs
    (no TF32), so results match the twin to float32 rounding."""
    query = _contiguous_last(query)
    block_table = _contiguous_last(block_table)
    num_reqs = seq_lens.shape[0]
    num_heads, head_size = query.shape[1], query.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    grid = (num_reqs, num_heads, triton.cdiv(max_query_len, _BLOCK_M))
    paged_attention_prefill_kernel[grid](
        out, query, kv_cache, block_table, query_start_loc.contiguous(), seq_lens.contiguous(),
        scale, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0), head_size,
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=_BLOCK_M,
        TILE_N=_TILE_N,
        HEAD_SIZE_PAD=max(16, triton.next_power_of_2(head_size)),
        USE_SLIDING_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out


def paged_attention_decode_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Twin of ``paged_attention_decode_torch``."""
    query = _contiguous_last(query)
    block_table = _contiguous_last(block_table)
    num_reqs = seq_lens.shape[0]
    num_heads, head_size = query.shape[1], query.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_queries_per_kv = num_heads // num_kv_heads
    paged_attention_decode_kernel[(num_reqs, num_kv_heads)](
        out, query, kv_cache, block_table, seq_lens.contiguous(),
        scale, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0), head_size,
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        GROUP_PAD=triton.next_power_of_2(num_queries_per_kv),
        BLOCK_SIZE=block_size,
        TILE_N=_TILE_N,
        HEAD_SIZE_PAD=triton.next_power_of_2(head_size),
        USE_SLIDING_WINDOW=sliding_window is not None,
    )
    return out
