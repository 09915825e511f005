"""Requester-side bookkeeping of one read, and the deadline / cancel / abort driver both
transports share.

A read's outcome is exactly one of: ``ReadResult`` (every good block landed), or a
``TransferError`` naming the local blocks that did not land. ``landed`` records, per group entry,
the positions already scattered, so the error can name exactly the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from .base import GroupRead, ReadResult
from .errors import TransferCancelledError, TransferError, TransferTimeoutError
from .heads import heads_error
from .metadata import NodeMetadata
from .plan import build_group_msgs
from .wire import GroupReadMsg, LeaseRef, Read

logger = logging.getLogger(__name__)

_TRANSFER_IDS = itertools.count(1)
_TAG_PREFIX = int.from_bytes(os.urandom(2), "big") << 46


def next_transfer_id() -> int:
    """A transfer id unique in this process (> 0)."""
    return next(_TRANSFER_IDS)


def tag_base_for(transfer_id: int) -> int:
    """UCX tag of chunk 0 of a transfer; chunk ``k`` uses ``tag_base + k``. Tags are matched on
    the requester's worker only, so they must be unique per requester process: a random prefix
    plus the transfer id shifted past the largest chunk index."""
    return _TAG_PREFIX | ((transfer_id & ((1 << 26) - 1)) << 20)


@dataclass(kw_only=True, slots=True)
class ReadState:
    """One in-flight read on the requester.

    A group entry with expected hashes counts as landed only once the holder's ``ReadDone``
    was applied (``fail_late`` sets ``confirmed``): until then its blocks' bytes may be torn
    (evicted and reused on the holder during the copy), so every error path names them as
    not landed, whatever ended the read (lost connection, deadline, cancel).
    """

    request_id: str
    transfer_id: int
    groups: list[GroupReadMsg]
    local_block_ids: list[list[int]]
    landed: list[set[int]] = field(default_factory=list)
    mismatched: list[list[int]] = field(default_factory=list)
    num_bytes_landed: int = 0
    lease_pending: bool = False  # the holder's ``ReadOk.lease_pending``
    confirmed: bool = False
    phase: str = "connected"  # what the read waits for now (a deadline's error names it)
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.landed = [set() for _ in self.groups]
        self.mismatched = [[] for _ in self.groups]

    def not_landed(self) -> tuple[int, ...]:
        """Local ids (request order) that did not land, hash-checked ones not yet confirmed by
        the holder's ``ReadDone`` included."""
        unconfirmed = not self.confirmed
        return tuple(
            block_id
            for entry, local in enumerate(self.local_block_ids)
            for position, block_id in enumerate(local)
            if position not in self.landed[entry]
            or (unconfirmed and self.groups[entry].expected_hashes is not None)
        )

    def fail_late(
        self, late: Sequence[Sequence[int]], block_nbytes_by_entry: Sequence[int]
    ) -> None:
        """Apply a ``ReadDone``: positions ``late[entry]`` (landed, checked by
        ``plan.check_read_done``) failed the holder's re-check, so they count as failed, never as
        landed, and their ``block_nbytes_by_entry[entry]`` bytes (all layers) leave
        ``num_bytes_landed``; the other landed blocks are ``confirmed``. Mutates ``landed``,
        ``mismatched``, ``num_bytes_landed`` and ``confirmed``.

        Raises:
            RuntimeError: a late position had not landed (the caller skipped the check).
        """
        for entry, positions in enumerate(late):
            if not positions:
                continue
            missing = set(positions) - self.landed[entry]
            if missing:
                raise RuntimeError(
                    f"entry {entry}: late mismatches {sorted(missing)} never landed "
                    f"({len(self.landed[entry])} positions landed)"
                )
            self.landed[entry].difference_update(positions)
            self.mismatched[entry] = sorted({*self.mismatched[entry], *positions})
            self.num_bytes_landed -= len(positions) * block_nbytes_by_entry[entry]
        self.confirmed = True

    def refuse_landed(
        self, refused: Sequence[Sequence[int]], block_nbytes_by_entry: Sequence[int]
    ) -> None:
        """Apply a ``ReadOk`` that came after the bytes were copied (``Read.copy_first``):
        positions ``refused[entry]`` landed but the holder refused them, so they count as
        mismatched, and their bytes leave ``num_bytes_landed``. Nothing is confirmed yet (the
        ``ReadDone`` does that, ``fail_late``). Mutates ``landed``, ``mismatched`` and
        ``num_bytes_landed``."""
        for entry, positions in enumerate(refused):
            landed = self.landed[entry]
            dropped = landed.intersection(positions)
            landed.difference_update(dropped)
            self.mismatched[entry] = sorted({*self.mismatched[entry], *positions})
            self.num_bytes_landed -= len(dropped) * block_nbytes_by_entry[entry]

    def result(self) -> ReadResult:
        failed = tuple(
            self.local_block_ids[entry][p] for entry, bad in enumerate(self.mismatched) for p in bad
        )
        return ReadResult(
            request_id=self.request_id,
            num_blocks_landed=sum(len(s) for s in self.landed),
            num_bytes_landed=self.num_bytes_landed,
            failed_local_block_ids=failed,
            lease_pending=self.lease_pending and bool(failed),
        )

    def error(self, cls: type[TransferError], message: str) -> TransferError:
        return cls(message, request_id=self.request_id, local_block_ids=self.not_landed())


