"""KV cache ops and paged attention: torch twins against explicit expectations, Triton kernels
against their twins under ``TRITON_INTERPRET=1`` (exact for the copy kernels, within
``ATTENTION_ATOL`` for attention), on irregular shapes with out-of-order ids and the null block.
"""

from __future__ import annotations

import pytest
import torch
from kvbridge.kernels import (
    block_nbytes,
    copy_blocks,
    gather_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
    scatter_blocks,
    should_use_triton,
    staging_nbytes,
)

ATTENTION_ATOL = 1e-5
"""float32 attention: the kernel and the twin sum in different orders (online vs two-pass
softmax), so they agree to a few float32 ulps of O(1) outputs, not bit for bit."""

# (num_layers, num_blocks, block_size, num_kv_heads, head_size): odd sizes on purpose, so every
# kernel tail mask is exercised.
IRREGULAR_SHAPES = [(1, 5, 1, 1, 1), (3, 11, 3, 3, 5), (2, 9, 16, 2, 12)]


def _make_kv_caches(
    *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
    seed: int = 0, dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=generator)
        .to(dtype)
        for _ in range(num_layers)
    ]


def _clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensor.clone() for tensor in tensors]


def _assert_all_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for layer_idx, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(got, want), f"layer {layer_idx} differs"


# ---------------------------------------------------------------- layout and gather / scatter


def test_staging_nbytes_counts_every_layer_and_block():
    kv_caches = _make_kv_caches(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2,
                                head_size=8)
    # One block of one layer: 2 (K, V) * 16 tokens * 2 heads * 8 dims * 4 bytes = 2048 bytes.
    assert block_nbytes(16, 2, 8, torch.float32) == 2048
    assert staging_nbytes(kv_caches, 5) == 3 * 5 * 2048
    assert gather_blocks(kv_caches, torch.tensor([0, 1, 2, 3, 0])).nbytes == 3 * 5 * 2048


def test_gather_copies_blocks_in_the_order_given_including_null_block():
    kv_caches = _make_kv_caches(num_layers=2, num_blocks=6, block_size=3, num_kv_heads=1,
                                head_size=2)
    block_ids = torch.tensor([5, 0, 2, 5])  # out of order, the null block, a repeat
    staging = gather_blocks(kv_caches, block_ids)
    assert staging.shape == (2, 4, 2, 3, 1, 2)
    for layer_idx in range(2):
        for row, block_id in enumerate(block_ids.tolist()):
            assert torch.equal(staging[layer_idx, row], kv_caches[layer_idx][block_id])


def test_scatter_inverts_gather_and_leaves_other_blocks_alone():
    source = _make_kv_caches(num_layers=2, num_blocks=7, block_size=5, num_kv_heads=2,
                             head_size=3, seed=1)
    target = _make_kv_caches(num_layers=2, num_blocks=7, block_size=5, num_kv_heads=2,
                             head_size=3, seed=2)
    before = _clone_all(target)
    block_ids = torch.tensor([6, 1, 3])
    scatter_blocks(gather_blocks(source, block_ids), target, block_ids)
    for layer_idx in range(2):
        for block_id in range(7):
            expected = source if block_id in (6, 1, 3) else before
            assert torch.equal(target[layer_idx][block_id], expected[layer_idx][block_id])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_gather_moves_every_bit_of_any_dtype_from_layers_sharing_one_buffer(dtype):
    # vLLM allocates a group's layers out of one buffer: each layer a view at its own offset.
    shape = (5, 2, 3, 2, 4)  # blocks, K/V, block size, heads, head size
    per_layer = torch.Size(shape).numel()
    buffer = torch.randn(3 * per_layer + 7).to(dtype)
    kv_caches = [buffer[7 + i * per_layer: 7 + (i + 1) * per_layer].view(shape)
                 for i in range(3)]
    block_ids = torch.tensor([4, 0, 4, 2], dtype=torch.int32)
    staging = gather_blocks(kv_caches, block_ids)
    for layer_idx, kv_cache in enumerate(kv_caches):
        expected = kv_cache[block_ids.long()]
        assert torch.equal(staging[layer_idx].view(torch.uint8), expected.view(torch.uint8))


