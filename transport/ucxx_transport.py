"""``Transport`` over UCX (the ``ucxx`` package): TCP control channel, UCX tag messages for
block bytes, and, between processes on one host, a direct copy instead (``cma``: the holder
offers it in ``HelloOk``, the requester copies the blocks out of the holder's KV tensors with
``process_vm_readv`` after ``ReadOk``; one copy, no staging). ``peer_data_path`` says which path
a peer's reads take.

Set-up (DESIGN.md, "Transport", measured table): the handshake carries each side's UCX worker
address; data endpoints are created from worker addresses with ``endpoint_error_handling=False``
so UCX can use shared memory on one host; liveness comes from the TCP control connection and the
deadlines, not from UCX. The progress mode is ``"blocking"`` unless ``progress_mode`` or
``UCXPY_PROGRESS_MODE`` says otherwise (``"thread"`` reached about half the bandwidth here).
UCX state is per process: every ``UcxxTransport`` in a process shares one worker.

Endpoints: one per control connection on each side, created right after the handshake (never
per read); a dropped connection aborts it, which cancels every UCX request still posted on it.

Requester side of a read (holder side: ``ucxx_holder``)::

    send Read ──> ReadOk(mismatched) ──> for chunk k: recv(tag_base + k), ``window`` posted ahead,
                                         into the KV tensor itself (one layer, a run of local
                                         ids) or into reused staging, then copied in off the
                                         event loop thread (``staging.copy_in``)
              ──> ReadDone(mismatched)   only for a read with expected hashes: blocks that failed
                                         the holder's re-check after their bytes left (landed
                                         here, but counted as failed)

A cancelled, timed-out or task-cancelled read never cancels a receive while the holder lives (a
receive cancelled after it matched a rendezvous leaves the holder's send waiting forever): it
sends ``Cancel(num_chunks_posted)``, the holder completes the posted chunks it never sent with
empty messages and answers how many it issued, and the requester receives and drops the issued
chunks it had not posted. Only when the holder is dead or does not answer is the connection torn
down (endpoint aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import torch
import ucxx

from .base import (
    DEFAULT_CHUNK_BYTES,
    GroupRead,
    HolderCallbacks,
    PeerAddress,
    ReadResult,
    Transport,
    check_kv_caches_match,
)
from .cma import CmaHost, CmaPeer, CmaPlan, CmaReadError
from .control import HolderConnection, read_frame, write_message
from .errors import HandshakeError, TransferError, TransportError, WireError
from .metadata import NodeMetadata, check_compatible
from .plan import (
    block_nbytes_by_entry,
    check_read_done,
    expects_read_done,
    good_positions,
    pick,
    plan_chunks,
)
from .staging import StagingPool, chunk_view, copy_in, run_copy, run_start, wire_buffer
from .transfer import (
    ReadState,
    begin_read,
    drive_read,
)
from .ucx_progress import ProgressBooster, booster_for_running_loop
from .ucxx_holder import UcxxHolder
from .wire import (
    Cancel,
    CancelOk,
    ErrorMsg,
    Heartbeat,
    Hello,
    HelloOk,
    Message,
    Read,
    ReadCopied,
    ReadDone,
    ReadOk,
    TransferDoneNotice,
)

logger = logging.getLogger(__name__)

DEFAULT_PROGRESS_MODE = "blocking"
HANDSHAKE_TIMEOUT_S = 10.0
CANCEL_REPLY_TIMEOUT_S = 2.0


UCX_OPTIONS: dict[str, str] = {}
"""UCX context options this package sets (``ucxx.init(options=...)``; a ``UCX_<NAME>`` environment
variable still wins). Deliberately empty, measured on these 2-core hosts (64 MiB, two processes):

- ``TLS``: UCX's default (all transports) picks shared memory (cma) on one host, the network
  across hosts and cuda_copy / cuda_ipc for device memory; restricting it to ``sm,self`` gained
  nothing on one host and would break cross-host and CUDA.
