"""The UCX data path of a read, requester side: ``UcxReadPath`` receives the holder's chunks as
UCX tag messages (holder side: ``ucx_serve``). The path between hosts and for CUDA tensors.

After ``ReadOk`` (``read_path``) both sides plan the same chunks (``plan.plan_chunks``); chunk
``k`` arrives with tag ``tag_base + k``::

    for chunk k: recv(tag_base + k), ``window`` receives posted ahead,
                 into the KV tensor itself (one layer, a run of local ids)
                 or into reused staging, then copied in off the event loop thread
                 (``staging.copy_in``)

A cancelled, timed-out or task-cancelled read never cancels a receive while the holder lives (a
receive cancelled after it matched a rendezvous leaves the holder's send waiting forever): it
sends ``Cancel(num_chunks_posted)``, the holder completes the posted chunks it never sent with
empty messages and answers how many it issued, and the requester receives and drops the issued
chunks it had not posted. Only when the holder is dead or does not answer is the connection torn
down (its endpoint aborted, which ends every receive still posted on it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .control import HolderConnection
from .errors import TransferError
from .heads import row_slice
from .metadata import NodeMetadata
from .plan import Chunk, pick, plan_chunks
from .read_path import CANCEL_REPLY_TIMEOUT_S, DropConnection, ReadPath
from .staging import StagingPool, chunk_view, copy_in, run_copy, run_start, wire_buffer
from .transfer import ReadState
from .wire import Read

logger = logging.getLogger(__name__)

STALL_CHECK_S = 1.0
"""A chunk's receive pending this long is looked at (``_on_stall``)."""


@dataclass(slots=True)
class _Posted:
    """A receive posted for one chunk: into ``buffer`` (staging) or straight into the KV tensor
    (``buffer`` None); ``target`` is the typed view the bytes land in."""

    recv: asyncio.Future[object]
    buffer: torch.Tensor | None
    target: torch.Tensor


