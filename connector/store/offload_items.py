"""The records offload passes between a node's two connector halves: ``OffloadItem`` (scheduler
-> worker, in the step's connector metadata: which block to write to the store) and
``OffloadOutcome`` (worker -> scheduler, in the step's worker output: whether the store now holds
it). Plain ints, bytes and bools, so msgpack packs each as an array; ``*_from_wire`` turn the
decoded arrays back into records, checking every field (the halves may be separate processes)."""

from __future__ import annotations

from typing import Any, NamedTuple

from .wire import MAX_BLOCKS_PER_PUT, MAX_GROUPS, MAX_HASH_BYTES, StoreWireError

__all__ = ["OffloadItem", "OffloadOutcome", "items_from_wire", "outcomes_from_wire"]


class OffloadItem(NamedTuple):
    """Write block ``block_id`` of KV cache group ``group_id`` to the store as ``block_hash``
    (the bare block hash, without the group suffix); ``parent_hash`` precedes it in its chain
    (``b""`` for a request's first block)."""

    block_id: int
    group_id: int
    block_hash: bytes
    parent_hash: bytes

    @property
    def key(self) -> tuple[int, bytes]:
        """``(group_id, block_hash)``: what an ``OffloadOutcome`` reports on."""
        return self.group_id, self.block_hash


class OffloadOutcome(NamedTuple):
    """What became of one submitted ``OffloadItem``: ``held`` when the store holds the block now
    (stored, or held already); not held when it was skipped (back-pressure), refused (the store
    had no room) or its write failed; the planner may then plan it again.

    With ``missing`` (``held`` then False) it is no item's outcome but a store's report: a put's
    reply named this block as the first ancestor it does not hold of blocks it cannot publish
    (``wire.PutReply.missing_ancestors``), e.g. one it dropped since this node wrote it."""

    group_id: int
    block_hash: bytes
    held: bool
    missing: bool = False

    @property
    def key(self) -> tuple[int, bytes]:
        return self.group_id, self.block_hash


def _check_list(obj: Any, name: str) -> list[Any]:
    if type(obj) is not list or len(obj) > MAX_BLOCKS_PER_PUT * MAX_GROUPS:
        raise StoreWireError(f"{name} must be a list of <= {MAX_BLOCKS_PER_PUT * MAX_GROUPS}")
    return obj


def _check_int(value: Any, name: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise StoreWireError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _check_hash(value: Any, name: str, *, allow_empty: bool) -> bytes:
    lo = 0 if allow_empty else 1
    if type(value) is not bytes or not lo <= len(value) <= MAX_HASH_BYTES:
        raise StoreWireError(f"{name} must be bytes of {lo}..{MAX_HASH_BYTES}")
    return value


def items_from_wire(obj: Any) -> list[OffloadItem]:
    """Decoded msgpack (a list of ``[block_id, group_id, block_hash, parent_hash]``) -> items.
    Raises StoreWireError naming the first bad field (block ids are range-checked against the
    KV tensors by ``OffloadSender.submit``)."""
    items: list[OffloadItem] = []
    for i, raw in enumerate(_check_list(obj, "offload items")):
        if type(raw) not in (list, tuple) or len(raw) != 4:
            raise StoreWireError(f"offload item [{i}] must be a 4-element array")
        items.append(
            OffloadItem(
                block_id=_check_int(raw[0], f"offload item [{i}].block_id", 0, 1 << 40),
                group_id=_check_int(raw[1], f"offload item [{i}].group_id", 0, MAX_GROUPS - 1),
                block_hash=_check_hash(
                    raw[2], f"offload item [{i}].block_hash", allow_empty=False
                ),
                parent_hash=_check_hash(
                    raw[3], f"offload item [{i}].parent_hash", allow_empty=True
                ),
            )
        )
    return items


def outcomes_from_wire(obj: Any) -> list[OffloadOutcome]:
    """Decoded msgpack (a list of ``[group_id, block_hash, held, missing]``; ``missing`` may be
    left out: False, so a 3-element array is never a missing-ancestor name) -> outcomes.
    Raises StoreWireError naming the first bad field. (The halves' own reports travel in
    ``metadata.KVBridgeWorkerMeta``, whose schema checks the same shape.)"""
    outcomes: list[OffloadOutcome] = []
    for i, raw in enumerate(_check_list(obj, "offload outcomes")):
        if (
            type(raw) not in (list, tuple)
            or len(raw) not in (3, 4)
            or type(raw[2]) is not bool
            or (len(raw) == 4 and (type(raw[3]) is not bool or (raw[2] and raw[3])))
        ):
            raise StoreWireError(
                f"offload outcome [{i}] must be [group_id, block_hash, held, missing] (not "
                "both held and missing)"
            )
        outcomes.append(
            OffloadOutcome(
                group_id=_check_int(raw[0], f"offload outcome [{i}].group_id", 0, MAX_GROUPS - 1),
                block_hash=_check_hash(
                    raw[1], f"offload outcome [{i}].block_hash", allow_empty=False
                ),
                held=raw[2],
                missing=len(raw) == 4 and raw[3],
            )
        )
    return outcomes
