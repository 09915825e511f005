"""Row copies between KV tensors and staging buffers that run on the calling thread on CPU.

Why not torch's own ops on CPU: ``copy_``, ``index_select`` and ``index_copy_`` split even a
few blocks over torch's intra-op (OpenMP) threads, and on a host with fewer free cores than busy
threads (several engine processes, a store, their connector threads) such a copy waits for a
descheduled thread, far longer than the copy itself; numpy copies each row with one memcpy on
the calling thread, at about the same speed on a quiet core (docs/architecture.md, "Design
measurements": "row copies on the calling thread"). On other devices these are torch's ops.

Every function takes torch tensors of one device with rows along dim 0; on CPU they are seen
as bytes (any dtype, bfloat16 included); strided rows (a part of each block: ``row_bytes_view``
in ``transport.staging``) are fine. Ids are trusted: range-checked by the caller.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["copy_rows", "put_rows", "take_rows"]


def _rows(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s rows (dim 0) as a 1-d numpy array of opaque elements, one per row (a
    ``void`` dtype of the row's bytes), sharing its memory: numpy then moves each row with one
    memcpy. Each row's bytes must be contiguous; the rows themselves may be strided."""
    if tensor.dim() == 1:
        tensor = tensor.unsqueeze(1)
    elif tensor.dim() > 2:
        tensor = tensor.view(tensor.shape[0], -1)  # raises rather than copy (a copy would
        # take the writes) where a row's bytes are not contiguous
    rows = tensor.view(torch.uint8).numpy()
    return rows.view(np.dtype((np.void, rows.shape[1]))).reshape(rows.shape[0])


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` (same shape and dtype, same device). Mutates ``dst``. Any thread."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
        return
    np.copyto(_rows(dst), _rows(src))


def take_rows(dst: torch.Tensor, src: torch.Tensor, ids: torch.Tensor) -> None:
    """``dst[i] = src[ids[i]]`` (``ids``: int64 ``[n]`` on the tensors' device, any order,
    repeats allowed). Mutates ``dst``. Any thread."""
    if dst.device.type != "cpu":
        torch.index_select(src, 0, ids, out=dst)
        return
    rows, out = _rows(src), _rows(dst)
    if rows.flags.c_contiguous and out.flags.c_contiguous:
        np.take(rows, ids.numpy(), out=out, mode="clip")  # "clip" writes ``out`` directly
    else:  # strided rows: ``take`` would first copy the whole of ``src``
        out[...] = rows[ids.numpy()]


def put_rows(dst: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[ids[i]] = src[i]`` (``ids``: int64 ``[n]``, distinct). Mutates ``dst``. Any
    thread."""
    if dst.device.type != "cpu":
        dst.index_copy_(0, ids, src)
        return
    _rows(dst)[ids.numpy()] = _rows(src)
