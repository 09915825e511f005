"""Read validation and chunk planning, shared by both transports and both sides of a read.

A read moves, per group entry ``i``, the *good* positions of ``groups[i]`` (all positions minus
those the holder's validator rejected). Both sides compute the same chunk plan from the same
inputs, so chunk ``k`` means the same blocks on both sides without sending the plan::

    group entry 0 good positions:  p0 p1 p2 p3 p4 | entry 1: q0 q1 q2
    chunks (2 blocks per chunk):   [p0 p1][p2 p3][p4] [q0 q1][q2]
                                    k=0    k=1   k=2  k=3    k=4

A chunk never spans two group entries (their layer tensors differ). A chunk of entry ``i`` holds
``blocks_per_chunk = max(1, chunk_bytes // (num_layers * row_nbytes))`` blocks except the last,
where ``row_nbytes`` is what the read moves of one block of one layer: the whole block, or the
bytes of the KV heads it names (``heads``: the same on both sides).

Hash checks on the holder (a hit is advisory: docs/architecture.md, "Life of an index hit"). A block
read through the index is not referenced on the holder, so the holder may evict and reuse it at
any time. The validator therefore runs twice per block of a read that sends expected hashes::

    Read ──> find_mismatched (all blocks) ──> ReadOk(mismatched): those blocks are never sent
             per chunk: copy out (staging gather, or the send itself for a zero-copy run)
                        ──> recheck_blocks (that chunk's blocks) ──> late mismatches
    after the last send completed ──> ReadDone(late mismatches): failed, never landed

The block pool removes a block's hash before it hands the block out for new content (seed rule
"evict the old hash first"), so a block that still carries the expected hash after its bytes
were copied had no new content written during the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .base import BlockValidator, GroupRead
from .errors import WireError
from .heads import check_heads, row_slice
from .limits import MAX_BLOCKS_PER_READ
from .metadata import NodeMetadata
from .wire import GroupReadMsg, LeaseRef, Read


class Chunk(NamedTuple):
    """Positions ``[start, stop)`` of the good-position list of group entry ``entry``."""

    entry: int
    start: int
    stop: int


def blocks_per_chunk(
    metadata: NodeMetadata, group_id: int, chunk_bytes: int,
    heads: tuple[int, int] | None = None,
) -> int:
    """How many blocks (all layers; of each, the bytes of ``heads``) of ``group_id`` fit in
    ``chunk_bytes``; at least 1."""
    layout = metadata.groups[group_id]
    return max(1, chunk_bytes // (layout.num_layers * row_slice(metadata, group_id, heads).nbytes))


def plan_chunks(
    metadata: NodeMetadata, group_ids: Sequence[int], num_good: Sequence[int], chunk_bytes: int,
    heads: tuple[int, int] | None = None,
) -> list[Chunk]:
    """The chunk plan for entries with ``num_good[i]`` good blocks of group ``group_ids[i]``, of
    a read of ``heads`` (``Read.heads``)."""
    chunks = []
    for entry, (group_id, count) in enumerate(zip(group_ids, num_good, strict=False)):
        step = blocks_per_chunk(metadata, group_id, chunk_bytes, heads)
        chunks.extend(
            Chunk(entry, start, min(start + step, count)) for start in range(0, count, step)
        )
    return chunks


def block_nbytes_by_entry(metadata: NodeMetadata, read: Read) -> list[int]:
    """Bytes ``read`` moves of one block over all layers of its group (the heads it names),
    per group entry."""
    return [
        metadata.groups[g.group_id].num_layers
        * row_slice(metadata, g.group_id, read.heads).nbytes
        for g in read.groups
    ]


def good_positions(num_blocks: int, mismatched: Sequence[int]) -> list[int]:
    """Positions ``0..num_blocks-1`` without ``mismatched``, in order."""
    if not mismatched:
        return list(range(num_blocks))
    bad = set(mismatched)
    return [p for p in range(num_blocks) if p not in bad]


def pick(values: Sequence[int], good: Sequence[int], start: int, stop: int) -> list[int]:
    """``[values[p] for p in good[start:stop]]``, a plain slice when ``good`` is every position
    (no block mismatched: the usual read, thousands of ids per chunk)."""
    if len(good) == len(values):
        return list(values[start:stop])
    return [values[p] for p in good[start:stop]]


def _int_list(values: Sequence[int]) -> list[int]:
    """A fresh list of ``int``: a copy of a list of ints (a C-level check and copy, a third of
    converting each id), otherwise each value converted (numpy ints, tensors' items, bools)."""
    if type(values) is list and set(map(type, values)) <= {int}:
        return values.copy()
    return list(map(int, values))


def _first_outside(values: Sequence[int], lo: int, hi: int) -> tuple[int, int] | None:
    """``(position, value)`` of the first value outside ``[lo, hi)``, or None. ``min`` and
    ``max`` run in C, so a read of thousands of ids in range costs microseconds; the position is
    looked for only when one is out."""
    if not values or (min(values) >= lo and max(values) < hi):
        return None
    return next((i, v) for i, v in enumerate(values) if not lo <= v < hi)


def build_group_msgs(
    metadata: NodeMetadata, groups: Sequence[GroupRead]
) -> tuple[list[GroupReadMsg], list[list[int]]]:
    """Check a requester's read against the local layout and turn it into wire form: the
    ``GroupReadMsg`` per group and its local ids as plain ints.

    Raises:
        ValueError: unknown group id, a group listed twice, lengths that differ, a local id
            outside ``[1, num_blocks)`` or repeated, a negative remote id, or too many blocks.
    """
    msgs = []
    locals_ = []
    seen_groups: set[int] = set()
    total = 0
    for group in groups:
        if not 0 <= group.group_id < len(metadata.groups):
            raise ValueError(f"group_id {group.group_id} not in [0, {len(metadata.groups)})")
        if group.group_id in seen_groups:
            raise ValueError(f"group_id {group.group_id} listed twice in one read")
        seen_groups.add(group.group_id)
        remote = _int_list(group.remote_block_ids)
        local = _int_list(group.local_block_ids)
        if len(remote) != len(local):
            raise ValueError(
                f"group {group.group_id}: {len(remote)} remote_block_ids, {len(local)} local"
            )
        num_blocks = metadata.groups[group.group_id].num_blocks
        bad_local = _first_outside(local, 1, num_blocks)
        if bad_local is not None:
            raise ValueError(
                f"group {group.group_id}: local block id {bad_local[1]} not in [1, {num_blocks})"
            )
        if len(set(local)) != len(local):
            raise ValueError(f"group {group.group_id}: local_block_ids has repeats")
        if remote and min(remote) < 0:
            raise ValueError(f"group {group.group_id}: negative remote block id")
        hashes = None
        if group.expected_hashes is not None:
            hashes = [bytes(h) for h in group.expected_hashes]
            if len(hashes) != len(remote):
                raise ValueError(
                    f"group {group.group_id}: {len(hashes)} expected_hashes, {len(remote)} blocks"
                )
        total += len(remote)
        msgs.append(GroupReadMsg(group_id=group.group_id, block_ids=remote, expected_hashes=hashes))
        locals_.append(local)
    if total > MAX_BLOCKS_PER_READ:
        raise ValueError(f"a read of {total} blocks exceeds {MAX_BLOCKS_PER_READ}")
    return msgs, locals_


def check_read(metadata: NodeMetadata, read: Read) -> None:
    """Holder side: every group id and remote block id of ``read`` must exist here, and its
    KV heads be the ones this node holds (``heads.check_heads``).

    Raises:
        WireError: naming the first bad group id or block id (block 0, the null block, is
            never served), or the heads held and asked for.
    """
    check_heads(metadata, read.heads)
    for entry, group in enumerate(read.groups):
        if group.group_id >= len(metadata.groups):
            raise WireError(
                f"groups[{entry}]: group_id {group.group_id} not in [0, {len(metadata.groups)})"
            )
        num_blocks = metadata.groups[group.group_id].num_blocks
        bad = _first_outside(group.block_ids, 1, num_blocks)
        if bad is not None:
            raise WireError(
                f"groups[{entry}] (group {group.group_id}): block id {bad[1]} at position "
                f"{bad[0]} not in [1, {num_blocks})"
            )


def _validate(
    validator: BlockValidator,
    group_id: int,
    block_ids: list[int],
    hashes: list[bytes],
    lease: LeaseRef | None,
) -> list[int]:
    """Sorted distinct positions ``validator`` rejects (``lease``: the read's).

    Raises:
        RuntimeError: the validator returned a position outside ``block_ids`` (a connector bug).
    """
    positions = sorted({int(p) for p in validator(group_id, block_ids, hashes, lease)})
    if positions and not (positions[0] >= 0 and positions[-1] < len(block_ids)):
        raise RuntimeError(
            f"block_validator returned positions {positions} for {len(block_ids)} blocks"
        )
    return positions


def find_mismatched(
    read: Read, validator: BlockValidator | None, *, serve_unchecked: bool = True
) -> list[list[int]]:
    """Holder side, when a ``Read`` arrives: positions per group entry whose block fails the
    expected-hash check (sorted). A group sent without expected hashes is served whole when
    ``serve_unchecked`` (``HolderCallbacks.serve_unchecked_reads``), else refused whole: the
    connector's holder and the store serve a block only against a hash or a lease.

    Raises:
        RuntimeError: the validator returned a position outside the group (a connector bug).
    """
    mismatched: list[list[int]] = []
    for group in read.groups:
        if group.expected_hashes is None:
            mismatched.append([] if serve_unchecked else list(range(len(group.block_ids))))
        elif validator is None or not group.block_ids:
            mismatched.append([])
        else:
            mismatched.append(
                _validate(
                    validator, group.group_id, group.block_ids, group.expected_hashes, read.lease
                )
            )
    return mismatched


def expects_read_done(read: Read) -> bool:
    """Whether the holder ends ``read`` with a ``ReadDone`` (and the requester waits for it):
    exactly when some group sends expected hashes, so reads without hashes cost no extra
    message; never for a ``copy_first`` read, whose lease the holder pins instead of
    re-checking (``cma_read``)."""
    return not read.copy_first and any(group.expected_hashes is not None for group in read.groups)


def recheck_blocks(
    group: GroupReadMsg,
    positions: Sequence[int],
    validator: BlockValidator | None,
    lease: LeaseRef | None,
) -> list[int]:
    """Holder side, right after a chunk's bytes were copied out: the ``positions`` of ``group``
    (block positions of the read, ascending) whose block no longer carries its expected hash,
    or whose ``lease`` (the read's ``Read.lease``) no longer covers it. One validator call over
    the chunk's blocks; ``[]`` without hashes or validator.

    Raises:
        RuntimeError: the validator returned a position outside the chunk (a connector bug).
    """
    if group.expected_hashes is None or validator is None or not positions:
        return []
    hashes = group.expected_hashes
    block_ids = [group.block_ids[p] for p in positions]
    bad = _validate(validator, group.group_id, block_ids, [hashes[p] for p in positions], lease)
    return [positions[i] for i in bad]


def check_read_done(read: Read, mismatched: Sequence[Sequence[int]], late: list[list[int]]) -> None:
    """Requester side: ``late`` (a ``ReadDone``) must name, per group entry, only positions the
    holder sent (not already ``mismatched`` at ``ReadOk``), each once.

    Raises:
        WireError: naming the first entry that does not fit.
    """
    if len(late) != len(read.groups):
        raise WireError(f"ReadDone has {len(late)} entries for {len(read.groups)} groups")
    for entry, (group, early, positions) in enumerate(
        zip(read.groups, mismatched, late, strict=True)
    ):
        refused = set(early)
        fits = all(0 <= p < len(group.block_ids) and p not in refused for p in positions)
        if not fits or len(set(positions)) != len(positions):
            raise WireError(
                f"ReadDone entry {entry}: positions {positions} are not distinct positions sent "
                f"({len(group.block_ids)} blocks, {len(early)} refused at ReadOk)"
            )
