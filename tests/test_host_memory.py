"""Host memory for KV tensors: huge-page aligned, zeroed, the asked shape and dtype."""

import pytest
import torch
from kvbridge.kernels.host_memory import HUGE_PAGE_BYTES, host_buffer, host_zeros
from kvbridge.kernels.model import ModelConfig
from kvbridge.kernels.model.decoder import allocate_kv_caches


@pytest.mark.parametrize(
    "nbytes", [1, HUGE_PAGE_BYTES - 1, HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES + 5]
)
def test_host_buffer_has_the_size_asked_and_large_ones_start_on_a_huge_page(nbytes):
    buffer = host_buffer(nbytes)
    assert (buffer.dtype, buffer.numel(), buffer.is_contiguous()) == (torch.uint8, nbytes, True)
    if nbytes >= HUGE_PAGE_BYTES:  # smaller buffers are plain tensors
        assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    buffer.fill_(7)  # writable over its whole length
    assert int(buffer[-1]) == 7


def test_host_zeros_is_zeroed_in_shape_and_dtype():
    tensor = host_zeros((300, 2, 16, 2, 16), torch.bfloat16)
    assert (tuple(tensor.shape), tensor.dtype) == ((300, 2, 16, 2, 16), torch.bfloat16)
    assert tensor.is_contiguous() and not tensor.any()


def test_cpu_kv_caches_live_on_huge_page_memory():
    caches = allocate_kv_caches(ModelConfig.tiny(), num_blocks=600, block_size=16)
    for tensor in caches.values():
        assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0  # > 2 MiB each, so huge-page aligned
        assert not tensor.any()