class UcxReadPath(ReadPath):
    """One read over UCX tag messages on the connection's endpoint (see the module docstring).

    Args:
        kv_caches_by_group: this node's ``[group][layer]`` KV tensors (the local blocks of the
            read are written).
        staging: the transport's staging pool (chunks that cannot land in place, drains).
        window: receives posted ahead.
    """

    name = "ucx"
    progresses_ucx = True

    def __init__(
        self,
        conn: HolderConnection,
        read: Read,
        state: ReadState,
        *,
        metadata: NodeMetadata,
        drop_connection: DropConnection,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        staging: StagingPool,
        window: int,
    ):
        super().__init__(conn, read, state, metadata=metadata, drop_connection=drop_connection)
        self._caches = kv_caches_by_group
        self._staging = staging
        self._window = window
        self._chunks: list[Chunk] = []
        self._good: list[list[int]] = []
        self._posted: dict[int, _Posted] = {}  # chunk index -> its receive, until it landed
        self._num_posted = 0  # receives posted so far: chunks [0, _num_posted)

    async def _land(self, good: list[list[int]]) -> None:
        read, state = self.read, self.state
        group_ids = [g.group_id for g in read.groups]
        self._good = good
        chunks = self._chunks = plan_chunks(
            self._metadata, group_ids, [len(p) for p in good], read.chunk_bytes, read.heads
        )
        for chunk_idx in range(min(self._window, len(chunks))):
            self._post(chunk_idx)
        for chunk_idx, chunk in enumerate(chunks):
            posted = self._posted[chunk_idx]
            if not posted.recv.done():
                waits = {posted.recv, self.conn.lost}
                word = self._holder_word
                if word is not None and not word.done():
                    waits.add(word)  # an early ReadDone is fine; an ErrorMsg is not
                self.state.phase = f"receiving chunk {chunk_idx} of {len(chunks)}"
                while not (await asyncio.wait(waits, timeout=STALL_CHECK_S,
                                              return_when=asyncio.FIRST_COMPLETED))[0]:
                    _on_stall(self.read.transfer_id, chunk_idx, posted.recv)
            failure = self._holder_failure()
            if failure is not None:
                raise state.error(TransferError, f"holder failed the read: {failure}")
            if not posted.recv.done() or posted.recv.exception() is not None:
                lost = self.conn.lost.result() if self.conn.lost.done() else "receive failed"
                raise state.error(TransferError, f"holder connection lost: {lost}")
            del self._posted[chunk_idx]
            if chunk_idx + self._window < len(chunks):
                self._post(chunk_idx + self._window)  # keep the window full while this lands
            if posted.buffer is not None:
                group_id = read.groups[chunk.entry].group_id
                try:
                    await run_copy(
                        copy_in,
                        posted.target,
                        self._caches[group_id],
                        self._local_ids(chunk_idx),
                        row_slice(self._metadata, group_id, read.heads),
                        nbytes=posted.target.nbytes,
                        device=self._caches[group_id][0].device,
                    )
                finally:
                    self._staging.release(posted.buffer)
            state.landed[chunk.entry].update(good[chunk.entry][chunk.start : chunk.stop])
            state.num_bytes_landed += posted.target.numel() * posted.target.element_size()

    def _local_ids(self, chunk_idx: int) -> list[int]:
        chunk = self._chunks[chunk_idx]
        local = self.state.local_block_ids[chunk.entry]
        return pick(local, self._good[chunk.entry], chunk.start, chunk.stop)

    def _post(self, chunk_idx: int) -> None:
        """Post the receive of chunk ``chunk_idx``: into the KV tensor itself when the chunk is
        one layer's run of ids read whole, else into staging."""
        chunk = self._chunks[chunk_idx]
        group_id = self.read.groups[chunk.entry].group_id
        caches = self._caches[group_id]
        ids = self._local_ids(chunk_idx)
        row = row_slice(self._metadata, group_id, self.read.heads)
        in_place = len(caches) == 1 and row.whole and self._staging.in_place(caches)
        start = run_start(ids) if in_place else None
        buffer: torch.Tensor | None = None
        if start is not None:
            target = caches[0][start : start + len(ids)]
        else:
            layout = self._metadata.groups[group_id]
            buffer = self._staging.acquire()
            target = chunk_view(
                buffer, layout.num_layers, len(ids), layout.block_shape, caches[0].dtype, row
            )
        recv = asyncio.ensure_future(
            self.conn.endpoint.recv(  # type: ignore[attr-defined]
                wire_buffer(target), tag=self.read.tag_base + chunk_idx, force_tag=True
            )
        )
        self._posted[chunk_idx] = _Posted(recv=recv, buffer=buffer, target=target)
        self._num_posted = chunk_idx + 1

    async def _fail(self) -> None:
        await self._drop_connection(self.conn)  # aborts the endpoint: the receives end
        await self._settle([], 1.0)

    async def abort(self) -> None:
        """Stop the read leaving no UCX request posted or issued.

        The holder is told how many receives are posted; it completes the ones it never sent
        with empty messages and answers how many it issued, and the chunks issued beyond the
        posted ones are received into scratch staging. If the holder does not answer or the
        connection is gone, the connection is torn down, which aborts its endpoint and with it
        every receive still posted (staging whose receive does not end is forgotten, not
        reused).
        """
        conn = self.conn
        drains: list[tuple[asyncio.Future[object], torch.Tensor]] = []
        reply = await self._cancel_on_holder(self._num_posted)
        torn_down = reply is None
        if reply is not None:
            for chunk_idx in range(self._num_posted, reply.num_chunks_issued):
                buffer = self._staging.acquire()
                recv = asyncio.ensure_future(
                    conn.endpoint.recv(  # type: ignore[attr-defined]
                        wire_buffer(buffer), tag=self.read.tag_base + chunk_idx, force_tag=True
                    )
                )
                drains.append((recv, buffer))
        pending = [p.recv for p in self._posted.values()] + [recv for recv, _ in drains]
        if pending and not torn_down:
            await asyncio.wait([*pending, conn.lost], timeout=CANCEL_REPLY_TIMEOUT_S)
            torn_down = not all(f.done() for f in pending)
        if torn_down:
            await self._drop_connection(conn)
        await self._settle(drains, 1.0)

    async def _settle(
        self, drains: list[tuple[asyncio.Future[object], torch.Tensor]], timeout_s: float
    ) -> None:
        """Wait up to ``timeout_s`` for the read's receives to end (completed, or cancelled by an
        endpoint abort), then release their staging; a buffer UCX may still write is forgotten."""
        pending = [p.recv for p in self._posted.values()] + [recv for recv, _ in drains]
        if pending and not all(f.done() for f in pending):
            await asyncio.wait(pending, timeout=timeout_s)
        for recv in pending:
            if recv.done() and not recv.cancelled():
                recv.exception()  # retrieved: a cancelled receive is expected here
        owned = [(p.recv, p.buffer) for p in self._posted.values()] + list(drains)
        self._posted.clear()
        for recv, buffer in owned:
            if buffer is None:
                continue
            if recv.done():
                self._staging.release(buffer)
            else:
                self._staging.forget(buffer)


def _on_stall(transfer_id: int, chunk_idx: int, recv: asyncio.Future[object]) -> None:
    """A receive still pending after ``STALL_CHECK_S``: say whether UCX has completed it or not
    (the holder has not sent it, or UCX has not moved it). Completed, the coroutine awaiting it
    has not run since: in the ``"blocking"`` mode it polls the request on its turns of the
    loop (a late loop), in the thread modes ucxx's notifier sets its future, and that notifier
    is run once more here, on the loop thread, as ucxx's notifier thread has it run."""
    coro = recv.get_coro() if isinstance(recv, asyncio.Task) else None
    frame = getattr(coro, "cr_frame", None)
    request = None if frame is None else frame.f_locals.get("req")
    completed = getattr(request, "completed", None)
    logger.warning("transfer %d: the receive of chunk %d is pending after %.1f s; UCX request "
                   "completed: %s", transfer_id, chunk_idx, STALL_CHECK_S, completed)
    if completed:
        import ucxx  # (imported by the transport already)

        context = ucxx.core._get_ctx()
        if context.enable_python_future:  # else nothing waits on a notifier
            context.worker.run_request_notifier()
