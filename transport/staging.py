"""Reusable staging buffers for chunked transfers, and their UCX-facing byte views.

Buffers are flat ``uint8`` tensors of a fixed capacity on the KV tensors' device, kept in a free
list and reused, because UCX registers memory on first use and a registration hit is much cheaper
than a fresh one. A chunk of ``n`` blocks of ``L`` layers views the first
``L * n * block_nbytes`` bytes as ``[L, n, *block_shape]`` in the KV dtype
(kvbridge.kernels.layout, "staging buffer").
"""

from __future__ import annotations

from typing import Any

import torch


class StagingPool:
    """Free list of flat byte buffers of ``capacity_bytes`` on ``device``.

    ``acquire`` never fails (allocates when the list is empty); ``release`` returns a buffer.
    ``num_outstanding`` counts buffers acquired and not released (tests check it reaches 0).
    """

    def __init__(self, capacity_bytes: int, device: torch.device):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.device = device
        self._free: list[torch.Tensor] = []
        self.num_outstanding = 0

    def acquire(self) -> torch.Tensor:
        self.num_outstanding += 1
        if self._free:
            return self._free.pop()
        return torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)

    def release(self, buffer: torch.Tensor) -> None:
        if self.num_outstanding <= 0:
            raise RuntimeError(f"release with {self.num_outstanding} buffers outstanding")
        self.num_outstanding -= 1
        self._free.append(buffer)

    def forget(self, buffer: torch.Tensor) -> None:
        """Stop tracking a buffer that UCX may still write or read (a send or receive that could
        not be cancelled): it is never handed out again and is freed when UCX drops it."""
        if self.num_outstanding <= 0:
            raise RuntimeError(f"forget with {self.num_outstanding} buffers outstanding")
        self.num_outstanding -= 1
        del buffer


def chunk_view(
    buffer: torch.Tensor,
    num_layers: int,
    num_blocks: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[num_layers, num_blocks, *block_shape]`` view of the front of a flat byte buffer.

    Raises:
        ValueError: the buffer is too small.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = num_layers * num_blocks
    for size in block_shape:
        numel *= size
    nbytes = numel * itemsize
    if nbytes > buffer.numel():
        raise ValueError(f"chunk of {nbytes} bytes does not fit a {buffer.numel()}-byte buffer")
    return buffer[:nbytes].view(dtype).view(num_layers, num_blocks, *block_shape)


def wire_buffer(tensor: torch.Tensor) -> Any:
    """An object UCX can send from / receive into without a copy: the tensor itself on CUDA
    (``__cuda_array_interface__``), a numpy byte view of host memory on CPU."""
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat.numpy()
    return flat


def synchronize(tensor: torch.Tensor) -> None:
    """Wait for kernels writing ``tensor`` (a no-op on CPU) before UCX reads it."""
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()