def test_gather_into_given_staging_and_empty_ids():
    kv_caches = _make_kv_caches(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1,
                                head_size=4)
    staging = torch.empty(2, 2, 2, 2, 1, 4)
    assert gather_blocks(kv_caches, torch.tensor([3, 1]), staging) is staging
    assert torch.equal(staging[1, 0], kv_caches[1][3])
    empty = gather_blocks(kv_caches, torch.tensor([], dtype=torch.int64))
    assert empty.shape == (2, 0, 2, 2, 1, 4)
    scatter_blocks(empty, kv_caches, torch.tensor([], dtype=torch.int64))  # no-op, no error


@pytest.mark.parametrize(
    ("block_ids", "message"),
    [
        ([0, 4], "block id 4 at position 1 is outside"),  # == num_blocks: one past the end
        ([-1], "block id -1 at position 0"),
    ],
)
def test_gather_rejects_out_of_range_ids(block_ids, message):
    kv_caches = _make_kv_caches(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1,
                                head_size=2)
    with pytest.raises(ValueError, match=message):
        gather_blocks(kv_caches, torch.tensor(block_ids))


def test_gather_and_scatter_reject_layout_mistakes():
    kv_caches = _make_kv_caches(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1,
                                head_size=2)
    with pytest.raises(ValueError, match="kv_caches\\[1\\] has shape"):
        gather_blocks([kv_caches[0], torch.zeros(4, 2, 2, 1, 3)], torch.tensor([1]))
    with pytest.raises(ValueError, match="dtype"):
        gather_blocks([kv_caches[0], kv_caches[1].double()], torch.tensor([1]))
    with pytest.raises(ValueError, match="staging has shape"):
        gather_blocks(kv_caches, torch.tensor([1]), torch.empty(2, 2, 2, 2, 1, 2))
    with pytest.raises(ValueError, match="staging has dtype"):
        scatter_blocks(torch.empty(2, 1, 2, 2, 1, 2, dtype=torch.float64), kv_caches,
                       torch.tensor([1]))
    with pytest.raises(ValueError, match="target block id 2 appears more than once"):
        scatter_blocks(torch.empty(2, 2, 2, 2, 1, 2), kv_caches, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="integer"):
        gather_blocks(kv_caches, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="empty"):
        gather_blocks([], torch.tensor([1]))


# ---------------------------------------------------------------- reshape_and_cache, copy_blocks


def test_reshape_and_cache_writes_each_slot_and_skips_minus_one():
    kv_cache = torch.zeros(4, 2, 3, 2, 2)
    key = torch.arange(4 * 2 * 2, dtype=torch.float32).view(4, 2, 2) + 1
    value = -key
    # Slots: 0 = block 0 offset 0; 2 = block 0 offset 2 (block boundary - 1); 3 = block 1
    # offset 0 (boundary); -1 = not written; 11 = last slot of the cache.
    slot_mapping = torch.tensor([0, 2, -1, 11])
    reshape_and_cache(key, value, kv_cache, slot_mapping)
    assert torch.equal(kv_cache[0, 0, 0], key[0]) and torch.equal(kv_cache[0, 1, 0], value[0])
    assert torch.equal(kv_cache[0, 0, 2], key[1])
    assert torch.equal(kv_cache[3, 1, 2], value[3])
    # Exactly three tokens written: 3 tokens * 2 (K, V) * 2 heads * 2 dims non-zero entries.
    assert int((kv_cache != 0).sum()) == 3 * 2 * 2 * 2
    with pytest.raises(ValueError, match="slot 12 at token 0"):
        reshape_and_cache(key[:1], value[:1], kv_cache, torch.tensor([12]))


def test_copy_blocks_copies_every_layer_and_rejects_overlap():
    kv_caches = _make_kv_caches(num_layers=2, num_blocks=6, block_size=2, num_kv_heads=1,
                                head_size=3)
    before = _clone_all(kv_caches)
    copy_blocks(kv_caches, torch.tensor([[4, 1], [0, 5]]))
    for layer_idx in range(2):
        assert torch.equal(kv_caches[layer_idx][1], before[layer_idx][4])
        assert torch.equal(kv_caches[layer_idx][5], before[layer_idx][0])
        assert torch.equal(kv_caches[layer_idx][2], before[layer_idx][2])
    with pytest.raises(ValueError, match="also a source"):
        copy_blocks(kv_caches, torch.tensor([[1, 2], [2, 3]]))
    with pytest.raises(ValueError, match="destination block id 3 appears more than once"):
        copy_blocks(kv_caches, torch.tensor([[1, 3], [2, 3]]))


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        should_use_triton(True, torch.zeros(1))
    assert should_use_triton(None, torch.zeros(1)) is False  # CPU tensors: the twin


