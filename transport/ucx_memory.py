"""Where the bytes UCX sends and receives live, decided once per transport (``wire_memory``).

KV tensors in host memory: UCX reads and writes them (and host staging) directly. KV tensors in
GPU memory: UCX can move device memory itself only when it was built with CUDA support and its
CUDA transports loaded in this process (ucxx-cu12's ``libucx-cu12`` is built with it; the CUDA
module needs the driver's ``libcuda.so.1``). That shows in the UCP context as the ``cuda_cpy``
memory domain (``ucx_memory_domains``). Then chunks go from and into device memory: staging on
the GPU, and a run of blocks straight from or into the KV tensor. Without it, UCX would take a
device pointer for host memory, so every chunk is staged through pinned host buffers
(``StagingPool(pinned=True)``): gathered on the GPU and copied to host before a send, copied to
the GPU and scattered after a receive (``staging.copy_out`` / ``copy_in`` across devices), and
no chunk is sent from or received into the KV tensor itself.
"""

from __future__ import annotations

import re
from typing import Literal

import torch

__all__ = [
    "WireMemory",
    "check_device_memory",
    "choose_wire_memory",
    "ucx_context_info",
    "ucx_handles_cuda",
    "ucx_memory_domains",
    "wire_device",
    "wire_memory",
]

WireMemory = Literal["host", "device", "staged"]
"""``"host"``: KV in host memory, sent as it is; ``"device"``: KV in GPU memory, sent by UCX
from device memory; ``"staged"``: KV in GPU memory, sent through pinned host staging."""

CUDA_MEMORY_DOMAIN = "cuda_cpy"
"""UCX's memory domain for CUDA memory (``uct/cuda/cuda_copy``): present when UCX can send from
and receive into device buffers."""

_COMPONENT = re.compile(r"^#\s*component\s+\d+\s*:\s*(\S+)", re.MULTILINE)


def wire_memory(kv_device: torch.device, *, ucx_cuda: bool) -> WireMemory:
    """How UCX moves blocks of KV tensors on ``kv_device``: ``"host"`` for CPU tensors,
    ``"device"`` for CUDA tensors when ``ucx_cuda`` (``ucx_handles_cuda``), else ``"staged"``.

    Raises:
        ValueError: a device type UCX cannot move at all (neither CPU nor CUDA).
    """
    if kv_device.type == "cpu":
        return "host"
    if kv_device.type != "cuda":
        raise ValueError(f"UCX cannot move KV tensors on {kv_device} (CPU or CUDA only)")
    return "device" if ucx_cuda else "staged"


def choose_wire_memory(kv_device: torch.device, device_memory: str | None) -> WireMemory:
    """``wire_memory`` for a transport: ``device_memory`` (``"device"`` / ``"staged"``) forces
    the choice for GPU KV; None asks this process's UCX (``ucx_handles_cuda``, only for GPU KV).
    """
    if device_memory is None:
        ucx_cuda = kv_device.type == "cuda" and ucx_handles_cuda()
    else:
        ucx_cuda = check_device_memory(device_memory) == "device"
    return wire_memory(kv_device, ucx_cuda=ucx_cuda)


def check_device_memory(device_memory: str | None) -> WireMemory | None:
    """``device_memory`` as given, when it is None, ``"device"`` or ``"staged"``.

    Raises:
        ValueError: any other value.
    """
    if device_memory not in (None, "device", "staged"):
        raise ValueError(f"device_memory must be 'device' or 'staged', got {device_memory!r}")
    return device_memory  # type: ignore[return-value]


def wire_device(memory: WireMemory, kv_device: torch.device) -> torch.device:
    """The device of the staging buffers UCX sends from and receives into: the KV tensors'
    own, except ``"staged"`` (the host)."""
    return torch.device("cpu") if memory == "staged" else kv_device


def ucx_memory_domains(context_info: str) -> frozenset[str]:
    """The component (memory domain) names of a UCP context's printed info
    (``ucp_context_print_info``: lines ``#     component 3  :  cuda_cpy``)."""
    return frozenset(_COMPONENT.findall(context_info))


def ucx_handles_cuda() -> bool:
    """Whether this process's UCX context can move CUDA memory (``CUDA_MEMORY_DOMAIN`` loaded).
    Call after ``ucx_init.init_ucx``.

    ucxx's own ``UCXContext.cuda_support`` is not used: it follows the ``TLS`` setting and is
    true on a host without a GPU or without UCX's CUDA module."""
    return CUDA_MEMORY_DOMAIN in ucx_memory_domains(ucx_context_info())


def ucx_context_info() -> str:
    """This process's UCP context as UCX prints it (components, memory domains, resources);
    empty where ucxx does not expose it (then GPU KV is staged: the safe choice)."""
    import ucxx  # imported only when UCX is used

    return str(getattr(ucxx.core._get_ctx().context, "info", ""))