async def drive_read(
    state: ReadState,
    core: Awaitable[ReadResult],
    abort: Callable[[str], Awaitable[None]],
    deadline_s: float,
) -> ReadResult:
    """Run ``core`` until it finishes, ``deadline_s`` passes, ``state.cancel_event`` is set, or
    the calling task is cancelled. In the last three cases ``abort(reason)`` runs (it stops the
    core and releases staging on both sides) before this returns or raises.

    Raises:
        TransferTimeoutError, TransferCancelledError: naming the local blocks not landed.
        TransferError: from ``core``.
        asyncio.CancelledError: the calling task was cancelled.
    """
    core_task = asyncio.ensure_future(core)
    cancel_task = asyncio.ensure_future(state.cancel_event.wait())
    deadline_at = time.monotonic() + deadline_s
    try:
        done, _ = await asyncio.wait(
            {core_task, cancel_task}, timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        await _stop(core_task, cancel_task, abort, "task cancelled")
        raise
    if core_task in done:
        cancel_task.cancel()
        return core_task.result()
    if cancel_task in done:
        await _stop(core_task, cancel_task, abort, "cancelled")
        raise state.error(TransferCancelledError, "read cancelled")
    logger.warning("read %d of %r missed its %.3f s deadline (%s; the loop woke %.3f s after it), "
                   "waiting at %s", state.transfer_id, state.request_id, deadline_s, state.phase,
                   time.monotonic() - deadline_at, _awaiting(core_task.get_coro()))
    await _stop(core_task, cancel_task, abort, "deadline passed")
    raise state.error(TransferTimeoutError, f"no completion within the {deadline_s:.3f} s deadline "
                      f"({state.phase})")


def _awaiting(coro: object) -> str:
    """Where a suspended coroutine waits: its chain of awaits, outermost first."""
    where = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None)
        if frame is None:  # a future, a task, or a generator-based awaitable: the chain ends
            where.append(type(coro).__name__)
            break
        where.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:"
                     f"{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None)
    return " > ".join(where)


async def _stop(
    core_task: asyncio.Future[ReadResult],
    cancel_task: asyncio.Future[object],
    abort: Callable[[str], Awaitable[None]],
    reason: str,
) -> None:
    """Cancel the core, wait until it has ended (it joins its copy threads and releases its
    staging), then run ``abort`` (it tells the holder and settles UCX requests) to its end.

    Both waits outlast further cancellations of the caller: returning earlier would let bytes
    land in local blocks that the caller is about to hand to another request. A cancellation
    that arrived meanwhile is raised afterwards.
    """
    cancel_task.cancel()
    core_task.cancel()
    cancelled = await _wait_out(core_task)
    abort_task = asyncio.ensure_future(abort(reason))
    cancelled |= await _wait_out(abort_task)
    if cancelled:  # the caller's cancellation wins over an abort's own error
        raise asyncio.CancelledError
    if not abort_task.cancelled() and abort_task.exception() is not None:
        raise abort_task.exception()  # type: ignore[misc]


async def _wait_out(task: asyncio.Future[object]) -> bool:
    """Wait until ``task`` is done, through any number of cancellations of the caller; whether
    there were any. The task's own outcome is left for the caller (retrieved here if an error
    of a cancelled core, which ``drive_read`` replaces with its own)."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if not task.cancelled():
        task.exception()
    return cancelled


def begin_read(
    metadata: NodeMetadata,
    request_id: str,
    groups: Sequence[GroupRead],
    *,
    deadline_s: float,
    chunk_bytes: int,
    lease: LeaseRef | None = None,
    heads: tuple[int, int] | None = None,
) -> tuple[Read, ReadState]:
    """The ``Read`` message and the requester's ``ReadState`` of a new read (both transports);
    ``lease`` travels as ``Read.lease``, ``heads`` as ``Read.heads`` (None: the heads this node
    holds, when it names them, ``NodeMetadata.kv_heads``; else whole rows).

    Raises:
        ValueError: ``deadline_s <= 0``, groups that do not fit ``metadata``
            (``plan.build_group_msgs``), or heads this node's blocks do not hold
            (``heads.heads_error``).
    """
    if deadline_s <= 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    if heads is None and metadata.kv_heads is not None:
        heads = metadata.held_heads
    if heads is not None:
        heads = (int(heads[0]), int(heads[1]))
        if not 0 <= heads[0] < heads[1]:
            raise ValueError(f"heads {heads}: not a run of KV heads")
    error = heads_error(metadata, heads)
    if error is not None:
        raise ValueError(f"cannot receive KV heads {heads}: {error}")
    msgs, local_block_ids = build_group_msgs(metadata, groups)
    transfer_id = next_transfer_id()
    state = ReadState(
        request_id=request_id,
        transfer_id=transfer_id,
        groups=msgs,
        local_block_ids=local_block_ids,
    )
    read = Read(
        transfer_id=transfer_id,
        request_id=request_id,
        tag_base=tag_base_for(transfer_id),
        chunk_bytes=chunk_bytes,
        deadline_ms=max(1, int(deadline_s * 1000)),
        groups=msgs,
        lease=lease,
        heads=heads,
    )
    return read, state
