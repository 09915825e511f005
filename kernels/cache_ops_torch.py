"""Torch reference twins of the KV cache kernels in ``cache_ops_triton``.

Each function has the same signature and effect as its Triton twin; ``cache_ops`` validates the
arguments and picks one of the two. These functions assume validated input (see ``cache_ops``
for the contracts) and run on any device; on CPU they are the production path, so the bulk
movers copy one block per memcpy inside one C call (numpy's ``take`` and fancy assignment on
CPU, ``index_select`` / ``index_copy_`` elsewhere) rather than in Python loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

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

    On CPU numpy's ``take`` (ids range-checked upstream, so ``mode="clip"``, which writes
    ``out`` directly) copies each block with one memcpy on the calling thread. Not
    ``index_select``: it splits even a few blocks over torch's intra-op threads, and where a
    host has fewer free cores than busy threads the copy then waits for a descheduled one.
    Inside a vLLM worker on the 2-core host, offload snapshots of at most 32 blocks took up to
    171 ms that way (2.6 s over a 200-request trace replay, ``bench_vllm_prefix.py --replay``),
    0.19 s in all this way; on a quiet core both run at about a memcpy's speed
    (``benchmarks/bench_kernels.py``). Elsewhere ``index_select``.
    """
    if block_ids.device.type == "cpu" and staging.device.type == "cpu":
        ids = block_ids.numpy()
        for layer_idx, kv_cache in enumerate(kv_caches):
            np.take(_as_byte_rows(kv_cache), ids, out=_as_byte_rows(staging[layer_idx]),
                    mode="clip")
        return staging
    for layer_idx, kv_cache in enumerate(kv_caches):
        torch.index_select(kv_cache, 0, block_ids, out=staging[layer_idx])
    return staging


def _as_byte_rows(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU ``[rows, ...]`` tensor as a numpy array of ``rows`` opaque elements, one
    per row (a ``void`` dtype the size of a row), sharing the tensor's memory; any torch dtype,
    bfloat16 included, since only bytes are seen."""
    rows = tensor.reshape(tensor.shape[0], -1).view(torch.uint8).numpy()
    return rows.view(np.dtype((np.void, rows.shape[1]))).reshape(rows.shape[0])


def scatter_blocks_torch(
    staging: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """``kv_caches[l][block_ids[i]] = staging[l, i]`` for every layer ``l`` (ids are distinct,
    checked upstream).

    On CPU numpy's fancy assignment moves each block with one memcpy (about a contiguous copy's
    speed, well above ``index_copy_`` even on 16-byte elements; docs/architecture.md, "Design
    measurements"); elsewhere ``index_copy_``.
    """
    if block_ids.device.type == "cpu" and staging.device.type == "cpu":
        ids = block_ids.numpy()
        for layer_idx, kv_cache in enumerate(kv_caches):
            _as_byte_rows(kv_cache)[ids] = _as_byte_rows(staging[layer_idx])
        return
    for layer_idx, kv_cache in enumerate(kv_caches):
        _as_wide_rows(kv_cache).index_copy_(0, block_ids, _as_wide_rows(staging[layer_idx]))