# ---------------------------------------------------------------- paged attention (twins)


def _dense_attention(q, k, v, query_pos, scale, sliding_window):
    """Attention written out densely: q [Tq, H, D], k/v [Tk, Hkv, D] at positions 0..Tk-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    key_pos = torch.arange(k.shape[0])
    visible = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        visible &= query_pos[:, None] - key_pos[None, :] < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def _make_attention_batch(*, query_lens, seq_lens, block_size, num_heads, num_kv_heads,
                          head_size, null_before=None, seed=0):
    """A varlen batch with random, distinct, non-contiguous physical blocks per request. With
    ``null_before`` (a window), block table entries wholly before each request's window are
    the null block 0, filled with NaN: reading one would poison the output."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = 1 + max_blocks * len(seq_lens)
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size,
                           generator=generator)
    kv_cache[0] = float("nan")
    physical = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(len(seq_lens), -1)
    block_table = physical[:, :max_blocks].to(torch.int32).clone()
    if null_before is not None:
        for req_idx, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            first_visible = max(0, seq_len - query_len - null_before + 1)
            block_table[req_idx, : first_visible // block_size] = 0
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    query = torch.randn(int(query_start_loc[-1]), num_heads, head_size, generator=generator)
    return query, kv_cache, query_start_loc, torch.tensor(seq_lens), block_table


def _context_of(kv_cache, block_table_row, seq_len, kv):
    blocks = kv_cache[block_table_row.long()][:, kv]
    return blocks.reshape(-1, *blocks.shape[2:])[:seq_len]


@pytest.mark.parametrize("sliding_window", [None, 1, 7])
def test_prefill_twin_equals_dense_attention(sliding_window):
    # Requests: one token; a chunk after cached context; a block-aligned prompt; an empty query.
    query_lens, seq_lens = [1, 5, 8, 0], [1, 13, 8, 6]
    query, kv_cache, query_start_loc, seq_lens_t, block_table = _make_attention_batch(
        query_lens=query_lens, seq_lens=seq_lens, block_size=4, num_heads=4, num_kv_heads=2,
        head_size=6, null_before=sliding_window,
    )
    out = paged_attention_prefill(query, kv_cache, query_start_loc, seq_lens_t, block_table,
                                  scale=0.5, sliding_window=sliding_window, use_triton=False)
    for req_idx, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if query_len == 0:
            continue
        rows = slice(int(query_start_loc[req_idx]), int(query_start_loc[req_idx + 1]))
        # Dense reference over the whole context; NaN null blocks lie outside every window, so
        # replace them by zeros there (they are masked out anyway).
        k = torch.nan_to_num(_context_of(kv_cache, block_table[req_idx], seq_len, 0))
        v = torch.nan_to_num(_context_of(kv_cache, block_table[req_idx], seq_len, 1))
        query_pos = torch.arange(seq_len - query_len, seq_len)
        expected = _dense_attention(query[rows], k, v, query_pos, 0.5, sliding_window)
        torch.testing.assert_close(out[rows], expected, atol=ATTENTION_ATOL, rtol=0)


def test_decode_twin_equals_prefill_with_one_query_each():
    query, kv_cache, _, seq_lens, block_table = _make_attention_batch(
        query_lens=[1, 1, 1], seq_lens=[1, 4, 9], block_size=4, num_heads=2, num_kv_heads=1,
        head_size=4,
    )
    decode = paged_attention_decode(query, kv_cache, seq_lens, block_table, scale=1.0,
                                    use_triton=False)
    prefill = paged_attention_prefill(query, kv_cache, torch.arange(4), seq_lens, block_table,
                                      scale=1.0, use_triton=False)
    assert torch.equal(decode, prefill)


def test_attention_rejects_short_block_table_and_long_query():
    query, kv_cache, query_start_loc, seq_lens, block_table = _make_attention_batch(
        query_lens=[3], seq_lens=[8], block_size=4, num_heads=2, num_kv_heads=1, head_size=4,
    )
    with pytest.raises(ValueError, match="block_table has 1 blocks per request"):
        paged_attention_prefill(query, kv_cache, query_start_loc, seq_lens, block_table[:, :1],
                                scale=1.0)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        paged_attention_prefill(query, kv_cache, query_start_loc, torch.tensor([2]),
                                block_table, scale=1.0)


# ---------------------------------------------------------------- Triton kernels vs twins


@pytest.mark.triton
@pytest.mark.parametrize(("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"),
                         IRREGULAR_SHAPES)
def test_triton_copy_kernels_equal_twins_exactly(num_layers, num_blocks, block_size,
                                                 num_kv_heads, head_size):
    kv_caches = _make_kv_caches(num_layers=num_layers, num_blocks=num_blocks,
                                block_size=block_size, num_kv_heads=num_kv_heads,
                                head_size=head_size)
    block_ids = torch.tensor([num_blocks - 1, 0, 2, 1])  # last block, null block, out of order
    staging = gather_blocks(kv_caches, block_ids, use_triton=True)
    assert torch.equal(staging, gather_blocks(kv_caches, block_ids, use_triton=False))

    new_staging = torch.randn_like(staging)
    via_triton, via_twin = _clone_all(kv_caches), _clone_all(kv_caches)
    scatter_blocks(new_staging, via_triton, block_ids, use_triton=True)
    scatter_blocks(new_staging, via_twin, block_ids, use_triton=False)
    _assert_all_equal(via_triton, via_twin)

    block_mapping = torch.tensor([[num_blocks - 1, 3], [0, 2]])  # null block as a source
    copy_blocks(via_triton, block_mapping, use_triton=True)
    copy_blocks(via_twin, block_mapping, use_triton=False)
    _assert_all_equal(via_triton, via_twin)

    num_slots = num_blocks * block_size
    generator = torch.Generator().manual_seed(3)
    slot_mapping = torch.randperm(num_slots, generator=generator)[:7]
    slot_mapping[1] = -1
    key = torch.randn(slot_mapping.shape[0], num_kv_heads, head_size, generator=generator)
    value = torch.randn_like(key)
    reshape_and_cache(key, value, via_triton[0], slot_mapping, use_triton=True)
    reshape_and_cache(key, value, via_twin[0], slot_mapping, use_triton=False)
    _assert_all_equal(via_triton, via_twin)


@pytest.mark.triton
def test_triton_reshape_and_cache_casts_to_cache_dtype():
    kv_cache = torch.zeros(3, 2, 2, 1, 3, dtype=torch.bfloat16)
    twin = kv_cache.clone()
    key = torch.randn(2, 1, 3)
    value = torch.randn(2, 1, 3)
    slot_mapping = torch.tensor([5, 0])
    reshape_and_cache(key, value, kv_cache, slot_mapping, use_triton=True)
    reshape_and_cache(key, value, twin, slot_mapping, use_triton=False)
    assert torch.equal(kv_cache, twin)


@pytest.mark.triton
@pytest.mark.parametrize("sliding_window", [None, 1, 6])
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_size"),
                         [(5, 4, 2, 12), (16, 3, 3, 8), (1, 2, 1, 5)])
