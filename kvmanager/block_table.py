"""Worker-side block tables: a writable numpy mirror per KV cache group, committed to the device.

Each row is one live request of the persistent batch; column ``j`` holds the physical block id of
the request's ``j``-th logical block. The control plane edits rows on the CPU mirror
(``append_row`` / ``add_row`` / ``move_row`` / ``swap_rows``), and ``commit`` copies only the valid
rows ``[0, num_reqs)`` to the device tensor that the attention kernels read (seed 000,
"CPU 镜像为什么先更新再拷到 GPU"; vLLM ``vllm/v1/worker/block_table.py``).

Unused columns and cleared rows hold block 0, the null block: a kernel that strays onto a padded
entry reads or writes the null block, never a block that another request owns now.

The slot mapping is a different table (seed 000, "block table 与 slot mapping 不是同一张表")::

    position p of request r:  j = p // block_size   (logical block)
                              o = p %  block_size   (offset in block)
                              slot = block_table[r, j] * block_size + o
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["NULL_BLOCK_ID", "BlockTable", "MultiGroupBlockTable"]

NULL_BLOCK_ID = 0
"""Block id that pads every row (vLLM's ``BlockPool`` reserves block 0 as the null block)."""


class BlockTable:
    """One KV cache group's block table for up to ``max_num_reqs`` rows.

    Attributes:
        block_table_np: ``int32[max_num_reqs, max_num_blocks_per_req]`` CPU mirror (mutated by the
            row operations; the source of truth until ``commit``).
        num_blocks_per_row: ``int32[max_num_reqs]``, how many columns of each row are valid.
        block_table: ``int32[max_num_reqs, max_num_blocks_per_req]`` tensor on ``device``; only
            rows ``[0, num_reqs)`` of the last ``commit(num_reqs)`` are current.
    """

    def __init__(
        self,
        *,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        device: torch.device | str = "cpu",
    ) -> None:
        """Raises ``ValueError`` if any size is < 1."""
        for name, value in (
            ("block_size", block_size),
            ("max_num_reqs", max_num_reqs),
            ("max_num_blocks_per_req", max_num_blocks_per_req),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = torch.device(device)
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.block_table_np = np.full(shape, NULL_BLOCK_ID, dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = torch.full(shape, NULL_BLOCK_ID, dtype=torch.int32, device=self.device)

    def _check_row(self, row_idx: int) -> None:
        if not 0 <= row_idx < self.max_num_reqs:
            raise ValueError(f"row {row_idx} is outside [0, {self.max_num_reqs})")

    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append ``block_ids`` after the valid columns of row ``row_idx`` (mutates the mirror).

        Raises:
            ValueError: if the row index is out of range or the row would exceed
                ``max_num_blocks_per_req`` columns.
        """
        self._check_row(row_idx)
        num_new = len(block_ids)
        if num_new == 0:
            return
        start = int(self.num_blocks_per_row[row_idx])
        end = start + num_new
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row_idx} would hold {end} blocks, max_num_blocks_per_req is "
                f"{self.max_num_blocks_per_req}"
            )
        self.block_table_np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Make row ``row_idx`` hold exactly ``block_ids`` (a new or resumed request)."""
        self.clear_row(row_idx)
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """Reset row ``row_idx`` to the null block with no valid column."""
        self._check_row(row_idx)
        self.block_table_np[row_idx] = NULL_BLOCK_ID
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` into row ``tgt`` and clear row ``src``.

        Clearing the source keeps a stale row (a dummy run, an async kernel) from writing into
        blocks that were freed and handed to someone else (seed 000, "CPU 镜像为什么先更新再拷到
        GPU").
        """
        self._check_row(src)
        self._check_row(tgt)
        if src == tgt:
            return
        self.block_table_np[tgt] = self.block_table_np[src]
        self.num_blocks_per_row[tgt] = self.num_blocks_per_row[src]
        self.clear_row(src)

    def swap_rows(self, row_a: int, row_b: int) -> None:
        """Exchange rows ``row_a`` and ``row_b`` (block ids and valid counts)."""
        self._check_row(row_a)
        self._check_row(row_b)
        self.block_table_np[[row_a, row_b]] = self.block_table_np[[row_b, row_a]]
        self.num_blocks_per_row[[row_a, row_b]] = self.num_blocks_per_row[[row_b, row_a]]

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Copy rows ``[0, num_reqs)`` of the mirror to the device table and return that view,
        ``int32[num_reqs, max_num_blocks_per_req]``. Rows at and after ``num_reqs`` are not
        copied.

        Raises:
            ValueError: if ``num_reqs`` is outside ``[0, max_num_reqs]``.
        """
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs {num_reqs} is outside [0, {self.max_num_reqs}]")
        self.block_table[:num_reqs].copy_(
            torch.from_numpy(self.block_table_np[:num_reqs]), non_blocking=True
        )
        return self.block_table[:num_reqs]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slot of every token of a step: ``block_table[r, p // block_size] * block_size +
        p % block_size``.

        Args:
            req_indices: ``int[num_tokens]`` row of each token.
            positions: ``int[num_tokens]`` position of each token in its request.

        Returns:
            ``int64[num_tokens]`` slots (read from the CPU mirror).

        Raises:
            ValueError: if the shapes differ, a row is out of range, or a position falls in a
                column past the row's valid blocks (its slot would land in the null block).
        """
        req_indices = np.asarray(req_indices, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        if req_indices.shape != positions.shape or req_indices.ndim != 1:
            raise ValueError(
                f"req_indices {req_indices.shape} and positions {positions.shape} must be equal 1-d"
            )
        if req_indices.size == 0:
            return np.zeros(0, dtype=np.int64)
        if req_indices.min() < 0 or req_indices.max() >= self.max_num_reqs:
            raise ValueError(f"a row index is outside [0, {self.max_num_reqs})")
        if positions.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
        block_indices = positions // self.block_size
        beyond = block_indices >= self.num_blocks_per_row[req_indices]
        if beyond.any():
            t = int(np.flatnonzero(beyond)[0])
            r = int(req_indices[t])
            raise ValueError(
                f"token {t} (row {r}, position {int(positions[t])}) needs logical block "
                f"{int(block_indices[t])}, the row holds {int(self.num_blocks_per_row[r])}"
            )
        block_ids = self.block_table_np[req_indices, block_indices].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV cache group, edited together (block ids come per group, as
    ``KVCacheBlocks.get_block_ids()`` returns them)."""

    def __init__(
        self,
        *,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_blocks_per_req: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> None:
        """Raises ``ValueError`` if the per-group lists differ in length or are empty."""
        if len(block_sizes) != len(max_num_blocks_per_req) or not block_sizes:
            raise ValueError(
                f"{len(block_sizes)} block sizes for {len(max_num_blocks_per_req)} groups"
            )
        self.block_tables = [
            BlockTable(
                block_size=block_size,
                max_num_reqs=max_num_reqs,
                max_num_blocks_per_req=max_blocks,
                device=device,
            )
            for block_size, max_blocks in zip(block_sizes, max_num_blocks_per_req, strict=True)
        ]

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.block_tables[group_id]

    def __len__(self) -> int:
        return len(self.block_tables)

    def _check_groups(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(
                f"block ids for {len(block_ids)} groups, the table has {len(self.block_tables)}"
            )

    def append_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """``BlockTable.append_row`` for every group; ``block_ids[g]`` goes to group ``g``."""
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(ids, row_idx)

    def add_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """``BlockTable.add_row`` for every group."""
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """``BlockTable.clear_row`` for every group."""
        for table in self.block_tables:
            table.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        """``BlockTable.move_row`` for every group (the source rows end cleared)."""
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_rows(self, row_a: int, row_b: int) -> None:
        """``BlockTable.swap_rows`` for every group."""
        for table in self.block_tables:
            table.swap_rows(row_a, row_b)

    def commit(self, num_reqs: int) -> list[torch.Tensor]:
        """``BlockTable.commit`` for every group; returns the device views in group order."""
        return [table.commit(num_reqs) for table in self.block_tables]

    def compute_slot_mapping(
        self, req_indices: np.ndarray, positions: np.ndarray
    ) -> list[np.ndarray]:
        """``BlockTable.compute_slot_mapping`` for every group, in group order."""
        return [table.compute_slot_mapping(req_indices, positions) for table in self.block_tables]
