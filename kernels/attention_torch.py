"""Torch reference twins of the paged attention kernels in ``attention_triton``.

Plain per-request loops: gather the request's context blocks through its block table (only the
blocks a sliding window can see), build the causal (+ window) mask, softmax in float32. They
assume arguments already validated by ``attention``.
"""

from __future__ import annotations

import torch


def paged_attention_prefill_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Varlen causal paged attention; see ``attention.paged_attention_prefill``."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_queries_per_kv = query.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for req_idx, seq_len in enumerate(lens):
        q_start, q_end = starts[req_idx], starts[req_idx + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        # Positions of this request:
        # | context already cached ............ | this step's queries |
        # 0                          first_query_pos            seq_len
        # A query at position p sees keys k with k <= p and, in a window W, p - k < W.
        first_query_pos = seq_len - query_len
        key_start = 0
        if sliding_window is not None:
            key_start = max(0, first_query_pos - sliding_window + 1)
        first_block = key_start // block_size
        last_block = (seq_len - 1) // block_size
        block_ids = block_table[req_idx, first_block : last_block + 1].to(torch.int64)
        blocks = kv_cache.index_select(0, block_ids).float()
        lo = key_start - first_block * block_size
        hi = seq_len - first_block * block_size
        keys = blocks[:, 0].reshape(-1, num_kv_heads, head_size)[lo:hi]
        values = blocks[:, 1].reshape(-1, num_kv_heads, head_size)[lo:hi]

        q = query[q_start:q_end].float().view(query_len, num_kv_heads, num_queries_per_kv, -1)
        scores = torch.einsum("qhgd,khd->hgqk", q, keys) * scale
        key_pos = torch.arange(key_start, seq_len, device=query.device)
        query_pos = torch.arange(first_query_pos, seq_len, device=query.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            visible &= query_pos[:, None] - key_pos[None, :] < sliding_window
        scores.masked_fill_(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result = torch.einsum("hgqk,khd->qhgd", probs, values)
        out[q_start:q_end] = result.reshape(query_len, -1, head_size).to(out.dtype)
    return out


def paged_attention_decode_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """One query per request; see ``attention.paged_attention_decode``."""
    num_reqs = query.shape[0]
    query_start_loc = torch.arange(num_reqs + 1, device=query.device)
    return paged_attention_prefill_torch(
        query, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window, out
    )