def test_triton_prefill_attention_equals_twin(sliding_window, block_size, num_heads,
                                              num_kv_heads, head_size):
    # Query lengths around the kernel's 16-row tile: 0, 1, 17 (tile + 1); a long context.
    query, kv_cache, query_start_loc, seq_lens, block_table = _make_attention_batch(
        query_lens=[1, 17, 0, 4], seq_lens=[1, 20, 3, 37], block_size=block_size,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        null_before=sliding_window,
    )
    args = (query, kv_cache, query_start_loc, seq_lens, block_table)
    via_triton = paged_attention_prefill(*args, scale=0.4, sliding_window=sliding_window,
                                         use_triton=True)
    via_twin = paged_attention_prefill(*args, scale=0.4, sliding_window=sliding_window,
                                       use_triton=False)
    assert not via_triton.isnan().any()
    torch.testing.assert_close(via_triton, via_twin, atol=ATTENTION_ATOL, rtol=0)


@pytest.mark.triton
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_triton_decode_attention_equals_twin(sliding_window):
    query, kv_cache, _, seq_lens, block_table = _make_attention_batch(
        query_lens=[1, 1, 1, 1], seq_lens=[1, 5, 16, 33], block_size=5, num_heads=6,
        num_kv_heads=2, head_size=7, null_before=sliding_window,
    )
    args = (query, kv_cache, seq_lens, block_table)
    via_triton = paged_attention_decode(*args, scale=0.4, sliding_window=sliding_window,
                                        use_triton=True)
    via_twin = paged_attention_decode(*args, scale=0.4, sliding_window=sliding_window,
                                      use_triton=False)
    assert not via_triton.isnan().any()
    torch.testing.assert_close(via_triton, via_twin, atol=ATTENTION_ATOL, rtol=0)
