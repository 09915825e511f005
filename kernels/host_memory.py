"""Host memory for KV tensors and staging buffers: 2 MiB-aligned and advised as huge pages.

UCX moves host memory between processes on one host with CMA (``process_vm_readv``), which pins
every page it copies: on 2 MiB pages it runs far faster than on 4 KiB pages
(docs/architecture.md, "Design measurements"). Transparent huge pages are often in ``madvise``
mode, so memory is only huge when asked, before it is first touched.
"""

from __future__ import annotations

import ctypes
import os

import torch

__all__ = ["HUGE_PAGE_BYTES", "host_buffer", "host_zeros"]

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def host_buffer(nbytes: int) -> torch.Tensor:
    """A flat ``uint8`` CPU tensor of ``nbytes`` (uninitialised) starting on a 2 MiB boundary,
    its whole huge pages advised as transparent huge pages (``madvise(MADV_HUGEPAGE)``).

    Where ``madvise`` is unavailable or refused the buffer is still valid, on small pages.
    Buffers under 2 MiB are plain tensors.
    """
    if nbytes < HUGE_PAGE_BYTES or _libc is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    buffer = raw[offset : offset + nbytes]  # a view: keeps ``raw`` alive
    advised = nbytes - nbytes % HUGE_PAGE_BYTES
    _libc.madvise(
        ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(advised), ctypes.c_int(_MADV_HUGEPAGE)
    )
    return buffer


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of ``shape`` and ``dtype`` on ``host_buffer`` memory."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return host_buffer(nbytes).view(dtype).view(shape).zero_()
