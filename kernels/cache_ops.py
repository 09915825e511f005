"""Public KV cache ops: slot writes, block copy, gather/scatter to a staging buffer.

Each op validates its arguments (a caller mistake raises ``ValueError``), then runs the Triton
kernel (``cache_ops_triton``) or the torch twin (``cache_ops_torch``) as ``dispatch`` decides.
The tensor layout is defined once, in ``layout``: one layer's KV cache is
``(num_blocks, 2, block_size, num_kv_heads, head_size)``, block axis first.

Semantics follow vLLM's ``csrc/cache_kernels.cu`` (``reshape_and_cache``, ``copy_blocks``) and
the gather/scatter of vLLM's NIXL connector, which moves whole blocks per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache_ops_torch import (
    copy_blocks_torch,
    gather_blocks_torch,
    reshape_and_cache_torch,
    scatter_blocks_torch,
)
from .dispatch import should_use_triton
from .layout import check_block_ids, check_kv_caches, first_out_of_range, staging_shape


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Write this step's K and V into their slots of one layer's KV cache.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, any float dtype (cast to the
            cache dtype).
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``, mutated in place:
            ``kv_cache[s // block_size, 0, s % block_size] = key[t]`` (and ``1``/``value``) for
            ``s = slot_mapping[t]``.
        slot_mapping: int ``[num_tokens]``, ``block_id * block_size + offset``; ``-1`` means the
            token is not written (vLLM's padding slot).

    Raises:
        ValueError: on mismatched shapes or devices, or a slot outside
            ``[-1, num_blocks * block_size)`` (naming it).
    """
    check_kv_caches([kv_cache])
    num_blocks, _, block_size, num_kv_heads, head_size = kv_cache.shape
    expected = (slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1, num_kv_heads, head_size)
    if slot_mapping.dim() != 1 or key.shape != expected or value.shape != expected:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[num_tokens, {num_kv_heads}, {head_size}] with slot_mapping [num_tokens], "
            f"got slot_mapping {tuple(slot_mapping.shape)}"
        )
    if key.device != kv_cache.device or value.device != kv_cache.device:
        raise ValueError("key, value and kv_cache must be on the same device")
    slot_mapping = _check_slots(slot_mapping, num_blocks * block_size, kv_cache.device)
    if slot_mapping.numel() == 0:
        return
    if should_use_triton(use_triton, kv_cache):
        from .cache_ops_triton import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, kv_cache, slot_mapping)
    else:
        reshape_and_cache_torch(key, value, kv_cache, slot_mapping)


