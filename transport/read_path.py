"""Requester side of one ``UcxxTransport`` read: the control exchange every data path shares,
and ``ReadPath``, the interface a data path implements.

Whatever moves the bytes, a read talks to its holder the same way::

    expect ReadOk, and ReadDone (a read with expected hashes) or ErrorMsg
      ──> send Read ──> ReadOk(mismatched)   fit-checked: one list per group, positions in range
      ──> _land(good positions)              the data path moves the bytes of the good blocks
      ──> ReadDone(mismatched)               only with expected hashes: blocks that failed the
                                             holder's re-check after their bytes left (landed
                                             here, but counted as failed)

A data path is a subclass, chosen once per read from the holder connection
(``UcxxTransport.read_blocks``): ``UcxReadPath`` (``ucx_read``: UCX tag messages through
staging) or ``CmaReadPath`` (``cma_read``: a same-host copy out of the holder's memory). After
``ReadOk`` a holder that fails the read says so with an ``ErrorMsg``, which reaches the read
through ``_holder_word`` (the ``ReadDone`` waiter when there is one).

Failure after ``ReadOk`` (a lost holder, a failed copy, a bad ``ReadDone``) drops the connection
(``_fail``): the holder may still be sending. Cancellation, a deadline, or a cancelled task end
the read through ``abort`` instead (``transfer.drive_read`` runs it once ``run`` has stopped):
a ``Cancel`` bounded by ``CANCEL_REPLY_TIMEOUT_S``, and the connection dropped when no
``CancelOk`` comes.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable
from typing import ClassVar

from .base import ReadResult
from .control import HolderConnection
from .errors import TransferError, TransportError
from .metadata import NodeMetadata
from .plan import block_nbytes_by_entry, check_read_done, expects_read_done, good_positions
from .transfer import ReadState
from .wire import Cancel, CancelOk, ErrorMsg, Message, Read, ReadDone, ReadOk

CANCEL_REPLY_TIMEOUT_S = 2.0

DropConnection = Callable[[HolderConnection], Awaitable[None]]
"""Closes a holder connection and forgets it (``UcxxTransport``), so the next read reconnects."""


class ReadPath(abc.ABC):
    """One read from one holder over one data path; built per read, used once.

    ``run()`` is the read's core (``transfer.drive_read``): it mutates ``state`` (landed
    positions, bytes, mismatches) and the local KV blocks of the read, and returns
    ``state.result()`` or raises ``TransferError`` naming the blocks not landed. ``abort()`` runs
    after ``run()`` was stopped early and leaves nothing of the read in flight on either side.

    Subclasses implement ``_land`` and ``_fail``, and may hook ``_before_reply`` (work that
    overlaps the holder's checks) and ``_before_read_done`` (a message the holder waits for
    before its ``ReadDone``).

    Attributes:
        name: the data path, as ``Transport.peer_data_path`` reports it.
        progresses_ucx: whether the read moves UCX messages, so the event loop must progress
            UCX on every turn while it runs (``ucx_progress``).
    """

    name: ClassVar[str]
    progresses_ucx: ClassVar[bool]

    def __init__(
        self,
        conn: HolderConnection,
        read: Read,
        state: ReadState,
        *,
        metadata: NodeMetadata,
        drop_connection: DropConnection,
    ):
        self.conn = conn
        self.read = read
        self.state = state
        self._metadata = metadata
        self._drop_connection = drop_connection
        self._holder_word: asyncio.Future[Message] | None = None

    async def run(self) -> ReadResult:
        """The read, from ``Read`` to its result (see the module docstring)."""
        conn, transfer_id = self.conn, self.read.transfer_id
        reply_future = conn.expect(transfer_id, ReadOk)
        # registered before the Read goes out: ReadDone may arrive before the last byte lands
        done_future = conn.expect(transfer_id, ReadDone) if expects_read_done(self.read) else None
        # after ReadOk, a holder that fails mid-read says so with an ErrorMsg: to the ReadDone
        # waiter when there is one, else to this one (``HolderConnection`` routes by transfer)
        error_future = conn.expect(transfer_id, ErrorMsg) if done_future is None else None
        self._holder_word = done_future or error_future
        try:
            return await self._exchange(reply_future, done_future)
        finally:
            for kind, future in (
                (ReadOk, reply_future),
                (ReadDone, done_future),
                (ErrorMsg, error_future),
            ):
                conn.forget(transfer_id, kind)
                if future is not None and future.done() and not future.cancelled():
                    future.exception()  # retrieved: a lost connection fails it unawaited

    async def _exchange(
        self,
        reply_future: asyncio.Future[Message],
        done_future: asyncio.Future[Message] | None,
    ) -> ReadResult:
        read, state = self.read, self.state
        try:
            state.phase = "sending Read"
            await self.conn.send(read)
            self._before_reply()
            state.phase = "waiting for ReadOk"
            reply = await reply_future
        except TransportError as exc:
            raise state.error(TransferError, str(exc)) from None
        state.mismatched = self._check_reply(reply)
        good = [
            good_positions(len(g.block_ids), reply.mismatched[i]) for i, g in enumerate(read.groups)
        ]
        try:
            state.phase = "moving the bytes"
            await self._land(good)
            if done_future is not None:
                state.phase = "waiting for ReadDone"
                await self._before_read_done()
                await self._apply_read_done(done_future)
            return state.result()
        except asyncio.CancelledError:
            raise  # drive_read runs abort()
        except BaseException as exc:
            await self._fail()  # the holder may still be sending: drop the connection
            if isinstance(exc, TransportError) and not isinstance(exc, TransferError):
                raise state.error(TransferError, str(exc)) from None
            raise

    def _check_reply(self, reply: Message) -> list[list[int]]:
        """The mismatched positions of the holder's answer to the ``Read``.

        Raises:
            TransferError: the holder refused the read (``ErrorMsg``), or its ``ReadOk`` does
                not fit the read (one list per group entry, positions in range).
        """
        read, state = self.read, self.state
        if isinstance(reply, ErrorMsg):
            raise state.error(TransferError, f"holder refused the read: {reply.message}")
        assert isinstance(reply, ReadOk)
        if len(reply.mismatched) != len(read.groups) or any(
            p >= len(g.block_ids)
            for g, ps in zip(read.groups, reply.mismatched, strict=False)
            for p in ps
        ):
            raise state.error(TransferError, "holder sent a ReadOk that does not fit the read")
        state.lease_pending = reply.lease_pending
        return reply.mismatched

    def _before_reply(self) -> None:  # noqa: B027 (a hook: most paths have nothing to do)
        """Runs right after the ``Read`` went out, while the holder checks it."""

    @abc.abstractmethod
    async def _land(self, good: list[list[int]]) -> None:
        """Move the bytes of the ``good`` positions of each group entry into their local blocks,
        recording each in ``state.landed`` and ``state.num_bytes_landed``.

        Raises:
            TransferError: naming the blocks not landed (``state.error``).
        """

    async def _before_read_done(self) -> None:  # noqa: B027 (a hook, as _before_reply)
        """Runs after ``_land`` for a read with expected hashes, before waiting for
        ``ReadDone``."""

    @abc.abstractmethod
    async def _fail(self) -> None:
        """Clean up after ``_land`` or the ``ReadDone`` failed: drop the connection and release
        whatever the path still holds."""

    async def abort(self) -> None:
        """Stop a read whose ``run()`` was stopped (cancel, deadline, cancelled task): tell the
        holder, and drop the connection when it does not answer. Paths with receives posted
        override this to settle them too."""
        if await self._cancel_on_holder(num_chunks_posted=0) is None:
            await self._drop_connection(self.conn)

    async def _cancel_on_holder(self, num_chunks_posted: int) -> CancelOk | None:
        """Send ``Cancel`` and wait for its ``CancelOk``; None when the connection is gone or
        no answer came within ``CANCEL_REPLY_TIMEOUT_S``."""
        conn, transfer_id = self.conn, self.read.transfer_id
        if not conn.alive:
            return None
        reply_future = conn.expect(transfer_id, CancelOk)
        try:
            # bounded: a frozen holder that stopped reading leaves a full socket behind, and
            # this path outlasts the caller's cancellations (``transfer.drive_read``)
            async with asyncio.timeout(CANCEL_REPLY_TIMEOUT_S):
                await conn.send(
                    Cancel(transfer_id=transfer_id, num_chunks_posted=num_chunks_posted)
                )
                reply = await reply_future
        except (TransportError, TimeoutError):
            conn.forget(transfer_id, CancelOk)
            return None
        return reply if isinstance(reply, CancelOk) else None

    async def _apply_read_done(self, done_future: asyncio.Future[Message]) -> None:
        """Wait for the holder's ``ReadDone`` and fail the blocks it names. Without it the
        hash-checked blocks are unconfirmed and the read fails naming them."""
        read, state = self.read, self.state
        try:
            done = await done_future
            if isinstance(done, ErrorMsg):
                raise TransportError(f"holder failed the read: {done.message}")
            assert isinstance(done, ReadDone)
            check_read_done(read, state.mismatched, done.mismatched)
        except TransportError as exc:  # WireError too: a ReadDone that does not fit the read
            raise state.error(TransferError, f"no valid ReadDone from the holder: {exc}") from None
        state.fail_late(done.mismatched, block_nbytes_by_entry(self._metadata, read))

    def _holder_failure(self) -> str | None:
        """The holder's error message about this read, once one arrived (None otherwise, also
        for an early ``ReadDone`` or a lost connection, which the caller handles)."""
        word = self._holder_word
        if word is None or not word.done() or word.cancelled() or word.exception() is not None:
            return None
        message = word.result()
        return message.message if isinstance(message, ErrorMsg) else None
