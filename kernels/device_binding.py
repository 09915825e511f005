"""Binding a thread to the KV tensors' device: the one place every thread kvbridge starts for KV
work (docs/architecture.md, "Threads and ownership") takes its device from.

CUDA keeps a current device per thread and a new thread starts on device 0. Triton kernels
(``kvbridge.kernels.cache_ops``) launch on the current device and its current stream, and
``torch.empty(..., device="cuda")`` allocates there, so a thread that gathers or scatters blocks
of KV tensors on ``cuda:1`` without binding would launch its kernels on ``cuda:0`` with pointers
into another device. ``bind_device`` is a no-op for CPU tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["bind_device", "bound", "resolve_device"]

T = TypeVar("T")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` with an index for CUDA (``"cuda"`` alone: the calling
    thread's current device); None means CPU.

    Raises:
        ValueError: not a device name torch knows.
    """
    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: {exc}") from None
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (``torch.cuda.set_device``);
    a no-op for any other device type. Call it first thing on a thread that will touch KV
    tensors on ``device`` (``bound`` wraps a thread's target or an executor's initializer).

    Raises:
        ValueError: a CUDA device without an index (``resolve_device`` it first).
    """
    if device.type != "cuda":
        return
    if device.index is None:
        raise ValueError("bind_device needs an indexed CUDA device (resolve_device)")
    torch.cuda.set_device(device.index)


def bound(device: torch.device | str | None, fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` that first binds the calling thread to ``device`` (resolved now, on the creating
    thread): the target of a ``threading.Thread`` or the ``initializer`` of a
    ``ThreadPoolExecutor`` that works on KV tensors of ``device``."""
    resolved = resolve_device(device)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        bind_device(resolved)  # looked up at call time: tests record the binding here
        return fn(*args, **kwargs)

    return run
