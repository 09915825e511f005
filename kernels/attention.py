"""Paged attention over block tables: ``AttentionMetadata``, prefill (varlen) and decode.

A step's batch is flattened (varlen): request ``r`` owns query rows
``query_start_loc[r] : query_start_loc[r + 1]``, which are its positions
``seq_lens[r] - query_len_r .. seq_lens[r] - 1``. Its context (all positions ``< seq_lens[r]``,
including this step's tokens, already written by ``reshape_and_cache``) is read from the KV
cache through ``block_table[r]``: logical block ``j`` (positions ``j*block_size ..
(j+1)*block_size - 1``) lives in physical block ``block_table[r, j]``. Causal: position ``p``
sees keys ``k <= p``; with a sliding window ``W`` only ``p - W < k <= p``, so blocks wholly
before the window are never read and may be the null block 0 (vLLM's ``SlidingWindowManager``
replaces them with the null block). Source: vLLM v1 ``FlashAttentionMetadata`` and
``vllm/attention/ops/triton_unified_attention.py`` (semantics, not code).
"""

from __future__ import annotations

import dataclasses

import torch

from .attention_torch import paged_attention_decode_torch, paged_attention_prefill_torch
from .dispatch import should_use_triton


@dataclasses.dataclass(slots=True)
class AttentionMetadata:
    """Per KV cache group, per step inputs of paged attention (one object shared by every
    layer of the group).

    Fields:
        query_start_loc: int32/int64 ``[num_reqs + 1]``, cumulative query lengths, starts at 0.
        seq_lens: int32/int64 ``[num_reqs]``, tokens in context after this step (incl. new).
        block_table: int32/int64 ``[num_reqs, max_blocks_per_req]``, logical block -> physical
            block id; unused entries are 0 (the null block).
        slot_mapping: int64 ``[num_tokens]``, ``block_id * block_size + offset`` for each
            query token; ``-1`` means "do not write this token's K/V".
        block_size: tokens per block of this group.
        sliding_window: window in tokens for a sliding-window group, ``None`` for full attention.
        max_query_len, max_seq_len: maxima of the query lengths and ``seq_lens``; computed
            (one host sync) when left ``None``.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    sliding_window: int | None = None
    max_query_len: int | None = None
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_query_len is None:
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self.max_query_len = int(query_lens.max()) if query_lens.numel() else 0
        if self.max_seq_len is None:
            self.max_seq_len = int(self.seq_lens.max()) if self.seq_lens.numel() else 0

    @property
    def num_reqs(self) -> int:
        """Requests in the batch."""
        return self.seq_lens.shape[0]

    @property
    def num_actual_tokens(self) -> int:
        """Query tokens in the batch (rows of ``slot_mapping``)."""
        return self.slot_mapping.shape[0]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    *,
    scale: float,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Attention of this step's queries over the paged context: the decode kernel when every
    request has one query token, else the prefill kernel. Shapes, dtypes and the result as
    ``paged_attention_prefill`` (``kv_cache`` is read only; ``out`` is a new tensor).

    Raises:
        ValueError: when ``kv_cache``'s block size differs from ``attn_metadata.block_size``, or
            as ``paged_attention_prefill`` / ``paged_attention_decode``.
    """
    if kv_cache.shape[2] != attn_metadata.block_size:
        raise ValueError(
            f"kv_cache block size {kv_cache.shape[2]} != metadata block_size "
            f"{attn_metadata.block_size}"
        )
    if attn_metadata.max_query_len == 1 and query.shape[0] == attn_metadata.num_reqs:
        return paged_attention_decode(
            query, kv_cache, attn_metadata.seq_lens, attn_metadata.block_table,
            scale=scale, sliding_window=attn_metadata.sliding_window,
            max_seq_len=attn_metadata.max_seq_len, use_triton=use_triton,
        )
    return paged_attention_prefill(
        query, kv_cache, attn_metadata.query_start_loc, attn_metadata.seq_lens,
        attn_metadata.block_table, scale=scale, sliding_window=attn_metadata.sliding_window,
        max_query_len=attn_metadata.max_query_len, max_seq_len=attn_metadata.max_seq_len,
        use_triton=use_triton,
    )


