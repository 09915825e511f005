"""BlockTable: row operations on the numpy mirror, commit, and the slot mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvbridge.kvmanager.block_table import NULL_BLOCK_ID, BlockTable, MultiGroupBlockTable


def _make_table(*, block_size: int = 4, max_num_reqs: int = 4, max_blocks: int = 5) -> BlockTable:
    return BlockTable(
        block_size=block_size, max_num_reqs=max_num_reqs, max_num_blocks_per_req=max_blocks
    )


def _row(table: BlockTable, row_idx: int) -> list[int]:
    return table.block_table_np[row_idx].tolist()


def test_append_row_extends_valid_columns_and_pads_with_null_block():
    table = _make_table()
    table.append_row([7, 3], 1)
    table.append_row([9], 1)
    # The delta [9] lands after the two valid columns; the rest stays the null block.
    assert _row(table, 1) == [7, 3, 9, NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert table.num_blocks_per_row.tolist() == [0, 3, 0, 0]


def test_add_row_replaces_the_whole_row():
    table = _make_table()
    table.append_row([7, 3, 9], 0)
    table.add_row([5], 0)
    assert _row(table, 0) == [5, 0, 0, 0, 0]
    assert int(table.num_blocks_per_row[0]) == 1


def test_move_row_copies_and_clears_the_source():
    table = _make_table()
    table.add_row([4, 8, 6], 3)
    table.move_row(3, 0)
    assert _row(table, 0) == [4, 8, 6, 0, 0]
    # The source must not keep stale ids a stray kernel could write through.
    assert _row(table, 3) == [0, 0, 0, 0, 0]
    assert table.num_blocks_per_row.tolist() == [3, 0, 0, 0]


def test_swap_rows_exchanges_ids_and_counts():
    table = _make_table()
    table.add_row([1, 2], 0)
    table.add_row([5, 6, 7], 2)
    table.swap_rows(0, 2)
    assert _row(table, 0) == [5, 6, 7, 0, 0]
    assert _row(table, 2) == [1, 2, 0, 0, 0]
    assert table.num_blocks_per_row.tolist() == [3, 0, 2, 0]


def test_commit_copies_only_the_valid_rows():
    table = _make_table()
    table.add_row([1, 2], 0)
    table.add_row([3], 1)
    table.add_row([9, 9, 9], 2)
    committed = table.commit(2)
    assert committed.dtype == torch.int32
    assert committed.tolist() == [[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]]
    # Row 2 was not part of this commit: the device table still holds its initial null row.
    assert table.block_table[2].tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_slot_mapping_is_block_id_times_block_size_plus_offset(block_size: int):
    table = _make_table(block_size=block_size, max_blocks=6)
    rows = {0: [11, 2, 7], 1: [5, 13], 2: [1, 4, 8, 6]}
    for row_idx, ids in rows.items():
        table.add_row(ids, row_idx)
    # Every position of every row, including the block boundary - 1, boundary and boundary + 1.
    req_indices, positions = [], []
    for row_idx, ids in rows.items():
        for position in range(len(ids) * block_size):
            req_indices.append(row_idx)
            positions.append(position)
    slots = table.compute_slot_mapping(np.array(req_indices), np.array(positions))
    expected = [
        rows[r][p // block_size] * block_size + p % block_size
        for r, p in zip(req_indices, positions, strict=True)
    ]
    assert slots.dtype == np.int64
    assert slots.tolist() == expected


def test_slot_mapping_of_an_empty_step_is_empty():
    table = _make_table()
    assert table.compute_slot_mapping(np.array([], dtype=np.int64), np.array([])).size == 0


def test_slot_mapping_past_the_valid_blocks_is_a_caller_mistake():
    table = _make_table(block_size=4)
    table.add_row([3, 5], 0)
    # Position 8 is logical block 2; the row holds only 2 blocks.
    with pytest.raises(ValueError, match="needs logical block 2"):
        table.compute_slot_mapping(np.array([0]), np.array([8]))


def test_append_past_max_blocks_per_req_raises():
    table = _make_table(max_blocks=2)
    table.append_row([1, 2], 0)
    with pytest.raises(ValueError, match="would hold 3 blocks"):
        table.append_row([3], 0)
    with pytest.raises(ValueError, match="outside"):
        table.append_row([3], 4)


def test_multi_group_table_edits_every_group_together():
    tables = MultiGroupBlockTable(
        block_sizes=[4, 4], max_num_reqs=2, max_num_blocks_per_req=[3, 3]
    )
    tables.add_row(([1, 2], [0, 6]), 1)  # group 1 padded with the null block (sliding window)
    tables.append_row(([3], [7]), 1)
    tables.move_row(1, 0)
    assert tables[0].block_table_np.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert tables[1].block_table_np.tolist() == [[0, 6, 7], [0, 0, 0]]
    slots = tables.compute_slot_mapping(np.array([0, 0]), np.array([8, 9]))
    # Position 8 is block index 2, offset 0: group 0 block 3 -> 12, group 1 block 7 -> 28.
    assert [s.tolist() for s in slots] == [[12, 13], [28, 29]]
    committed = tables.commit(1)
    assert [c.tolist() for c in committed] == [[[1, 2, 3]], [[0, 6, 7]]]
    with pytest.raises(ValueError, match="for 1 groups"):
        tables.append_row(([1],), 0)
