"""The one dispatch point between Triton kernels and their torch twins.

Rule: a call runs the Triton kernel when its tensors are on a CUDA device, the torch twin
otherwise. Every public op takes ``use_triton: bool | None = None``; ``None`` applies the rule,
``True`` forces Triton (on CPU tensors this only works under Triton's interpreter,
``TRITON_INTERPRET=1``, which must be set before ``triton`` is imported; tests/conftest.py does
that on CPU hosts), ``False`` forces the twin.

``set_default_use_triton`` changes what ``None`` means for the whole process (tests use it to run
the reference decoder end to end on the Triton kernels under the interpreter).
"""

from __future__ import annotations

import os

import torch

_default_use_triton: bool | None = None


def set_default_use_triton(use_triton: bool | None) -> None:
    """Set what ``use_triton=None`` means: ``None`` (device rule), ``True`` or ``False``."""
    global _default_use_triton
    _default_use_triton = use_triton


def triton_interpreted() -> bool:
    """True when Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def should_use_triton(use_triton: bool | None, tensor: torch.Tensor) -> bool:
    """Resolve a ``use_triton`` argument against the device of ``tensor``.

    Raises:
        ValueError: if Triton is forced on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if use_triton is None:
        use_triton = _default_use_triton
    if use_triton is None:
        return tensor.is_cuda
    if use_triton and not tensor.is_cuda and not triton_interpreted():
        raise ValueError(
            "use_triton=True on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return use_triton
