"""Host staging for offload: snapshots of paged KV blocks gathered into reusable host buffers
(``StagingPool``) in the ``gather_blocks`` staging layout the store's ``put`` payload uses."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from kvbridge.kernels import gather_blocks, staging_nbytes

__all__ = ["StagingPool", "snapshot_blocks", "staging_nbytes"]


def snapshot_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor
) -> None:
    """Copy blocks ``block_ids`` of one group's layers into ``out`` (mutated), a uint8 CPU
    tensor of ``staging_nbytes(kv_caches, len(block_ids))`` bytes, in the ``gather_blocks``
    staging layout ``[num_layers, n, 2, block_size, num_kv_heads, head_size]``. Device caches
    are gathered on the device and copied to host once (synchronously: ``out`` holds the bytes
    when this returns)."""
    first = kv_caches[0]
    shape = (len(kv_caches), len(block_ids), *first.shape[1:])
    staging = out.view(first.dtype).view(shape)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=first.device)
    if first.device.type == "cpu":
        gather_blocks(kv_caches, ids, staging)
    else:
        staging.copy_(gather_blocks(kv_caches, ids))


class StagingPool:
    """Reusable host buffers (uint8 CPU tensors) for snapshots. Thread-safe (one lock): a buffer
    is taken on the thread that snapshots and given back on the thread that sent it.

    A fresh tensor costs far more than its gather in first-touch page faults
    (``benchmarks/bench_store.py``), so buffers are kept: at most ``max_idle_bytes`` of them
    wait unused; a buffer given back beyond that is dropped.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 ``[>= nbytes]`` CPU buffer: the smallest idle one that fits, else a new one.
        Its contents are garbage; the caller owns it until ``give``."""
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fits:
                buffer = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
                self._idle_bytes -= buffer.numel()
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` (no longer read by anyone) for reuse; dropped if the pool is full."""
        with self._lock:
            if self._idle_bytes + buffer.numel() <= self.max_idle_bytes:
                self._idle.append(buffer)
                self._idle_bytes += buffer.numel()

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers waiting for reuse."""
        with self._lock:
            return self._idle_bytes