def paged_attention_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention for a varlen batch over block tables.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, RoPE applied.
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (``layout``), holding
            every context token including this step's; read only.
        query_start_loc, seq_lens, block_table: as ``AttentionMetadata``.
        scale: softmax scale, usually ``head_size ** -0.5``.
        sliding_window: window in tokens, or ``None``.
        max_query_len, max_seq_len: optional hints (computed when ``None``).
        out: optional ``[num_tokens, num_heads, head_size]`` output, dtype of ``query``.

    Returns:
        ``out``: softmax in float32, result in ``query.dtype``. Grouped-query attention: query
        head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Raises:
        ValueError: on inconsistent shapes or devices, a query longer than its ``seq_len``, or a
            block table too short for ``seq_lens``.
    """
    num_tokens, _, _ = _check_query(query, kv_cache)
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)} must be [num_reqs + 1] with "
            f"seq_lens {tuple(seq_lens.shape)} [num_reqs]"
        )
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_start_loc.numel() and (
        int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens
    ):
        raise ValueError(f"query_start_loc must run from 0 to num_tokens={num_tokens}")
    if bool((query_lens < 0).any()) or bool((query_lens > seq_lens).any()):
        raise ValueError("every request needs 0 <= query_len <= seq_len")
    _check_block_table(block_table, seq_lens, kv_cache)
    if out is None:
        out = torch.empty_like(query)
    if seq_lens.numel() == 0 or num_tokens == 0:
        return out
    if should_use_triton(use_triton, query):
        from .attention_triton import paged_attention_prefill_triton

        if max_query_len is None:
            max_query_len = int(query_lens.max())
        return paged_attention_prefill_triton(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window,
            out, max_query_len,
        )
    return paged_attention_prefill_torch(
        query, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window, out
    )


def paged_attention_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Attention of one new token per request (position ``seq_lens[r] - 1``) over its context.

    Args:
        query: ``[num_reqs, num_heads, head_size]``; other arguments as
            ``paged_attention_prefill``.

    Returns:
        ``out`` ``[num_reqs, num_heads, head_size]`` in ``query.dtype``.

    Raises:
        ValueError: as ``paged_attention_prefill``; also when a ``seq_len`` is < 1.
    """
    _check_query(query, kv_cache)
    if seq_lens.dim() != 1 or seq_lens.shape[0] != query.shape[0]:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} must be [num_reqs] for query {tuple(query.shape)}"
        )
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError("decode needs seq_len >= 1 for every request")
    _check_block_table(block_table, seq_lens, kv_cache)
    if out is None:
        out = torch.empty_like(query)
    if seq_lens.numel() == 0:
        return out
    if should_use_triton(use_triton, query):
        from .attention_triton import paged_attention_decode_triton

        return paged_attention_decode_triton(
            query, kv_cache, seq_lens, block_table, scale, sliding_window, out
        )
    return paged_attention_decode_torch(
        query, kv_cache, seq_lens, block_table, scale, sliding_window, out
    )


def _check_query(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    if query.dim() != 3 or query.shape[2] != head_size or query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"query {tuple(query.shape)} must be [num_tokens, num_heads, {head_size}] with "
            f"num_heads a multiple of num_kv_heads={num_kv_heads}"
        )
    if query.device != kv_cache.device:
        raise ValueError(f"query is on {query.device}, kv_cache on {kv_cache.device}")
    return query.shape[0], query.shape[1], head_size


def _check_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, kv_cache: torch.Tensor
) -> None:
    if block_table.dim() != 2 or block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError(
            f"block_table {tuple(block_table.shape)} must be [num_reqs, max_blocks_per_req] "
            f"for {seq_lens.shape[0]} requests"
        )
    if seq_lens.numel() == 0:
        return
    num_blocks = kv_cache.shape[0]
    if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= num_blocks):
        raise ValueError(f"block_table holds a block id outside [0, {num_blocks})")
    block_size = kv_cache.shape[2]
    max_seq_len = int(seq_lens.max())
    if block_table.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_table has {block_table.shape[1]} blocks per request "
            f"({block_table.shape[1] * block_size} tokens), a request has seq_len {max_seq_len}"
        )
