"""Blocks a store receives in slices of KV heads: each rank of a tensor-parallel writer puts its
own heads of a block under the block's hash (``wire``: a put's ``heads``), and the store holds
the block once every head of the model is written (``StoreCache``, "Blocks written in slices").

``HeadSlice`` names the heads of a put and the bytes they take in a block row (a row of a
head-major layout holds its heads one after another, as ``transport.heads.row_slice`` reads
them); ``IncompleteBlock`` is a block some of whose heads are written; ``write_rows`` copies a
put's rows (or slices of rows) into the store's tensors. Plain torch; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from kvbridge.kernels import scatter_blocks

__all__ = ["HeadSlice", "IncompleteBlock", "write_rows"]


class HeadSlice(NamedTuple):
    """KV heads ``[start, stop)`` of the model's ``total``."""

    start: int
    stop: int
    total: int

    @property
    def whole(self) -> bool:
        return (self.start, self.stop) == (0, self.total)

    def byte_range(self, row_nbytes: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of these heads in a row of ``row_nbytes`` holding every head."""
        head_nbytes = row_nbytes // self.total
        return self.start * head_nbytes, (self.stop - self.start) * head_nbytes

    def error(self) -> str | None:
        """Why these heads are not a run of the model's, or None."""
        if not 0 <= self.start < self.stop <= self.total:
            return f"heads [{self.start}, {self.stop}) are not within the model's {self.total}"
        return None


@dataclass(slots=True)
class IncompleteBlock:
    """A store block some heads of which are written: ``covered``, the runs written so far;
    ``since``: when its first slice came (the clock's seconds)."""

    block_id: int
    parent: bytes
    since: float
    covered: list[tuple[int, int]] = field(default_factory=list)

    def conflict(self, start: int, stop: int) -> tuple[int, int] | None:
        """A written run that overlaps ``[start, stop)`` without being it (writers of two
        head splits), or None."""
        for run in self.covered:
            if run != (start, stop) and run[0] < stop and start < run[1]:
                return run
        return None

    def num_covered(self) -> int:
        return sum(stop - start for start, stop in self.covered)


def write_rows(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
               staging: torch.Tensor, heads: HeadSlice | None) -> None:
    """Copy ``staging``'s rows into blocks ``block_ids`` of ``kv_caches`` (one group's
    ``[num_store_blocks + 1, ...]`` layers, mutated).

    Args:
        staging: ``[num_layers, n, ...]`` on CPU, ``n == len(block_ids)``: whole rows in the
            caches' dtype (``heads`` None or whole), else each row's bytes of ``heads`` only.
    """
    if not block_ids:
        return
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if heads is None or heads.whole:
        scatter_blocks(staging.contiguous(), list(kv_caches), ids)
        return
    n = len(block_ids)
    for layer, cache in enumerate(kv_caches):
        rows = cache.view(cache.shape[0], -1).view(torch.uint8)
        offset, nbytes = heads.byte_range(rows.shape[1])
        rows[ids, offset:offset + nbytes] = staging[layer].reshape(n, -1).view(torch.uint8)
