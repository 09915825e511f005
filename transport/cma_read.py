"""The same-host data path of a read, requester side: ``CmaReadPath`` copies the blocks straight
out of the holder's KV tensors (``cma``: ``process_vm_readv``, one copy, no staging, no UCX
message; holder side: ``cma_serve``).

The read is a ``Read`` with ``cma`` set. The copy plan is made while the holder checks the read
(every position), and made again only when ``ReadOk`` names mismatched blocks; after the copy the
holder's probe is read again (the process is still the one checked at handshake), and a read
with expected hashes sends ``ReadCopied`` and waits for the holder's ``ReadDone``::

    send Read(cma) ──> plan ──> ReadOk(mismatched) ──> copy good blocks ──> probe
                   ──> ReadCopied ──> ReadDone(mismatched)      only with expected hashes

A read under a handoff's lease with expected hashes in every group (``Read.copy_first``: the
prefill-to-decode handoff) costs one round trip, overlapped with the copy: it copies every
block while the holder checks the read, and ``ReadOk``'s mismatches fail::

    send Read(cma, copy_first) ──> copy every block ──> probe ──> ended before the deadline?
                               ──> ReadCopied (the holder unpins) ──> ReadOk(mismatched)

Why that is safe without a re-check: the holder vouches for a block of such a read only
through the read's own lease (``HolderCallbacks.lease_validator``; a block the prefix cache
merely lists may be reused and recomputed during the copy), and before ``ReadOk`` it pins that
lease for the read's copy window (its deadline, at most ``serve.COPY_FIRST_MAX_S``) plus
``serve.DEADLINE_GRACE_S`` from when it got the ``Read`` (``HolderCallbacks.lease_pin``). A
lease held at the check has held its blocks, unchanged, since before its ticket existed (so
since before the copy began), and the pin keeps them so past this read's copy window, which
started before the ``Read`` went out: a copy that ended within it (checked here after the
copy, on the same host's monotonic clock) read unchanged blocks whether the check came before
the copy or after it. A refused block's bytes did land
in this node's own block; it counts as failed.

With a holder that offers a block board (``CmaOffer.board_address``), a ``copy_first`` read
first tries without the holder at all (``cma_board``): it checks the board, copies, and checks
the board again; only when a check does not pass does it send the ``Read`` as above::

    board entries match? ──> copy every block ──> probe ──> board unchanged? ──> landed

A copy that fails on memory the kernel will not read (not a holder that is gone) adds the
holder's incarnation to ``unreadable_incarnations``: its later connections go over UCX.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import msgspec
import torch

from .base import ReadResult
from .cma import CmaPeer, CmaPlan, CmaReadError
from .cma_board import BoardCounts
from .cma_one_sided import OneSidedRead
from .control import HolderConnection
from .errors import TransferError, TransportError
from .heads import heads_error
from .metadata import NodeMetadata
from .plan import block_nbytes_by_entry, pick
from .read_path import DropConnection, ReadPath
from .serve import copy_first_window_s
from .transfer import ReadState
from .wire import Message, Read, ReadCopied

logger = logging.getLogger(__name__)


class CmaReadPath(ReadPath):
    """One read by a same-host copy (see the module docstring); ``conn.cma`` is the accepted
    offer.

    Args:
        kv_caches_by_group: this node's ``[group][layer]`` KV tensors (the local blocks of the
            read are written).
        unreadable_incarnations: incarnations of holders whose memory could not be read; this
            read adds its holder's when that happens (mutated).
        on_batch: runs before every copy call (tests interleave failures with it).
        board_counts: the transport's count of one-sided reads and fallbacks (mutated).
    """

    name = "cma"
    progresses_ucx = False

    def __init__(
        self,
        conn: HolderConnection,
        read: Read,
        state: ReadState,
        *,
        metadata: NodeMetadata,
        drop_connection: DropConnection,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        unreadable_incarnations: set[str],
        on_batch: Callable[[], None] | None = None,
        board_counts: BoardCounts | None = None,
    ):
        assert isinstance(conn.cma, CmaPeer)
        # Copy before the holder's check only from blocks (and KV heads) its layout has: a
        # ticket's ids are network input, and the holder refuses the others before anything is
        # copied.
        copy_first = (
            read.lease is not None
            and heads_error(conn.remote, read.heads) is None
            and all(group.expected_hashes is not None for group in read.groups)
            and all(
                not group.block_ids
                or max(group.block_ids) < conn.remote.groups[group.group_id].num_blocks
                for group in read.groups
            )
        )
        read = msgspec.structs.replace(read, cma=True, copy_first=copy_first)
        # before the Read goes out, so never later than the holder's pin (module docstring)
        self._copy_deadline_at = time.monotonic() + copy_first_window_s(read)
        super().__init__(conn, read, state, metadata=metadata, drop_connection=drop_connection)
        self._peer: CmaPeer = conn.cma
        self._caches = kv_caches_by_group
        self._unreadable = unreadable_incarnations
        self._on_batch = on_batch
        self._plan: CmaPlan | None = None
        self._board_counts = board_counts if board_counts is not None else BoardCounts()

    def _before_reply(self) -> None:
        if heads_error(self.conn.remote, self.read.heads) is None:  # else the holder refuses
            self._plan = self._make_plan(None)  # while the holder checks the read

    async def _exchange(
        self,
        reply_future: asyncio.Future[Message],
        done_future: asyncio.Future[Message] | None,
    ) -> ReadResult:
        if not self.read.copy_first:
            return await super()._exchange(reply_future, done_future)
        if self._peer.offer.board_address is not None:
            self.state.phase = "copying after the holder's board"
            try:
                landed = await self._one_sided()
            except TransferError:
                await self._fail()  # the next read reconnects (over UCX if memory was unreadable)
                raise
            if landed:
                self._board_counts.add(one_sided=1)
                return self.state.result()
            self._board_counts.add(fallbacks=1)
        read, state = self.read, self.state
        try:
            state.phase = "sending Read"
            await self.conn.send(read)
        except TransportError as exc:
            raise state.error(TransferError, str(exc)) from None
        self._plan = self._make_plan(None)
        try:
            state.phase = "copying before ReadOk"
            await self._land([list(range(len(group.block_ids))) for group in read.groups])
            if time.monotonic() >= self._copy_deadline_at:
                raise state.error(
                    TransferError, "the copy ended past the read's deadline (the holder's pin)"
                )
            await self._before_read_done()  # ReadCopied: the holder unpins the lease
            state.phase = "waiting for ReadOk"
            refused = self._check_reply(await reply_future)
            state.refuse_landed(refused, block_nbytes_by_entry(self._metadata, read))
            state.confirmed = True
            return state.result()
        except asyncio.CancelledError:
            raise  # drive_read runs abort()
        except BaseException as exc:
            await self._fail()  # the holder's serve is waiting: drop the connection
            if isinstance(exc, TransportError) and not isinstance(exc, TransferError):
                raise state.error(TransferError, str(exc)) from None
            raise

    async def _one_sided(self) -> bool:
        """The read checked on the holder's board alone (module docstring). True: every block
        landed and ``state`` says so; False: nothing counted (bytes may have been written into
        this read's own local blocks), ask the holder.

        Raises:
            TransferError: the holder is gone, or its memory could not be copied.
        """
        read, state = self.read, self.state
        assert read.lease is not None  # copy_first
        one = OneSidedRead(
            self._peer, self.conn.remote, self._caches, read.groups, state.local_block_ids,
            read.lease, heads=read.heads, local=self._metadata,
        )
        try:
            if not one.before_copy():
                return False
            assert one.plan is not None
            await self._peer.copy(one.plan, self._on_batch)
            if not one.after_copy():
                return False
        except CmaReadError as exc:
            self._copy_failed(exc)
        for entry, group in enumerate(read.groups):
            state.landed[entry].update(range(len(group.block_ids)))
        state.num_bytes_landed += one.plan.nbytes
        state.confirmed = True
        return True

    def _copy_failed(self, exc: CmaReadError) -> NoReturn:
        """Raise the read's ``TransferError`` for a failed copy; a holder whose memory is
        unreadable (not gone) is read over UCX from now on."""
        remote = self.conn.remote
        if exc.errno_name != "ESRCH":  # not "the holder is gone": its memory is unreadable
            logger.warning(
                "same-host copy from %s failed (%s); its reads go over UCX from now on",
                remote.engine_id,
                exc,
            )
            self._unreadable.add(remote.incarnation)
        raise self.state.error(
            TransferError, f"same-host copy from {remote.engine_id!r} failed: {exc}"
        ) from None

    async def _land(self, good: list[list[int]]) -> None:
        """Copy the ``good`` blocks, then re-read the holder's probe. Mutates ``state`` (landed,
        bytes) only once every block of ``good`` is in.

        Raises:
            TransferError: a copy call failed or the probe changed; every block is named.
        """
        plan = self._plan
        if plan is None or any(self.state.mismatched):
            plan = self._make_plan(good)
        peer = self._peer
        try:
            await peer.copy(plan, self._on_batch)
            if peer.read_probe() != peer.offer.probe:
                raise CmaReadError("the holder's probe changed: another process has its pid")
        except CmaReadError as exc:
            self._copy_failed(exc)
        for entry, positions in enumerate(good):
            self.state.landed[entry].update(positions)
        self.state.num_bytes_landed += plan.nbytes

    def _make_plan(self, good: list[list[int]] | None) -> CmaPlan:
        """The copy plan of the ``good`` positions of each group entry, or of every position
        (``None``: planned before ``ReadOk``, used when nothing mismatched)."""
        entries = []
        for entry, group in enumerate(self.read.groups):
            positions = range(len(group.block_ids)) if good is None else good[entry]
            remote = pick(group.block_ids, positions, 0, len(positions))
            local = pick(self.state.local_block_ids[entry], positions, 0, len(positions))
            entries.append((group.group_id, remote, local))
        return self._peer.plan(self._caches, entries, heads=self.read.heads, local=self._metadata)

    async def _before_read_done(self) -> None:
        await self.conn.send(ReadCopied(transfer_id=self.read.transfer_id))

    async def _fail(self) -> None:
        await self._drop_connection(self.conn)