def copy_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Copy whole blocks within every layer of one KV cache group (copy-on-write).

    Args:
        kv_caches: the group's layers, each ``[num_blocks, 2, block_size, num_kv_heads,
            head_size]``; mutated in place.
        block_mapping: int ``[n, 2]``, rows ``(src_block_id, dst_block_id)``. All sources are
            read before any destination is written.

    Raises:
        ValueError: on a bad layout, an id outside ``[0, num_blocks)``, a repeated destination,
            or a destination that is also a source (the result would depend on order).
    """
    check_kv_caches(kv_caches)
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2], got {tuple(block_mapping.shape)}")
    num_blocks = kv_caches[0].shape[0]
    device = kv_caches[0].device
    src_ids = check_block_ids(block_mapping[:, 0], num_blocks, device)
    dst_ids = check_block_ids(block_mapping[:, 1], num_blocks, device)
    _check_distinct(dst_ids, "destination")
    if bool(torch.isin(dst_ids, src_ids).any()):
        raise ValueError("a destination block of copy_blocks is also a source block")
    if dst_ids.numel() == 0:
        return
    block_mapping = torch.stack([src_ids, dst_ids], dim=1).contiguous()
    if should_use_triton(use_triton, kv_caches[0]):
        from .cache_ops_triton import copy_blocks_triton

        copy_blocks_triton(kv_caches, block_mapping)
    else:
        copy_blocks_torch(kv_caches, block_mapping)


def gather_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    staging: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into one contiguous staging buffer.

    Args:
        kv_caches: the ``L`` layers of one KV cache group (same shape, dtype, device).
        block_ids: int64 ``[n]`` on the caches' device, any order, repeats allowed.
        staging: ``[L, n, 2, block_size, num_kv_heads, head_size]`` contiguous, same dtype and
            device as the caches; allocated when ``None``. Mutated: ``staging[l, i] =
            kv_caches[l][block_ids[i]]``. ``layout.staging_nbytes`` gives its size in bytes.

    Returns:
        ``staging``.

    Raises:
        ValueError: on a bad layout, an id outside ``[0, num_blocks)`` (naming it), or a staging
            buffer of the wrong shape, dtype, device, or not contiguous.
    """
    check_kv_caches(kv_caches)
    block_ids = check_block_ids(block_ids, kv_caches[0].shape[0], kv_caches[0].device)
    shape = staging_shape(kv_caches, block_ids.numel())
    if staging is None:
        staging = torch.empty(shape, dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    else:
        _check_staging(staging, shape, kv_caches[0])
    if block_ids.numel() == 0:
        return staging
    if should_use_triton(use_triton, kv_caches[0]):
        from .cache_ops_triton import gather_blocks_triton

        return gather_blocks_triton(kv_caches, block_ids, staging)
    return gather_blocks_torch(kv_caches, block_ids, staging)


def scatter_blocks(
    staging: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Copy a staging buffer into blocks ``block_ids`` of every layer (inverse of
    ``gather_blocks``).

    Args:
        staging: ``[L, n, 2, block_size, num_kv_heads, head_size]``, same dtype/device as the
            caches; read only.
        kv_caches: the ``L`` layers of one KV cache group; mutated: ``kv_caches[l][block_ids[i]]
            = staging[l, i]``.
        block_ids: int64 ``[n]``, distinct, any order.

    Raises:
        ValueError: on a bad layout, an id outside ``[0, num_blocks)``, a repeated id, or a
            staging buffer of the wrong shape, dtype or device.
    """
    check_kv_caches(kv_caches)
    block_ids = check_block_ids(block_ids, kv_caches[0].shape[0], kv_caches[0].device)
    _check_distinct(block_ids, "target")
    _check_staging(staging, staging_shape(kv_caches, block_ids.numel()), kv_caches[0])
    if block_ids.numel() == 0:
        return
    if should_use_triton(use_triton, kv_caches[0]):
        from .cache_ops_triton import scatter_blocks_triton

        scatter_blocks_triton(staging, kv_caches, block_ids)
    else:
        scatter_blocks_torch(staging, kv_caches, block_ids)


def _check_staging(staging: torch.Tensor, shape: tuple[int, ...], kv_cache: torch.Tensor) -> None:
    if tuple(staging.shape) != shape:
        raise ValueError(f"staging has shape {tuple(staging.shape)}, expected {shape}")
    if staging.dtype != kv_cache.dtype:
        raise ValueError(f"staging has dtype {staging.dtype}, the KV caches {kv_cache.dtype}")
    if staging.device != kv_cache.device:
        raise ValueError(f"staging is on {staging.device}, the KV caches on {kv_cache.device}")
    if not staging.is_contiguous():
        raise ValueError("staging must be contiguous")


def _check_distinct(block_ids: torch.Tensor, what: str) -> None:
    if block_ids.numel() < 2:
        return
    sorted_ids, _ = torch.sort(block_ids)
    repeated = sorted_ids[1:] == sorted_ids[:-1]
    if bool(repeated.any()):
        bad = int(sorted_ids[1:][repeated][0])
        raise ValueError(f"{what} block id {bad} appears more than once")


def _check_slots(slot_mapping: torch.Tensor, num_slots: int, device: torch.device) -> torch.Tensor:
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the KV cache on {device}")
    position = first_out_of_range(slot_mapping, -1, num_slots)
    if position is not None:
        raise ValueError(
            f"slot {int(slot_mapping[position])} at token {position} is outside "
            f"[-1, {num_slots})"
        )
    return slot_mapping.to(torch.int64)
