"""The UCX data path of a read, holder side: ``UcxServe`` streams the requested blocks to the
requester in staging chunks over UCX tag sends (requester side: ``ucx_read``).

For chunk ``k`` of the plan (``plan.plan_chunks``, the same on both sides): send from the KV
tensor itself (one layer, a run of ids) or gather into reused staging off the event loop thread
(``staging.copy_out``), and send with tag ``tag_base + k`` on the connection's one endpoint; at
most ``window`` chunks in flight. A read with expected hashes re-checks each chunk's blocks once
their bytes were copied out (a staged chunk right after its gather, a zero-copy chunk once its
send completed: UCX has read the tensor by then) and ends with ``ReadDone``.

A ``Cancel(num_chunks_posted)`` stops new sends, completes posted chunks never sent with empty
messages and answers how many were issued (the requester drains those), so nothing is left
waiting. A closed control connection (dead requester) aborts the endpoint at once, ending every
send issued to it (``ucxx_holder``); a serve past its deadline plus ``serve.DEADLINE_GRACE_S``
drops its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import BlockValidator
from .heads import row_slice
from .metadata import NodeMetadata
from .plan import Chunk, expects_read_done, good_positions, pick, plan_chunks, recheck_blocks
from .serve import RequesterConnection, Serve, ServeCount
from .staging import StagingPool, chunk_view, copy_out, run_copy, run_start, wire_buffer
from .ucx_progress import ProgressBooster
from .wire import Read

logger = logging.getLogger(__name__)

_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass(slots=True)
class _InFlight:
    """One issued chunk send: from staging ``buffer`` (re-checked already) or, ``buffer`` None,
    straight from the KV tensor: then ``recheck`` holds the chunk's (entry, positions) to
    re-check once the send completed."""

    send: asyncio.Future[object]
    buffer: torch.Tensor | None
    recheck: tuple[int, list[int]] | None


class UcxServe(Serve):
    """One read served over UCX tag sends (see the module docstring).

    Args (beyond ``Serve``'s):
        kv_caches_by_group, metadata: this node's KV tensors (read only) and their layout.
        pool: staging of this read's chunk size (``UcxxHolder.pool_for``).
        window: chunk sends in flight at most.
        booster: the holder's UCX progress booster (``ucx_progress``).
    """

    def __init__(
        self,
        conn: RequesterConnection,
        read: Read,
        mismatched: list[list[int]],
        *,
        recheck_validator: BlockValidator | None,
        count: ServeCount,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        metadata: NodeMetadata,
        pool: StagingPool,
        window: int,
        booster: ProgressBooster,
    ):
        super().__init__(conn, read, mismatched, recheck_validator=recheck_validator, count=count)
        self._caches = kv_caches_by_group
        self._metadata = metadata
        self._pool = pool
        self._window = window
        self._booster = booster
        self.num_chunks_issued = 0
        self._stopped_issuing = asyncio.Event()
        self._late: list[list[int]] = [[] for _ in read.groups]  # per entry: failed re-checks

    async def cancel(self, num_chunks_posted: int) -> int:
        self.cancelled = True
        await self._stopped_issuing.wait()  # at most one gather away
        issued = self.num_chunks_issued
        conn = self.conn
        for chunk_idx in range(issued, num_chunks_posted):
            # an empty message completes the requester's receive for a chunk never sent
            filler = asyncio.ensure_future(
                conn.endpoint.send(  # type: ignore[attr-defined]
                    _EMPTY, tag=self.read.tag_base + chunk_idx, force_tag=True
                )
            )
            conn.fillers.add(filler)
            filler.add_done_callback(_settle_filler(conn.fillers))
        return issued

    async def _serve(self) -> None:
        """Ends when every issued send completed (then, for a read with expected hashes,
        ``ReadDone`` goes out), the requester cancelled (and drains what was issued), the
        connection dropped, or the deadline plus a grace period passed (then the requester is
        not receiving: the connection is dropped)."""
        read = self.read
        pending: deque[_InFlight] = deque()
        try:
            good = [
                good_positions(len(g.block_ids), bad)
                for g, bad in zip(read.groups, self.mismatched, strict=True)
            ]
            group_ids = [g.group_id for g in read.groups]
            chunks = plan_chunks(
                self._metadata, group_ids, [len(p) for p in good], read.chunk_bytes, read.heads
            )
            # progress UCX while serving: spinning for a one-chunk (latency-bound) serve, on
            # ticks for a multi-chunk (bulk) one, so the copies keep the core (``ucx_progress``)
            with self._booster.hold(spin=len(chunks) <= 1):
                await asyncio.wait_for(self._issue_and_wait(good, chunks, pending), self.deadline_s)
            if not self.cancelled and expects_read_done(read):
                await self._send_read_done([sorted(p) for p in self._late])
        except TimeoutError:
            logger.warning("transfer %d passed its deadline; dropping peer", read.transfer_id)
            self.conn.writer.close()  # the control loop ends and drops the connection
            with contextlib.suppress(Exception):
                self.conn.endpoint.abort(period=10**8)  # type: ignore[attr-defined]
        finally:
            self._stopped_issuing.set()
            if pending:  # cancelled or failed: the endpoint abort ends these sends
                sends = [item.send for item in pending]
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(sends, timeout=1.0)
            for item in pending:
                if item.send.done():
                    item.send.cancelled() or item.send.exception()  # retrieved
                if item.buffer is not None:
                    if item.send.done():
                        self._pool.release(item.buffer)
                    else:
                        self._pool.forget(item.buffer)

    async def _issue_and_wait(
        self, good: list[list[int]], chunks: list[Chunk], pending: deque[_InFlight]
    ) -> None:
        read, pool = self.read, self._pool
        for chunk_idx, chunk in enumerate(chunks):
            while len(pending) >= self._window:
                await self._retire(pending)
            if self.cancelled:
                break
            group = read.groups[chunk.entry]
            caches = self._caches[group.group_id]
            layout = self._metadata.groups[group.group_id]
            positions = good[chunk.entry][chunk.start : chunk.stop]
            ids = pick(group.block_ids, good[chunk.entry], chunk.start, chunk.stop)
            row = row_slice(self._metadata, group.group_id, read.heads)  # the heads asked for
            in_place = len(caches) == 1 and row.whole and pool.in_place(caches)
            start = run_start(ids) if in_place else None
            buffer: torch.Tensor | None = None
            recheck: tuple[int, list[int]] | None = None
            if start is not None:  # one layer, a run of ids: send from the KV tensor itself
                source = caches[0][start : start + len(ids)]
                recheck = (chunk.entry, positions)  # once UCX has read the tensor
            else:
                buffer = pool.acquire()
                source = chunk_view(
                    buffer, layout.num_layers, len(ids), layout.block_shape, caches[0].dtype, row
                )
                try:
                    # big gathers off the event loop, so UCX keeps progressing issued chunks
                    await run_copy(
                        copy_out, caches, ids, source, row,
                        nbytes=source.nbytes, device=caches[0].device,
                    )
                    # the bytes are in staging now: a block evicted during the copy shows here
                    self._recheck(chunk.entry, positions)
                except BaseException:
                    pool.release(buffer)
                    raise
                if self.cancelled:  # a Cancel arrived while we gathered
                    pool.release(buffer)
                    break
            send = asyncio.ensure_future(
                self.conn.endpoint.send(  # type: ignore[attr-defined]
                    wire_buffer(source), tag=read.tag_base + chunk_idx, force_tag=True
                )
            )
            self.num_chunks_issued += 1
            pending.append(_InFlight(send, buffer, recheck))
        self._stopped_issuing.set()
        while pending:  # after a Cancel too: the requester drains every issued chunk
            await self._retire(pending)

    def _recheck(self, entry: int, positions: list[int]) -> None:
        """Re-run the validator over one chunk's blocks; failures join ``_late``."""
        group = self.read.groups[entry]
        late = recheck_blocks(group, positions, self.recheck_validator, self.read.lease)
        self._late[entry].extend(late)

    async def _retire(self, pending: deque[_InFlight]) -> None:
        """Wait for the oldest send, release its staging, and re-check a zero-copy chunk."""
        await pending[0].send
        item = pending.popleft()
        if item.buffer is not None:
            self._pool.release(item.buffer)
        if item.recheck is not None and not self.cancelled:
            self._recheck(*item.recheck)


def _settle_filler(
    fillers: set[asyncio.Future[object]],
) -> Callable[[asyncio.Future[object]], None]:
    """A filler's done callback: forget it, retrieving its outcome."""

    def done(future: asyncio.Future[object]) -> None:
        fillers.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: a filler to a dropped peer may fail

    return done
