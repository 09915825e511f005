"""Which part of a block row a read moves: the KV heads it names (tensor parallelism).

A node holds a run of the model's KV heads (``NodeMetadata.held_heads``: all of them, or one
tensor-parallel rank's slice). A read names the heads it wants (``Read.heads``, the model's
head numbers), and each side moves, from every row (one block of one region) it reads or
writes, the bytes of exactly those heads. On a head-major node (``KVHeads.sliceable``) a run
of heads is one contiguous byte range of the row::

    row of a node holding heads [2, 4) of 4:   | head 2 | head 3 |
    a read of heads [3, 4):                              |<---->|   offset 1 * head_nbytes

The holder checks the heads against its own before it serves anything (``check_heads``), and a
requester names the heads its own blocks hold (``Transport.read_blocks``' default), so bytes of
one rank's heads never land in another rank's blocks: a read sent to the wrong rank is refused.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import WireError
from .metadata import NodeMetadata

__all__ = ["RowSlice", "check_heads", "row_slice"]


class RowSlice(NamedTuple):
    """The bytes of one block row (one block of one region) a read moves on one node.

    Attributes:
        offset: bytes from the row's start.
        nbytes: bytes moved per row.
        whole: the slice is the entire row (the node's zero-copy paths apply).
    """

    offset: int
    nbytes: int
    whole: bool


def _head_nbytes(metadata: NodeMetadata, group_id: int) -> int:
    layout = metadata.groups[group_id]
    first, stop = metadata.held_heads
    return layout.block_nbytes // (stop - first)


def heads_error(metadata: NodeMetadata, heads: tuple[int, int] | None) -> str | None:
    """Why ``metadata``'s node cannot serve or receive a read of ``heads`` (``(start, stop)``,
    the model's head numbers; None: whole rows), or None when it can: the heads must lie within
    those it holds, and a part of its rows needs a head-major layout."""
    first, stop = metadata.held_heads
    total = metadata.total_kv_heads
    if heads is None:
        if (first, stop) != (0, total):
            return (
                f"this node holds KV heads [{first}, {stop}) of {total}; a read must name the "
                "heads it expects"
            )
        return None
    start, end = heads
    if not (first <= start < end <= stop):
        return f"this node holds KV heads [{first}, {stop}) of {total}, not [{start}, {end})"
    sliceable = metadata.kv_heads is not None and metadata.kv_heads.sliceable
    if (start, end) != (first, stop) and not sliceable:
        return (
            f"KV heads [{start}, {end}) of this node's [{first}, {stop}) are not one byte range "
            f"of a block in its layout {metadata.identity.kv_layout!r}: only whole rows move"
        )
    return None


def check_heads(metadata: NodeMetadata, heads: tuple[int, int] | None) -> None:
    """Holder side: refuse a read of heads this node does not hold as asked (``heads_error``).

    Raises:
        WireError: naming the heads held and the heads asked for.
    """
    error = heads_error(metadata, heads)
    if error is not None:
        raise WireError(error)


def row_slice(metadata: NodeMetadata, group_id: int, heads: tuple[int, int] | None) -> RowSlice:
    """The bytes of each row of group ``group_id`` that a read of ``heads`` moves on
    ``metadata``'s node (checked by ``heads_error`` first; None: whole rows)::

        offset = (heads.start - first held) * head_nbytes,  nbytes = len(heads) * head_nbytes

    where ``head_nbytes`` is a row's bytes over the heads held (the same on every node of one
    model: the handshake compares block shapes per head)."""
    row_nbytes = metadata.groups[group_id].block_nbytes
    if heads is None or tuple(heads) == metadata.held_heads:
        return RowSlice(0, row_nbytes, True)
    head_nbytes = _head_nbytes(metadata, group_id)
    first, _ = metadata.held_heads
    return RowSlice((heads[0] - first) * head_nbytes, (heads[1] - heads[0]) * head_nbytes, False)
