"""The arithmetic of tensor-parallel KV heads (``connector.tp_layout``, issue 30): which heads a
rank holds (vLLM's rule), where a rank reads them from an engine of another size, and which
pairings are refused. Exact expected values, each with why."""

from __future__ import annotations

import pytest
from kvbridge.connector.tp_layout import (
    HeadRange,
    HeadSource,
    TPLayout,
    head_sources,
    pairing_error,
    rank_heads,
    tp_size_error,
)


def _layout(rank: int, size: int, heads: int, sliceable: bool = True) -> TPLayout:
    return TPLayout(tp_rank=rank, tp_size=size, total_num_kv_heads=heads,
                    heads_sliceable=sliceable)


@pytest.mark.parametrize(("tp_size", "total", "expected"), [
    (1, 1, [(0, 1)]),  # one rank holds the one head
    (1, 8, [(0, 8)]),  # one rank holds every head
    (2, 8, [(0, 4), (4, 8)]),  # an even split
    (8, 8, [(r, r + 1) for r in range(8)]),  # one head each: tp == heads, the boundary
    (4, 2, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # tp > heads: each head on tp / heads ranks
    (8, 1, [(0, 1)] * 8),  # MQA: every rank holds the one head
])
def test_rank_heads_follow_vllms_split(tp_size, total, expected):
    assert [tuple(rank_heads(r, tp_size, total)) for r in range(tp_size)] == expected


@pytest.mark.parametrize(("tp_size", "total"), [(3, 8), (4, 6), (0, 8), (2, 0)])
def test_sizes_vllm_would_not_run_are_errors(tp_size, total):
    assert tp_size_error(tp_size, total) is not None
    with pytest.raises(ValueError):
        rank_heads(0, tp_size, total)


@pytest.mark.parametrize("rank", [-1, 2])
def test_a_rank_outside_the_engine_is_an_error(rank):
    with pytest.raises(ValueError, match="tp_rank"):
        rank_heads(rank, 2, 8)


@pytest.mark.parametrize(("local", "remote_tp", "expected"), [
    # same size: rank r reads its own run from rank r
    ((1, 2, 8), 2, [(1, (4, 8))]),
    # P narrower (1 -> 2): a slice of P's only rank
    ((1, 2, 8), 1, [(0, (4, 8))]),
    # P wider (2 -> 1): whole blocks of each P rank into slices of D's
    ((0, 1, 8), 2, [(0, (0, 4)), (1, (4, 8))]),
    # P wider by 4 (4 -> 1), runs of 2 heads
    ((0, 1, 8), 4, [(0, (0, 2)), (1, (2, 4)), (2, (4, 6)), (3, (6, 8))]),
    # 2 -> 4: D rank 3 reads the second half of P rank 1's run
    ((3, 4, 8), 2, [(1, (6, 8))]),
    # P holds copies (4 ranks, 2 heads) -> D of 1: one copy of each head, the first copy
    ((0, 1, 2), 4, [(0, (0, 1)), (2, (1, 2))]),
    # P holds copies -> D of 2: D rank 1 reads head 1 from the second copy (rank 3)
    ((1, 2, 2), 4, [(3, (1, 2))]),
    # D holds copies (4 ranks, 2 heads) from P of 1: each D rank one head of P rank 0
    ((2, 4, 2), 1, [(0, (1, 2))]),
    # both hold copies, different counts (tp 8 and 4 of 2 heads)
    ((5, 8, 2), 4, [(3, (1, 2))]),
])
def test_each_rank_reads_exactly_its_heads_from_ranks_that_hold_them(local, remote_tp, expected):
    rank, size, heads = local
    sources = head_sources(_layout(rank, size, heads), remote_tp)
    assert sources == [HeadSource(r, HeadRange(*h)) for r, h in expected]
    covered = [h for s in sources for h in range(*s.heads)]
    assert covered == list(range(*rank_heads(rank, size, heads)))  # all, once, in order
    for source in sources:  # each source rank holds what is read from it
        first, stop = rank_heads(source.remote_rank, remote_tp, heads)
        assert first <= source.heads.start < source.heads.stop <= stop


def test_a_remote_size_vllm_would_not_run_is_refused_by_name():
    assert pairing_error(_layout(0, 2, 8), 3) == (
        "prefill tp_size 3, decode tp_size 2: tp_size 3 with 8 KV heads: neither divides the other"
    )
    with pytest.raises(ValueError):
        head_sources(_layout(0, 2, 8), 3)


def test_a_layout_that_cannot_write_part_of_a_block_refuses_a_wider_prefill_only():
    unsliceable = _layout(0, 1, 8, sliceable=False)
    assert pairing_error(unsliceable, 1) is None  # whole blocks: any layout
    assert pairing_error(unsliceable, 2) == (
        "prefill tp_size 2, decode tp_size 1, 8 KV heads: a decode rank would write part of its "
        "blocks, which its KV cache layout does not keep in one byte range"
    )
    # a narrower P: D writes whole blocks (P's side is checked by P's holder)
    assert pairing_error(_layout(0, 2, 8, sliceable=False), 1) is None
    assert pairing_error(_layout(0, 2, 8), 4) is None
