"""Holder-side hash re-checks and the requester's handling of ``ReadDone`` (``plan``,
"Hash checks on the holder"; ``transfer.ReadState``)."""

from __future__ import annotations

import pytest
from kvbridge.transport import BlockValidator, LeaseRef
from kvbridge.transport.errors import WireError
from kvbridge.transport.plan import check_read_done, expects_read_done, recheck_blocks
from kvbridge.transport.transfer import ReadState
from kvbridge.transport.wire import GroupReadMsg, Read


def _read(*groups: GroupReadMsg) -> Read:
    return Read(
        transfer_id=1,
        request_id="r",
        tag_base=0,
        chunk_bytes=4096,
        deadline_ms=1000,
        groups=list(groups),
    )


def _group(block_ids: list[int], *, hashed: bool = True, group_id: int = 0) -> GroupReadMsg:
    hashes = [f"{group_id}:{b}".encode() for b in block_ids] if hashed else None
    return GroupReadMsg(group_id=group_id, block_ids=block_ids, expected_hashes=hashes)


def _rejecting(*bad_block_ids: int) -> tuple[BlockValidator, list[list[int]]]:
    """A validator rejecting ``bad_block_ids``, and the block ids of each call it gets."""
    calls: list[list[int]] = []

    def validate(
        group_id: int, block_ids: list[int], hashes: list[bytes], lease: LeaseRef | None
    ) -> list[int]:
        calls.append(list(block_ids))
        return [i for i, b in enumerate(block_ids) if b in bad_block_ids]

    return validate, calls


def test_recheck_maps_chunk_positions_back_to_read_positions():
    group = _group([10, 11, 12, 13, 14])
    validate, calls = _rejecting(13)
    # the chunk holds read positions 1, 3, 4 (position 2 was refused earlier)
    assert recheck_blocks(group, [1, 3, 4], validate, None) == [3]
    assert calls == [[11, 13, 14]]  # one call over the chunk's blocks only


def test_recheck_skips_groups_without_hashes_or_validator():
    validate, calls = _rejecting(10)
    assert recheck_blocks(_group([10], hashed=False), [0], validate, None) == []
    assert recheck_blocks(_group([10]), [0], None, None) == []
    assert recheck_blocks(_group([10]), [], validate, None) == []  # an empty chunk
    assert calls == []


def test_recheck_raises_on_a_validator_position_outside_the_chunk():
    with pytest.raises(RuntimeError, match=r"positions \[2\] for 2 blocks"):
        recheck_blocks(_group([10, 11, 12]), [0, 1], lambda g, ids, h, lease: [2], None)


def test_read_done_expected_only_when_some_group_sends_hashes():
    assert not expects_read_done(_read(_group([1], hashed=False)))
    assert expects_read_done(_read(_group([1], hashed=False), _group([2], group_id=1)))
    assert not expects_read_done(_read())


@pytest.mark.parametrize(
    ("late", "fragment"),
    [
        ([[]], "1 entries for 2 groups"),
        ([[1], []], "entry 0: positions [1]"),  # refused at ReadOk, so never sent
        ([[3], []], "entry 0: positions [3]"),  # out of range (3 blocks)
        ([[0, 0], []], "entry 0: positions [0, 0]"),  # repeated
        ([[], [1]], "entry 1: positions [1]"),
    ],
)
def test_read_done_that_does_not_fit_is_a_wire_error(late, fragment):
    read = _read(_group([10, 11, 12]), _group([20], group_id=1))
    with pytest.raises(WireError) as info:
        check_read_done(read, [[1], []], late)
    assert fragment in str(info.value)


def test_late_mismatches_become_failed_not_landed():
    read = _read(_group([10, 11, 12]), _group([20, 21], group_id=1))
    state = ReadState(
        request_id="r", transfer_id=1, groups=read.groups, local_block_ids=[[5, 6, 7], [8, 9]]
    )
    state.mismatched = [[1], []]  # refused at ReadOk
    state.landed = [{0, 2}, {0, 1}]
    state.num_bytes_landed = 2 * 3072 + 2 * 2048  # 3-layer and 2-layer 1 KiB blocks
    check_read_done(read, state.mismatched, [[2], [0]])
    state.fail_late([[2], [0]], [3072, 2048])
    result = state.result()
    # request order: entry 0 positions 1 (early) and 2 (late), then entry 1 position 0
    assert result.failed_local_block_ids == (6, 7, 8)
    assert (result.num_blocks_landed, result.num_bytes_landed) == (2, 3072 + 2048)
    with pytest.raises(RuntimeError, match=r"late mismatches \[2\] never landed"):
        state.fail_late([[2], []], [3072, 2048])  # no longer landed


def test_pick_slices_when_nothing_mismatched_and_indexes_otherwise():
    from kvbridge.transport.plan import good_positions, pick

    values = [50, 51, 52, 53, 54]
    assert pick(values, good_positions(5, []), 1, 4) == [51, 52, 53]
    good = good_positions(5, [1, 3])  # positions 0, 2, 4
    assert pick(values, good, 0, 2) == [50, 52]
    assert pick(values, good, 2, 3) == [54]
