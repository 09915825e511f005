"""Suite-wide set-up, and the fixtures several test modules share.

Triton kernels run on CUDA tensors; on a CPU-only host the tests run them under Triton's
interpreter, which must be chosen before any ``@triton.jit`` function is decorated, so it is set
here, before test modules import ``kvbridge.kernels``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["_redis_fixture", "_redis_cluster_fixture"]


@pytest.fixture
def pair_factory():
    """``build(**kwargs)`` makes a loopback P/D pair (``_pd_builders.make_pd_pair``); every pair
    built is closed after the test."""
    from _pd_builders import make_pd_pair  # after TRITON_INTERPRET is set

    pairs = []

    def build(**kwargs):
        pair = make_pd_pair(**kwargs)
        pairs.append(pair)
        return pair

    yield build
    for pair in pairs:
        pair.close()
