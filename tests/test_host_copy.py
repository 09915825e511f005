"""``kvbridge.kernels.host_copy``: the CPU row copies give torch's results bit for bit, on whole
blocks and on the strided part of each block a tensor-parallel rank moves, in any dtype; and
they call none of torch's CPU copy ops, which hand work to intra-op threads that on a busy host
wait for a core (the module docstring)."""

from __future__ import annotations

import pytest
import torch
from kvbridge.kernels.host_copy import copy_rows, put_rows, take_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


def _blocks(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[num_blocks, 2, 4, 3, 5]`` like a KV layer: random bits of ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks, 2 * 4 * 3 * 5 * dtype.itemsize), dtype=torch.uint8,
                        generator=generator)
    return raw.view(dtype).view(num_blocks, 2, 4, 3, 5)


def _part(blocks: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The ``[offset, offset + nbytes)`` bytes of every block: strided rows (a rank's heads)."""
    return blocks.reshape(blocks.shape[0], -1).view(torch.uint8)[:, offset:offset + nbytes]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(a.shape[0], -1).view(torch.uint8),
                       b.reshape(b.shape[0], -1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_take_rows_gathers_like_index_select_repeats_and_any_order_included(dtype):
    src = _blocks(9, dtype, seed=1)
    ids = torch.tensor([8, 0, 3, 8, 5])
    out = torch.empty(5, *src.shape[1:], dtype=dtype)
    take_rows(out, src, ids)
    assert _same_bits(out, src[ids])


@pytest.mark.parametrize("dtype", DTYPES)
def test_put_rows_scatters_like_index_copy_and_leaves_other_rows_alone(dtype):
    dst, src = _blocks(9, dtype, seed=2), _blocks(3, dtype, seed=3)
    expected = dst.clone()
    ids = torch.tensor([7, 2, 4])
    expected[ids] = src
    put_rows(dst, ids, src)
    assert _same_bits(dst, expected)


def test_copy_rows_copies_a_run_of_blocks():
    src, dst = _blocks(6, torch.bfloat16, seed=4), _blocks(6, torch.bfloat16, seed=5)
    expected = dst.clone()
    expected[1:4] = src[2:5]
    copy_rows(dst[1:4], src[2:5])
    assert _same_bits(dst, expected)


def test_the_strided_part_of_each_block_moves_alone():
    blocks = _blocks(7, torch.float32, seed=6)
    before = blocks.clone()
    offset, nbytes = 40, 80  # a rank's part of each block (strided rows of 80 bytes)
    rows = _part(blocks, offset, nbytes)
    ids = torch.tensor([6, 1, 1, 4])
    staging = torch.empty(4, nbytes, dtype=torch.uint8)
    take_rows(staging, rows, ids)
    assert torch.equal(staging, rows[ids])
    new = torch.randint(0, 256, (2, nbytes), dtype=torch.uint8)
    put_rows(rows, torch.tensor([0, 5]), new)
    copy_rows(rows[2:4], new)
    expected = _part(before.clone(), offset, nbytes).clone()
    expected[torch.tensor([0, 5])] = new
    expected[2:4] = new
    assert torch.equal(_part(blocks, offset, nbytes), expected)
    # the bytes outside the part are untouched
    whole, was = _part(blocks, 0, blocks[0].nbytes), _part(before, 0, before[0].nbytes)
    assert torch.equal(whole[:, :offset], was[:, :offset])
    assert torch.equal(whole[:, offset + nbytes:], was[:, offset + nbytes:])


def test_on_cpu_none_of_torch_s_copy_ops_runs(monkeypatch):
    # torch would run these copies over its intra-op pool; host_copy copies on the calling
    # thread instead, so none of them may be called here.
    src, dst = _blocks(5, torch.float32, seed=7), _blocks(5, torch.float32, seed=8)
    ids, one = torch.tensor([4, 0]), torch.tensor([3])
    for name in ("index_select", "index_copy_", "copy_"):
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"torch's {_name} was called")
        if name == "index_select":
            monkeypatch.setattr(torch, name, refuse)
        else:
            monkeypatch.setattr(torch.Tensor, name, refuse)
    take_rows(dst[:2], src, ids)
    put_rows(dst, one, src[1:2])
    copy_rows(dst[4:5], src[2:3])
    monkeypatch.undo()
    assert _same_bits(dst[:2], src[ids])  # (random bits: NaNs too, so bits, not values)
    assert _same_bits(dst[3:5], src[1:3])


def test_rows_whose_bytes_are_not_contiguous_raise_instead_of_copying_into_a_temporary():
    blocks = _blocks(4, torch.float32, seed=9)
    every_other = blocks[:, :, ::2]  # a row's bytes are not one run: writes would be lost
    with pytest.raises(RuntimeError):
        copy_rows(every_other, torch.zeros_like(every_other))