- ``MEMTYPE_CACHE``: ``import ucxx`` sets ``UCX_MEMTYPE_CACHE=n``; UCX 1.21 no longer knows the
  variable (it only prints "unused environment variable"), so there is nothing to set.
- progress mode: ``DEFAULT_PROGRESS_MODE`` below, not a UCX option.
- Intra-host protocol (``UCX_PROTO_INFO=y``): messages of 8 KiB and more go as rendezvous
  zero-copy reads over ``cma`` (``process_vm_readv`` by the receiver, 512 KiB per call); sysv
  carries the small ones; no xpmem or knem here. Raw ucxx (two processes, worker-address
  endpoint, one 64 MiB tag message, quiet host) moved 16-19 GB/s from numpy buffers (huge pages)
  but 6.6-8.8 GB/s from torch tensors (4 KiB pages): page size, not a UCX option, decides, hence
  ``kvbridge.kernels.host_memory`` (KV tensors and staging on huge pages).
  ``RNDV_FRAG_SIZE`` (512K..64M), ``RNDV_SCHEME=put_zcopy`` and ``TLS=sm,self`` /
  ``posix,self`` changed nothing measurable or made it worse.
"""


def init_ucx(progress_mode: str | None = None) -> None:
    """Initialise UCX for this process once (later calls are no-ops): ``UCX_OPTIONS`` and the
    progress mode (``progress_mode``, else ``UCXPY_PROGRESS_MODE``, else ``"blocking"``:
    "blocking" and "polling" moved 64 MiB at about twice the rate of "thread" here, and
    "polling" keeps a core busy even when idle)."""
    mode = progress_mode or os.environ.get("UCXPY_PROGRESS_MODE", DEFAULT_PROGRESS_MODE)
    with contextlib.suppress(RuntimeError):  # already initialised by an earlier transport
        ucxx.init(options=dict(UCX_OPTIONS), progress_mode=mode)


def cma_from_environment() -> bool:
    """Same-host reads unless ``KVBRIDGE_CMA`` says ``0``, ``false``, ``off`` or ``no``."""
    return os.environ.get("KVBRIDGE_CMA", "1").strip().lower() not in {"0", "false", "off", "no"}


def current_progress_mode() -> str:
    """The progress mode ucxx runs in (whoever initialised it first decided)."""
    return str(ucxx.core._get_ctx().progress_mode)


class UcxxTransport(Transport):
    """``Transport`` over ucxx. See ``Transport`` for the contract.

    Args:
        metadata: this node's ``NodeMetadata`` (must describe ``kv_caches_by_group``).
        kv_caches_by_group: ``[group][layer]`` KV tensors, CPU or CUDA.
        host, port: where to listen for control connections (port 0: any free port).
        chunk_bytes: staging chunk size of reads this node makes.
        window: chunks in flight per read on each side (4: receives posted ahead hide the
            event loop's wake-up latency between chunks).
        progress_mode: ucxx progress mode (see module docstring).
        cma: same-host reads by cross-memory attach (``cma``): offered to peers and used with
            peers that offer them. None (default): on unless the environment variable
            ``KVBRIDGE_CMA`` is ``0``. Off, every read goes over UCX.
    """

    def __init__(
        self,
        metadata: NodeMetadata,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = 4,
        progress_mode: str | None = None,
        cma: bool | None = None,
    ):
        check_kv_caches_match(metadata, kv_caches_by_group)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.metadata = metadata
        self.kv_caches_by_group = [list(g) for g in kv_caches_by_group]
        self.callbacks = HolderCallbacks()
        self.chunk_bytes = chunk_bytes
        self.window = window
        self._progress_mode = progress_mode
        self._host, self._port = host, port
        self._server: asyncio.base_events.Server | None = None
        self._address: PeerAddress | None = None
        self._holder = UcxxHolder(metadata, self.kv_caches_by_group, self.callbacks, window)
        self.cma_enabled = cma_from_environment() if cma is None else cma
        if self.cma_enabled:
            self._holder.cma_host = CmaHost.for_caches(self.kv_caches_by_group)
        self._cma_on_batch: Callable[[], None] | None = None  # tests: runs before each copy call
        self._cma_failed: set[str] = set()  # incarnations whose memory a copy could not read
        self._conns: dict[PeerAddress, HolderConnection] = {}
        self._connect_locks: dict[PeerAddress, asyncio.Lock] = {}
        self._reads: dict[int, ReadState] = {}
        self._booster = ProgressBooster(ucxx.progress, enabled=False)  # set by start()
        max_block_bytes = max(g.num_layers * g.block_nbytes for g in metadata.groups)
        self.staging = StagingPool(
            max(chunk_bytes, max_block_bytes), self.kv_caches_by_group[0][0].device
        )

    def set_callbacks(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().set_callbacks(**kwargs)
        self._holder.callbacks = self.callbacks

    @property
    def address(self) -> PeerAddress:
        if self._address is None:
            raise RuntimeError("UcxxTransport.address read before start()")
        return self._address

    @property
    def num_inflight_reads(self) -> int:
        return len(self._reads)

    def peer_data_path(self, peer: PeerAddress | tuple[str, int]) -> str | None:
        """How reads from ``peer`` move bytes: ``"cma"`` (same host, ``cma``), ``"ucx"``, or
        None before the first connection to it."""
        conn = self._conns.get(PeerAddress(*peer))
        if conn is None:
            return None
        return "cma" if conn.cma is not None else "ucx"

    @property
    def num_active_serves(self) -> int:
        """Reads this node is serving right now."""
        return self._holder.num_active_serves

    @property
    def num_holder_staging_outstanding(self) -> int:
        return sum(p.num_outstanding for p in self._holder.pools.values())

    async def start(self) -> None:
        init_ucx(self._progress_mode)
        ucxx.continuous_ucx_progress()
        self._booster = booster_for_running_loop(current_progress_mode())
        self._holder.booster = self._booster
        self._holder.worker_address = ucxx.get_worker_address().tobytes()
        self._server = await asyncio.start_server(
            self._holder.handle_connection, self._host, self._port
        )
        port = self._server.sockets[0].getsockname()[1]
        self._address = PeerAddress(self._host, int(port))

    async def close(self) -> None:
        for state in list(self._reads.values()):
            state.cancel_event.set()
        if self._server is not None:
            self._server.close()
        await self._holder.close()
        for conn in list(self._conns.values()):
            await conn.close()
        self._conns.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    # ------------------------------------------------------------------ control

    async def connect(self, peer: PeerAddress | tuple[str, int]) -> NodeMetadata:
        peer = PeerAddress(*peer)
        lock = self._connect_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            conn = self._conns.get(peer)
            if conn is not None and conn.alive:
                return conn.remote
            conn = await self._open(peer)
            self._conns[peer] = conn
            return conn.remote

    async def _open(self, peer: PeerAddress) -> HolderConnection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(peer.host, peer.port), HANDSHAKE_TIMEOUT_S
            )
        except (TimeoutError, OSError) as exc:
            raise TransportError(f"peer {tuple(peer)} unreachable: {exc}") from None
        try:
            hello = Hello(
                metadata=self.metadata,
                compat_hash=self.metadata.compat_hash,
                worker_address=self._holder.worker_address,
            )
            await write_message(writer, hello)
            try:
                from .wire import decode_message

                reply = decode_message(
                    await asyncio.wait_for(read_frame(reader), HANDSHAKE_TIMEOUT_S)
                )
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                raise HandshakeError(f"no handshake answer from {tuple(peer)}: {exc!r}") from None
            except WireError as exc:
                raise HandshakeError(f"bad handshake answer from {tuple(peer)}: {exc}") from None
            if isinstance(reply, ErrorMsg):
                raise HandshakeError(f"refused by peer {tuple(peer)}: {reply.message}")
            if not isinstance(reply, HelloOk):
                raise HandshakeError(
                    f"expected HelloOk from {tuple(peer)}, got {type(reply).__name__}"
                )
            check_compatible(self.metadata, reply.metadata)
            endpoint = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(reply.worker_address),
                endpoint_error_handling=False,
            )
        except BaseException:
            writer.close()
            raise
        cma_peer = None
        if reply.metadata.incarnation in self._cma_failed:
            logger.info("reads from %s go over UCX: a copy failed", reply.metadata.engine_id)
        elif self.cma_enabled:
            cma_peer, why_not = CmaPeer.accept(reply.cma, reply.metadata, self.kv_caches_by_group)
            if cma_peer is None:
                logger.info("reads from %s go over UCX: %s", reply.metadata.engine_id, why_not)
        return HolderConnection(
            reader, writer, reply.metadata, reply.worker_address, endpoint, cma=cma_peer
        )

    async def send_heartbeat(
        self, peer: PeerAddress | tuple[str, int], request_ids: Sequence[str]
    ) -> None:
        await self.connect(peer)
        await self._conns[PeerAddress(*peer)].send(Heartbeat(request_ids=list(request_ids)))

    async def notify_transfer_done(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        *,
        success: bool,
        reason: str = "",
    ) -> None:
        await self.connect(peer)
        notice = TransferDoneNotice(
            peer_engine_id=self.engine_id, request_id=request_id, success=success, reason=reason
        )
        await self._conns[PeerAddress(*peer)].send(notice)

    async def cancel(self, request_id: str) -> int:
        states = [s for s in self._reads.values() if s.request_id == request_id]
        for state in states:
            state.cancel_event.set()
        await asyncio.sleep(0)
        return len(states)

    # ------------------------------------------------------------------ reads

    async def read_blocks(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        groups: Sequence[GroupRead],
        *,
        deadline_s: float,
    ) -> ReadResult:
        read, state = begin_read(
            self.metadata, request_id, groups, deadline_s=deadline_s, chunk_bytes=self.chunk_bytes
        )
        transfer_id = read.transfer_id
        self._reads[transfer_id] = state
        io = _ReadIO()
        try:
            with self._booster.hold():  # a first connection creates a UCX endpoint
                try:
                    async with asyncio.timeout(deadline_s):
                        await self.connect(peer)
                except HandshakeError:
                    raise
                except (TransportError, TimeoutError) as exc:
                    raise state.error(TransferError, f"cannot reach holder: {exc!r}") from None
            conn = self._conns[PeerAddress(*peer)]
            if conn.cma is not None:
                read = msgspec.structs.replace(read, cma=True)
            # a UCX read progresses UCX on every turn of the loop until it ends
            # (``ucx_progress``); a same-host read moves no UCX message, so the loop may sleep
            with contextlib.nullcontext() if read.cma else self._booster.hold():
                return await drive_read(
                    state,
                    self._run_read(conn, read, state, io),
                    lambda reason: self._abort_read(conn, read, io),
                    deadline_s,
                )
        finally:
            del self._reads[transfer_id]

    async def _run_read(
        self, conn: HolderConnection, read: Read, state: ReadState, io: _ReadIO
    ) -> ReadResult:
        reply_future = conn.expect(read.transfer_id, ReadOk)
        # registered before the Read goes out: ReadDone may arrive before the last chunk lands
        done_future = conn.expect(read.transfer_id, ReadDone) if expects_read_done(read) else None
        # after ReadOk, a holder that fails mid-read says so with an ErrorMsg: to the ReadDone
        # waiter when there is one, else to this one (``HolderConnection`` routes by transfer)
        error_future = conn.expect(read.transfer_id, ErrorMsg) if done_future is None else None
        io.holder_word = done_future or error_future
        try:
            return await self._run_read_replies(conn, read, state, io, reply_future, done_future)
        finally:
            for kind, future in (
                (ReadOk, reply_future),
                (ReadDone, done_future),
                (ErrorMsg, error_future),
            ):
                conn.forget(read.transfer_id, kind)
                if future is not None and future.done() and not future.cancelled():
                    future.exception()  # retrieved: a lost connection fails it unawaited

    async def _run_read_replies(
        self,
        conn: HolderConnection,
        read: Read,
        state: ReadState,
        io: _ReadIO,
        reply_future: asyncio.Future[Message],
        done_future: asyncio.Future[Message] | None,
    ) -> ReadResult:
        try:
            await conn.send(read)
            # a same-host read plans its copy while the holder checks the read
            cma_plan = self._cma_plan(conn, read, state, None) if read.cma else None
            reply = await reply_future
        except TransportError as exc:
            raise state.error(TransferError, str(exc)) from None
        if isinstance(reply, ErrorMsg):
            raise state.error(TransferError, f"holder refused the read: {reply.message}")
        assert isinstance(reply, ReadOk)
        if len(reply.mismatched) != len(read.groups) or any(
            p >= len(g.block_ids)
            for g, ps in zip(read.groups, reply.mismatched, strict=False)
            for p in ps
        ):
            raise state.error(TransferError, "holder sent a ReadOk that does not fit the read")
        state.mismatched = reply.mismatched
        good = [
            good_positions(len(g.block_ids), reply.mismatched[i]) for i, g in enumerate(read.groups)
        ]
        group_ids = [g.group_id for g in read.groups]
        if read.cma:
            if cma_plan is None or any(reply.mismatched):
                cma_plan = self._cma_plan(conn, read, state, good)
            try:
                await self._copy_cma(conn, state, good, cma_plan)
                if done_future is not None:
                    await conn.send(ReadCopied(transfer_id=read.transfer_id))
                    await self._apply_read_done(read, state, done_future)
            except TransportError as exc:
                if not isinstance(exc, TransferError):
                    exc = state.error(TransferError, str(exc))
                await self._drop_connection(conn)
                raise exc from None
            return state.result()
        chunks = plan_chunks(self.metadata, group_ids, [len(p) for p in good], read.chunk_bytes)

        def local_ids(chunk_idx: int) -> list[int]:
            chunk = chunks[chunk_idx]
            local = state.local_block_ids[chunk.entry]
            return pick(local, good[chunk.entry], chunk.start, chunk.stop)

        def post(chunk_idx: int) -> None:
            chunk = chunks[chunk_idx]
            group_id = read.groups[chunk.entry].group_id
            caches = self.kv_caches_by_group[group_id]
            ids = local_ids(chunk_idx)
            start = run_start(ids) if len(caches) == 1 else None
            buffer: torch.Tensor | None = None
            if start is not None:  # one layer, a run of ids: receive into the KV tensor itself
                target = caches[0][start : start + len(ids)]
            else:
                layout = self.metadata.groups[group_id]
                buffer = self.staging.acquire()
                target = chunk_view(
                    buffer, layout.num_layers, len(ids), layout.block_shape, caches[0].dtype
                )
            recv = asyncio.ensure_future(
                conn.endpoint.recv(  # type: ignore[attr-defined]
                    wire_buffer(target), tag=read.tag_base + chunk_idx, force_tag=True
                )
            )
            io.posted[chunk_idx] = _Posted(recv=recv, buffer=buffer, target=target)
            io.num_posted = chunk_idx + 1

        try:
            await self._land_chunks(conn, read, state, io, chunks, good, post, local_ids)
            if done_future is not None:
                await self._apply_read_done(read, state, done_future)
            return state.result()
        except asyncio.CancelledError:
            raise  # drive_read runs _abort_read, which settles the posted receives
        except BaseException:
            await self._drop_connection(conn)  # the holder is gone: cancel what is posted
            await self._settle(io, [], 1.0)
            raise

    async def _land_chunks(  # type: ignore[no-untyped-def]
        self, conn, read, state, io, chunks, good, post, local_ids
    ) -> ReadResult:
        for chunk_idx in range(min(self.window, len(chunks))):
            post(chunk_idx)
        for chunk_idx, chunk in enumerate(chunks):
            posted = io.posted[chunk_idx]
            if not posted.recv.done():
                waits = {posted.recv, conn.lost}
                if io.holder_word is not None and not io.holder_word.done():
                    waits.add(io.holder_word)  # an early ReadDone is fine; an ErrorMsg is not
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            failure = _holder_failure(io.holder_word)
            if failure is not None:
                raise state.error(TransferError, f"holder failed the read: {failure}")
            if not posted.recv.done() or posted.recv.exception() is not None:
                raise state.error(TransferError, f"holder connection lost: {conn.lost.result()}")
            del io.posted[chunk_idx]
            if chunk_idx + self.window < len(chunks):
                post(chunk_idx + self.window)  # keep the window full while this chunk lands
            if posted.buffer is not None:
                group_id = read.groups[chunk.entry].group_id
                try:
                    await run_copy(
                        copy_in,
                        posted.target,
                        self.kv_caches_by_group[group_id],
                        local_ids(chunk_idx),
                        nbytes=posted.target.nbytes,
                    )
                finally:
                    self.staging.release(posted.buffer)
            state.landed[chunk.entry].update(good[chunk.entry][chunk.start : chunk.stop])
            state.num_bytes_landed += posted.target.numel() * posted.target.element_size()

    def _cma_plan(
        self,
        conn: HolderConnection,
        read: Read,
        state: ReadState,
        good: list[list[int]] | None,
    ) -> CmaPlan:
        """The copy plan of a same-host read: the ``good`` positions of each group entry, or
        every position (``None``: planned before ``ReadOk``, used when nothing mismatched)."""
        assert isinstance(conn.cma, CmaPeer)
        entries = []
        for entry, group in enumerate(read.groups):
            positions = range(len(group.block_ids)) if good is None else good[entry]
            remote = pick(group.block_ids, positions, 0, len(positions))
            local = pick(state.local_block_ids[entry], positions, 0, len(positions))
            entries.append((group.group_id, remote, local))
        return conn.cma.plan(self.kv_caches_by_group, entries)

    async def _copy_cma(
        self, conn: HolderConnection, state: ReadState, good: list[list[int]], plan: CmaPlan
    ) -> None:
        """Run a same-host read's copy ``plan`` (``cma``), then re-read the holder's probe (the
        process is still the one checked at handshake). Mutates ``state`` (landed, bytes) only
        once every block of ``good`` is in.

        Raises:
            TransferError: a copy call failed or the probe changed; every block is named.
        """
        peer = conn.cma
        assert isinstance(peer, CmaPeer)
        try:
            await peer.copy(plan, self._cma_on_batch)
            if peer.read_probe() != peer.offer.probe:
                raise CmaReadError("the holder's probe changed: another process has its pid")
        except CmaReadError as exc:
            if exc.errno_name != "ESRCH":  # not "the holder is gone": its memory is unreadable
                logger.warning(
                    "same-host copy from %s failed (%s); its reads go over UCX from now on",
                    conn.remote.engine_id,
                    exc,
                )
                self._cma_failed.add(conn.remote.incarnation)
            raise state.error(
                TransferError, f"same-host copy from {conn.remote.engine_id!r} failed: {exc}"
            ) from None
        for entry, positions in enumerate(good):
            state.landed[entry].update(positions)
        state.num_bytes_landed += plan.nbytes

    async def _apply_read_done(
        self, read: Read, state: ReadState, done_future: asyncio.Future[Message]
    ) -> None:
        """Wait for the holder's ``ReadDone`` and fail the blocks it names. Without it the
        hash-checked blocks are unconfirmed and the read fails naming them."""
        try:
            done = await done_future
            if isinstance(done, ErrorMsg):
                raise TransportError(f"holder failed the read: {done.message}")
            assert isinstance(done, ReadDone)
            check_read_done(read, state.mismatched, done.mismatched)
        except TransportError as exc:  # WireError too: a ReadDone that does not fit the read
            raise state.error(TransferError, f"no valid ReadDone from the holder: {exc}") from None
        state.fail_late(done.mismatched, block_nbytes_by_entry(self.metadata, read))

    async def _abort_read(self, conn: HolderConnection, read: Read, io: _ReadIO) -> None:
        """Stop a read whose core was cancelled, leaving no UCX request posted or issued.

        The holder is told how many receives are posted; it completes the ones it never sent
        with empty messages and answers how many it issued, and the chunks issued beyond the
        posted ones are received into scratch staging. If the holder does not answer or the
        connection is gone, the connection is torn down, which aborts its endpoint and with it
        every receive still posted (staging whose receive does not end is forgotten, not reused).
        """
        drains: list[tuple[asyncio.Future[object], torch.Tensor]] = []
        torn_down = not conn.alive
        if not torn_down:
            reply_future = conn.expect(read.transfer_id, CancelOk)
            try:
                # bounded: a frozen holder that stopped reading leaves a full socket behind,
                # and this path outlasts the caller's cancellations (``transfer.drive_read``)
                async with asyncio.timeout(CANCEL_REPLY_TIMEOUT_S):
                    await conn.send(
                        Cancel(transfer_id=read.transfer_id, num_chunks_posted=io.num_posted)
                    )
                    reply = await reply_future
            except (TransportError, TimeoutError):
                conn.forget(read.transfer_id, CancelOk)
                reply = None
            if isinstance(reply, CancelOk):
                for chunk_idx in range(io.num_posted, reply.num_chunks_issued):
                    buffer = self.staging.acquire()
                    recv = asyncio.ensure_future(
                        conn.endpoint.recv(  # type: ignore[attr-defined]
                            wire_buffer(buffer), tag=read.tag_base + chunk_idx, force_tag=True
                        )
                    )
                    drains.append((recv, buffer))
            else:
                torn_down = True
        pending = [p.recv for p in io.posted.values()] + [recv for recv, _ in drains]
        if pending and not torn_down:
            await asyncio.wait([*pending, conn.lost], timeout=CANCEL_REPLY_TIMEOUT_S)
            torn_down = not all(f.done() for f in pending)
        if torn_down:
            await self._drop_connection(conn)
        await self._settle(io, drains, 1.0)

    async def _settle(
        self,
        io: _ReadIO,
        drains: list[tuple[asyncio.Future[object], torch.Tensor]],
        timeout_s: float,
    ) -> None:
        """Wait up to ``timeout_s`` for the read's receives to end (completed, or cancelled by an
        endpoint abort), then release their staging; a buffer UCX may still write is forgotten."""
        pending = [p.recv for p in io.posted.values()] + [recv for recv, _ in drains]
        if pending and not all(f.done() for f in pending):
            await asyncio.wait(pending, timeout=timeout_s)
        for recv in pending:
            if recv.done() and not recv.cancelled():
                recv.exception()  # retrieved: a cancelled receive is expected here
        owned = [(p.recv, p.buffer) for p in io.posted.values()] + list(drains)
        io.posted.clear()
        for recv, buffer in owned:
            if buffer is None:
                continue
            if recv.done():
                self.staging.release(buffer)
            else:
                self.staging.forget(buffer)

    async def _drop_connection(self, conn: HolderConnection) -> None:
        for peer, known in list(self._conns.items()):
            if known is conn:
                del self._conns[peer]
        await conn.close()


@dataclass(slots=True)
class _Posted:
    """A receive posted for one chunk: into ``buffer`` (staging) or straight into the KV tensor
    (``buffer`` None); ``target`` is the typed view the bytes land in."""

    recv: asyncio.Future[object]
    buffer: torch.Tensor | None
    target: torch.Tensor


@dataclass(slots=True)
class _ReadIO:
    """UCX receives of one read, shared by its core and its abort path; ``holder_word`` is
    the reply future through which the holder's ``ErrorMsg`` about the read arrives."""

    posted: dict[int, _Posted] = field(default_factory=dict)
    num_posted: int = 0
    holder_word: asyncio.Future[Message] | None = None


def _holder_failure(word: asyncio.Future[Message] | None) -> str | None:
    """The holder's error message about a read, once one arrived (None otherwise, also for an
    early ``ReadDone`` or a lost connection, which the caller handles)."""
    if word is None or not word.done() or word.cancelled() or word.exception() is not None:
        return None
    message = word.result()
    return message.message if isinstance(message, ErrorMsg) else None
