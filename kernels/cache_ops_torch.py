"""Torch reference twins of the KV cache kernels in ``cache_ops_triton``.

Each function has the same signature and effect as its Triton twin; ``cache_ops`` validates the
arguments and picks one of the two. These functions assume validated input (see ``cache_ops``
for the contracts) and run on any device; on CPU they are the production path, so the bulk
movers copy one block per memcpy inside one C call (numpy's ``take`` and fancy assignment on
CPU, ``index_select`` / ``index_copy_`` elsewhere) rather than in Python loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .host_copy import put_rows, take_rows

_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _as_wide_rows(tensor: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``[rows, ...]`` tensor as ``[rows, k]`` of the widest plain dtype that
    divides a row (16-byte complex128 first). ``index_copy_`` copies element by element on CPU,
    so wider elements bring a block scatter closer to memcpy speed (benchmarks/bench_kernels.py;
    docs/architecture.md, "Design measurements"). Bits are copied unchanged."""
    rows = tensor.reshape(tensor.shape[0], -1)
    row_bytes = rows.shape[1] * rows.element_size()
    offset_bytes = rows.storage_offset() * rows.element_size()
    for dtype in _WIDE_DTYPES:
        width = torch.empty((), dtype=dtype).element_size()
        if row_bytes % width == 0 and offset_bytes % width == 0:
            return rows.view(dtype)
    return rows


def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[t]`` / ``value[t]`` to slot ``slot_mapping[t]`` of ``kv_cache``; -1 skips."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_idx = torch.div(slot_mapping, block_size, rounding_mode="floor")
    block_offset = slot_mapping - block_idx * block_size
    kv_cache[block_idx, 0, block_offset] = key.to(kv_cache.dtype)
    kv_cache[block_idx, 1, block_offset] = value.to(kv_cache.dtype)


def copy_blocks_torch(kv_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For every layer and every row ``(src, dst)`` of ``block_mapping``: block dst := block src.

    All sources are read before any destination is written (gather, then scatter), so a chain
    such as ``[(1, 2), (2, 3)]`` copies the old contents of block 2 into block 3.
    """
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0]
    dst_ids = block_mapping[:, 1]
    for kv_cache in kv_caches:
        rows = _as_wide_rows(kv_cache)
        rows.index_copy_(0, dst_ids, rows.index_select(0, src_ids))


def gather_blocks_torch(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, staging: torch.Tensor
) -> torch.Tensor:
    """``staging[l, i] = kv_caches[l][block_ids[i]]`` for every layer ``l``; returns ``staging``.

    ``host_copy.take_rows``: on CPU one memcpy per block on the calling thread, not over
    torch's intra-op threads (docs/architecture.md, "Design measurements": "row copies on the
    calling thread"); elsewhere ``index_select``.
    """
    for layer_idx, kv_cache in enumerate(kv_caches):
        take_rows(staging[layer_idx], kv_cache, block_ids)
    return staging


def scatter_blocks_torch(
    staging: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """``kv_caches[l][block_ids[i]] = staging[l, i]`` for every layer ``l`` (ids are distinct,
    checked upstream).

    On CPU ``host_copy.put_rows``: numpy's fancy assignment moves each block with one memcpy on
    the calling thread (about a contiguous copy's speed, well above ``index_copy_`` even on
    16-byte elements; docs/architecture.md, "Design measurements"); elsewhere ``index_copy_``.
    """
    if block_ids.device.type == "cpu" and staging.device.type == "cpu":
        for layer_idx, kv_cache in enumerate(kv_caches):
            put_rows(kv_cache, block_ids, staging[layer_idx])
        return
    for layer_idx, kv_cache in enumerate(kv_caches):
        _as_wide_rows(kv_cache).index_copy_(0, block_ids, _as_wide_rows(staging[layer_idx]))
