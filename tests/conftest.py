"""Suite-wide set-up.

Triton kernels run on CUDA tensors; on a CPU-only host the tests run them under Triton's
interpreter, which must be chosen before any ``@triton.jit`` function is decorated, so it is set
here, before test modules import ``kvbridge.kernels``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["_redis_fixture", "_redis_cluster_fixture"]
