"""Holder side of ``UcxxTransport``: accepts control connections, checks every message, and
streams requested blocks to the requester in staging chunks over UCX tag sends.

Per read: check ids (``plan.check_read``), ask the connector's ``block_validator``, answer
``ReadOk``, then for chunk ``k`` of the plan: send from the KV tensor itself (one layer, a run of
ids) or gather into reused staging off the event loop thread (``staging.copy_out``), and send
with tag ``tag_base + k`` on the connection's one endpoint; at most ``window`` chunks in flight.
A read with expected hashes re-checks each chunk's blocks once their bytes were copied out (a
staged chunk right after its gather, a zero-copy chunk once its send completed: UCX has read the
tensor by then) and ends with ``ReadDone`` naming the blocks that failed the re-check
(``plan``, "Hash checks on the holder").
A ``Cancel(num_chunks_posted)`` stops new sends, completes posted chunks never sent with empty
messages and answers how many were issued (the requester drains those), so nothing is left
waiting. A closed control connection (dead requester) aborts the endpoint at once, ending every
send issued to it; a read whose deadline (plus ``DEADLINE_GRACE_S``) passes drops its connection.

A same-host read (``Read.cma``, ``cma``) is checked and answered alike, but nothing is sent:
the requester copies the blocks out of this process itself; with expected hashes the holder then
waits for ``ReadCopied``, re-checks every block it let through and answers ``ReadDone``.

Every malformed message gets an ``ErrorMsg`` to that peer only; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import ucxx

from .base import HolderCallbacks
from .cma import CmaHost
from .control import read_frame, write_message
from .errors import HandshakeError, TransportError, WireError
from .metadata import NodeMetadata, check_compatible
from .plan import (
    Chunk,
    check_read,
    expects_read_done,
    find_mismatched,
    good_positions,
    pick,
    plan_chunks,
    recheck_blocks,
)
from .staging import StagingPool, chunk_view, copy_out, run_copy, run_start, wire_buffer
from .ucx_progress import ProgressBooster
from .wire import (
    Cancel,
    CancelOk,
    ErrorMsg,
    Heartbeat,
    Hello,
    HelloOk,
    Read,
    ReadCopied,
    ReadDone,
    ReadOk,
    TransferDoneNotice,
    decode_message,
)

logger = logging.getLogger(__name__)

_MAX_FINISHED_KEPT = 1024
_EMPTY = np.empty(0, dtype=np.uint8)
DEADLINE_GRACE_S = 2.0
"""A serve outlives its read's deadline by this much, so the requester's own deadline and Cancel
come first; past it the requester is not receiving and its connection is dropped."""


@dataclass(kw_only=True, slots=True)
class _Serve:
    read: Read
    num_chunks_issued: int = 0
    cancelled: bool = False
    stopped_issuing: asyncio.Event = field(default_factory=asyncio.Event)
    copied: asyncio.Event = field(default_factory=asyncio.Event)  # cma: ReadCopied or Cancel
    task: asyncio.Task[None] | None = None
    late: list[list[int]] = field(default_factory=list)  # per group entry: failed the re-check


@dataclass(slots=True)
class _InFlight:
    """One issued chunk send: from staging ``buffer`` (re-checked already) or, ``buffer`` None,
    straight from the KV tensor: then ``recheck`` holds the chunk's (entry, positions) to
    re-check once the send completed."""

    send: asyncio.Future[object]
    buffer: torch.Tensor | None
    recheck: tuple[int, list[int]] | None


@dataclass(kw_only=True, slots=True)
class _Conn:
    peer_engine_id: str
    endpoint: object  # ucxx endpoint to the requester's worker, one per control connection
    writer: asyncio.StreamWriter
    serves: OrderedDict[int, _Serve] = field(default_factory=OrderedDict)
    fillers: set[asyncio.Future[object]] = field(default_factory=set)


class UcxxHolder:
    """Serves reads of ``kv_caches_by_group`` to peers. Owned by ``UcxxTransport``."""

    def __init__(
        self,
        metadata: NodeMetadata,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        callbacks: HolderCallbacks,
        window: int,
    ):
        self.metadata = metadata
        self.kv_caches_by_group = kv_caches_by_group
        self.callbacks = callbacks
        self.window = window
        self.pools: dict[int, StagingPool] = {}
        self.worker_address = b""
        self.booster = ProgressBooster(ucxx.progress, enabled=False)  # the transport's, at start
        self.cma_host: CmaHost | None = None  # set by the transport when it offers same-host reads
        self._conns: set[asyncio.Task[None]] = set()
        self.num_active_serves = 0

    def pool_for(self, chunk_bytes: int, max_block_bytes: int) -> StagingPool:
        capacity = max(chunk_bytes, max_block_bytes)
        if capacity not in self.pools:
            device = self.kv_caches_by_group[0][0].device
            self.pools[capacity] = StagingPool(capacity, device)
        return self.pools[capacity]

    async def handle_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """``asyncio.start_server`` callback: one requester's control connection."""
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        conn: _Conn | None = None
        try:
            conn = await self._handshake(reader, writer)
            if conn is not None:
                await self._serve_connection(conn, reader)
        except (asyncio.IncompleteReadError, ConnectionError, TransportError):
            pass
        except asyncio.CancelledError:
            pass  # close(): end quietly (asyncio's server logs a cancelled handler as an error)
        finally:
            self._conns.discard(task)
            writer.close()
            if conn is not None:
                await self._drop(conn)

    async def _drop(self, conn: _Conn) -> None:
        """The requester is gone (or misbehaved): abort the endpoint, which cancels every send
        still issued to it, and stop its serves; each serve releases its own staging."""
        with contextlib.suppress(Exception):
            conn.endpoint.abort(period=10**8)  # type: ignore[attr-defined]
        tasks = [s.task for s in conn.serves.values() if s.task is not None and not s.task.done()]
        for serve_task in tasks:
            serve_task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for filler in conn.fillers:
            filler.cancel()

    async def close(self) -> None:
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Conn | None:
        try:
            message = decode_message(await read_frame(reader))
            if not isinstance(message, Hello):
                raise WireError(f"expected Hello first, got {type(message).__name__}")
            check_compatible(self.metadata, message.metadata)
            address = ucxx.get_ucx_address_from_buffer(message.worker_address)
            endpoint = await ucxx.create_endpoint_from_worker_address(
                address, endpoint_error_handling=False
            )
        except (WireError, HandshakeError) as exc:
            code = "incompatible" if isinstance(exc, HandshakeError) else "bad_message"
            await write_message(writer, ErrorMsg(transfer_id=0, code=code, message=str(exc)))
            return None
        offer = self.cma_host.offer if self.cma_host is not None else None
        hello_ok = HelloOk(
            metadata=self.metadata,
            compat_hash=self.metadata.compat_hash,
            worker_address=self.worker_address,
            cma=offer,
        )
        await write_message(writer, hello_ok)
        return _Conn(peer_engine_id=message.metadata.engine_id, endpoint=endpoint, writer=writer)

    async def _serve_connection(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                payload = await read_frame(reader)
            except WireError as exc:  # bad length prefix: the stream cannot be trusted further
                await _send_error(conn.writer, 0, "bad_frame", str(exc))
                return
            try:
                message = decode_message(payload)
            except WireError as exc:
                await _send_error(conn.writer, 0, "bad_message", str(exc))
                continue
            await self._dispatch(conn, message)

    async def _dispatch(self, conn: _Conn, message: object) -> None:
        if isinstance(message, Read):
            await self._start_read(conn, message)
        elif isinstance(message, Cancel):
            serve = conn.serves.get(message.transfer_id)
            issued = 0
            if serve is not None:
                serve.cancelled = True
                serve.copied.set()  # a cma read waiting for ReadCopied ends
                await serve.stopped_issuing.wait()  # at most one gather away
                issued = serve.num_chunks_issued
                for chunk_idx in range(issued, message.num_chunks_posted):
                    # an empty message completes the requester's receive for a chunk never sent
                    filler = asyncio.ensure_future(
                        conn.endpoint.send(  # type: ignore[attr-defined]
                            _EMPTY, tag=serve.read.tag_base + chunk_idx, force_tag=True
                        )
                    )
                    conn.fillers.add(filler)
                    filler.add_done_callback(_settle_filler(conn.fillers))
            await write_message(
                conn.writer, CancelOk(transfer_id=message.transfer_id, num_chunks_issued=issued)
            )
        elif isinstance(message, ReadCopied):
            serve = conn.serves.get(message.transfer_id)
            waiting = serve is not None and serve.task is not None and not serve.task.done()
            if not (waiting and serve.read.cma and not serve.copied.is_set()):
                await _send_error(
                    conn.writer,
                    message.transfer_id,
                    "bad_request",
                    f"ReadCopied for transfer {message.transfer_id}, which is not a "
                    "same-host read with expected hashes waiting for it",
                )
            else:
                serve.copied.set()
        elif isinstance(message, Heartbeat):
            if self.callbacks.on_heartbeat is not None:
                self.callbacks.on_heartbeat(conn.peer_engine_id, message.request_ids)
        elif isinstance(message, TransferDoneNotice):
            if message.peer_engine_id != conn.peer_engine_id:
                await _send_error(
                    conn.writer,
                    0,
                    "bad_message",
                    f"TransferDone.peer_engine_id {message.peer_engine_id!r} is not this "
                    f"connection's peer {conn.peer_engine_id!r}",
                )
            elif self.callbacks.on_transfer_done is not None:
                self.callbacks.on_transfer_done(message)
        else:
            await _send_error(
                conn.writer,
                0,
                "bad_message",
                f"{type(message).__name__} is not a requester message",
            )

    async def _start_read(self, conn: _Conn, read: Read) -> None:
        if read.transfer_id in conn.serves:
            await _send_error(
                conn.writer,
                read.transfer_id,
                "bad_request",
                f"transfer_id {read.transfer_id} already used",
            )
            return
        try:
            if read.cma and self.cma_host is None:
                raise WireError("a same-host (cma) read, but this node offered none")
            check_read(self.metadata, read)
            mismatched = find_mismatched(read, self.callbacks.block_validator)
        except WireError as exc:
            await _send_error(
                conn.writer,
                read.transfer_id,
                "bad_request",
                str(exc),
            )
            return
        await write_message(
            conn.writer, ReadOk(transfer_id=read.transfer_id, mismatched=mismatched)
        )
        serve = _Serve(read=read)
        conn.serves[read.transfer_id] = serve
        while len(conn.serves) > _MAX_FINISHED_KEPT:
            oldest_id, oldest = next(iter(conn.serves.items()))
            if oldest.task is not None and not oldest.task.done():
                break
            del conn.serves[oldest_id]
        if read.cma:  # the requester copies; the holder only re-checks once it has
            serve.stopped_issuing.set()
            if expects_read_done(read):
                serve.task = asyncio.ensure_future(self._await_copied(conn, serve, mismatched))
            return
        serve.task = asyncio.ensure_future(self._send_blocks(conn, serve, mismatched))

    async def _await_copied(self, conn: _Conn, serve: _Serve, mismatched: list[list[int]]) -> None:
        """A same-host read with expected hashes: wait for the requester's ``ReadCopied``, then
        re-check every block let through at ``ReadOk`` and answer ``ReadDone``. A Cancel, or no
        word within the deadline plus ``DEADLINE_GRACE_S``, ends it silently: the holder lent
        nothing (no staging, no send)."""
        read = serve.read
        self.num_active_serves += 1
        try:
            await asyncio.wait_for(serve.copied.wait(), read.deadline_ms / 1000 + DEADLINE_GRACE_S)
            if serve.cancelled:
                return
            validator = self.callbacks.recheck_validator
            late = [
                recheck_blocks(group, good_positions(len(group.block_ids), bad), validator)
                for group, bad in zip(read.groups, mismatched, strict=True)
            ]
            await write_message(
                conn.writer, ReadDone(transfer_id=read.transfer_id, mismatched=late)
            )
        except TimeoutError:
            logger.info(
                "same-host transfer %d: no ReadCopied before its deadline", read.transfer_id
            )
        except (asyncio.CancelledError, TransportError):
            pass  # dropped: the requester is gone
        except Exception as exc:  # a validator bug: fail this read, keep serving
            logger.warning("re-checking transfer %d failed: %r", read.transfer_id, exc)
            with contextlib.suppress(TransportError):
                await _send_error(
                    conn.writer,
                    read.transfer_id,
                    "holder_error",
                    f"the holder could not re-check the blocks: {exc!r}",
                )
        finally:
            self.num_active_serves -= 1

    async def _send_blocks(self, conn: _Conn, serve: _Serve, mismatched: list[list[int]]) -> None:
        """Serve one read; ends when every issued send completed (then, for a read with expected
        hashes, ``ReadDone`` goes out), the requester cancelled (and drains what was issued),
        the connection dropped, or the read's deadline plus a grace period passed (then the
        requester is not receiving: the connection is dropped)."""
        read = serve.read
        self.num_active_serves += 1
        pending: deque[_InFlight] = deque()
        max_block_bytes = max(
            layout.num_layers * layout.block_nbytes for layout in self.metadata.groups
        )
        pool = self.pool_for(read.chunk_bytes, max_block_bytes)
        serve.late = [[] for _ in read.groups]
        try:
            good = [
                good_positions(len(g.block_ids), mismatched[i]) for i, g in enumerate(read.groups)
            ]
            group_ids = [g.group_id for g in read.groups]
            chunks = plan_chunks(self.metadata, group_ids, [len(p) for p in good], read.chunk_bytes)
            # progress UCX while serving: spinning for a one-chunk (latency-bound) serve, on
            # ticks for a multi-chunk (bulk) one, so the copies keep the core (``ucx_progress``)
            with self.booster.hold(spin=len(chunks) <= 1):
                await asyncio.wait_for(
                    self._issue_and_wait(conn, serve, good, chunks, pool, pending),
                    read.deadline_ms / 1000 + DEADLINE_GRACE_S,
                )
            if not serve.cancelled and expects_read_done(read):
                await write_message(
                    conn.writer,
                    ReadDone(
                        transfer_id=read.transfer_id, mismatched=[sorted(p) for p in serve.late]
                    ),
                )
        except TimeoutError:
            logger.warning("transfer %d passed its deadline; dropping peer", read.transfer_id)
            conn.writer.close()  # the control loop ends and drops the connection
            with contextlib.suppress(Exception):
                conn.endpoint.abort(period=10**8)  # type: ignore[attr-defined]
        except (asyncio.CancelledError, TransportError):
            pass  # dropped: the requester is gone
        except Exception as exc:  # a validator or copy bug: fail this read, keep serving
            logger.warning("serving transfer %d failed: %r", read.transfer_id, exc)
            with contextlib.suppress(TransportError):
                message = f"serving the read failed: {exc!r}"
                await _send_error(conn.writer, read.transfer_id, "holder_error", message)
        finally:
            serve.stopped_issuing.set()
            if pending:  # cancelled or failed: the endpoint abort ends these sends
                sends = [item.send for item in pending]
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(sends, timeout=1.0)
            for item in pending:
                if item.send.done():
                    item.send.cancelled() or item.send.exception()  # retrieved
                if item.buffer is not None:
                    if item.send.done():
                        pool.release(item.buffer)
                    else:
                        pool.forget(item.buffer)
            self.num_active_serves -= 1

    async def _issue_and_wait(
        self,
        conn: _Conn,
        serve: _Serve,
        good: list[list[int]],
        chunks: list[Chunk],
        pool: StagingPool,
        pending: deque[_InFlight],
    ) -> None:
        read = serve.read
        for chunk_idx, chunk in enumerate(chunks):
            while len(pending) >= self.window:
                await self._retire(serve, pool, pending)
            if serve.cancelled:
                break
            group = read.groups[chunk.entry]
            caches = self.kv_caches_by_group[group.group_id]
            layout = self.metadata.groups[group.group_id]
            positions = good[chunk.entry][chunk.start : chunk.stop]
            ids = pick(group.block_ids, good[chunk.entry], chunk.start, chunk.stop)
            start = run_start(ids) if len(caches) == 1 else None
            buffer: torch.Tensor | None = None
            recheck: tuple[int, list[int]] | None = None
            if start is not None:  # one layer, a run of ids: send from the KV tensor itself
                source = caches[0][start : start + len(ids)]
                recheck = (chunk.entry, positions)  # once UCX has read the tensor
            else:
                buffer = pool.acquire()
                source = chunk_view(
                    buffer, layout.num_layers, len(ids), layout.block_shape, caches[0].dtype
                )
                try:
                    # big gathers off the event loop, so UCX keeps progressing issued chunks
                    await run_copy(copy_out, caches, ids, source, nbytes=source.nbytes)
                    # the bytes are in staging now: a block evicted during the copy shows here
                    self._recheck(serve, chunk.entry, positions)
                except BaseException:
                    pool.release(buffer)
                    raise
                if serve.cancelled:  # a Cancel arrived while we gathered
                    pool.release(buffer)
                    break
            send = asyncio.ensure_future(
                conn.endpoint.send(  # type: ignore[attr-defined]
                    wire_buffer(source), tag=read.tag_base + chunk_idx, force_tag=True
                )
            )
            serve.num_chunks_issued += 1
            pending.append(_InFlight(send, buffer, recheck))
        serve.stopped_issuing.set()
        while pending:  # after a Cancel too: the requester drains every issued chunk
            await self._retire(serve, pool, pending)

    def _recheck(self, serve: _Serve, entry: int, positions: list[int]) -> None:
        """Re-run the validator over one chunk's blocks; failures join ``serve.late``."""
        group = serve.read.groups[entry]
        serve.late[entry].extend(recheck_blocks(group, positions, self.callbacks.recheck_validator))

    async def _retire(self, serve: _Serve, pool: StagingPool, pending: deque[_InFlight]) -> None:
        """Wait for the oldest send, release its staging, and re-check a zero-copy chunk."""
        await pending[0].send
        item = pending.popleft()
        if item.buffer is not None:
            pool.release(item.buffer)
        if item.recheck is not None and not serve.cancelled:
            self._recheck(serve, *item.recheck)


async def _send_error(
    writer: asyncio.StreamWriter, transfer_id: int, code: str, message: str
) -> None:
    """An ``ErrorMsg`` to one peer (``transfer_id`` 0: about the connection)."""
    await write_message(writer, ErrorMsg(transfer_id=transfer_id, code=code, message=message))


def _settle_filler(fillers: set[asyncio.Future[object]]):  # type: ignore[no-untyped-def]
    def done(future: asyncio.Future[object]) -> None:
        fillers.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: a filler to a dropped peer may fail

    return done
