"""``Transport`` over UCX (the ``ucxx`` package): TCP control channel, UCX tag messages for
block bytes, and, between processes on one host, a direct copy instead (``cma``: the holder
offers it in ``HelloOk``, the requester copies the blocks out of the holder's KV tensors with
``process_vm_readv`` after ``ReadOk``; one copy, no staging). ``peer_data_path`` says which path
a peer's reads take.

Set-up (docs/architecture.md, "The transport"; why: docs/architecture.md, "Design measurements"):
the handshake carries each side's UCX worker address; data endpoints are created from worker
addresses with ``endpoint_error_handling=False`` so UCX can use shared memory on one host;
liveness comes from the TCP control connection and the deadlines, not from UCX. The progress
mode is ``"blocking"`` unless ``progress_mode`` or ``UCXPY_PROGRESS_MODE`` says otherwise.
UCX state is per process: every ``UcxxTransport`` in a process shares one worker.

Endpoints: one per control connection on each side, created right after the handshake (never
per read); a dropped connection aborts it, which cancels every UCX request still posted on it.

Release notices (``notify_transfer_done``) go over the peer's read connection; when the peer
refuses that handshake (incompatible layout, a UCX endpoint that cannot be made), over a
notices-only connection (``wire.Hello.notices_only``: cluster key checked, no compatibility
check, no endpoint), so a holder whose handoff this node refused frees its blocks at once rather
than at the lease's expiry.

Roles of the modules behind this class: the holder side is ``ucxx_holder`` (connections,
checks, ``ReadOk``) with one serve class per data path (``ucx_serve``, ``cma_serve``); the
requester's half of the handshake is ``ucx_hello``; a read
here is one ``read_path.ReadPath`` (the control exchange), chosen once per read from its
connection: ``ucx_read.UcxReadPath`` or ``cma_read.CmaReadPath``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import torch
import ucxx

from .address import format_host_port
from .auth import check_auth_key, new_nonce
from .base import (
    DEFAULT_CHUNK_BYTES,
    GroupRead,
    HolderCallbacks,
    PeerAddress,
    ReadResult,
    Transport,
    check_kv_caches_match,
)
from .board_look import BoardRef
from .cma import INLINE_COPY_MAX_BYTES, CmaPeer, CmaReadError, cma_from_environment
from .cma_board import BoardCounts, offer_same_host_reads
from .cma_one_sided import OneSidedRead
from .cma_read import CmaReadPath
from .control import HolderConnection
from .errors import HandshakeError, PeerUnreachableError, TransferError, TransportError, WireError
from .metadata import NodeMetadata, check_compatible
from .plan import build_group_msgs
from .read_path import ReadPath
from .staging import StagingPool
from .transfer import ReadState, begin_read, drive_read
from .ucx_hello import HANDSHAKE_TIMEOUT_S, HandshakeClock, exchange_hello
from .ucx_init import current_progress_mode, init_ucx
from .ucx_memory import WireMemory, check_device_memory, choose_wire_memory, wire_device
from .ucx_progress import ProgressBooster, booster_for_running_loop
from .ucx_read import UcxReadPath
from .ucxx_holder import UcxxHolder, check_worker_address, endpoint_from_worker_address
from .wire import Heartbeat, Hello, LeaseRef, Read, transfer_done_notice

logger = logging.getLogger(__name__)


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
        cma_board: with ``cma``, offer a block board (``cma_board``; ``block_board``, written
            by the caller's lease table) for one-sided handoff reads.
        auth_key: the cluster key (``auth``; at least ``MIN_KEY_BYTES``): peers must prove it
            at handshake and this node proves it to the holders it reads from. None: no
            authentication (anyone who reaches the port is served).
        device_memory: GPU KV sent by UCX from ``"device"`` memory or ``"staged"`` through
            pinned host buffers; None: decided at ``start`` (``ucx_memory.choose_wire_memory``),
            kept in ``wire_memory``. ValueError for any other value.
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
        cma_board: bool = True,
        auth_key: bytes | None = None,
        device_memory: WireMemory | None = None,
    ):
        check_kv_caches_match(metadata, kv_caches_by_group)
        self._device_memory = check_device_memory(device_memory)
        self.wire_memory: WireMemory | None = None
        check_auth_key(auth_key)
        self.auth_key = auth_key
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
        self._holder = UcxxHolder(
            metadata, self.kv_caches_by_group, self.callbacks, window, auth_key=auth_key
        )
        self.cma_enabled = cma_from_environment() if cma is None else cma
        if self.cma_enabled:
            self._holder.cma_host, self.block_board = offer_same_host_reads(
                self.kv_caches_by_group, board=cma_board
            )
        self._cma_on_batch: Callable[[], None] | None = None  # tests: runs before each copy call
        self._cma_failed: set[str] = set()  # incarnations whose memory a copy could not read
        self.board_counts = BoardCounts()  # this node's one-sided handoff reads (cma_board)
        self._conns: dict[PeerAddress, HolderConnection] = {}
        self._notice_conns: dict[PeerAddress, HolderConnection] = {}  # peers that refused _conns
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
        return (CmaReadPath if conn.cma is not None else UcxReadPath).name

    @property
    def num_refused_peers(self) -> int:
        """Handshakes this holder refused because the peer did not prove the cluster key."""
        return self._holder.num_refused_peers

    @property
    def num_active_serves(self) -> int:
        """Reads this node is serving right now."""
        return self._holder.num_active_serves

    @property
    def num_holder_staging_outstanding(self) -> int:
        return sum(p.num_outstanding for p in self._holder.pools.values())

    async def start(self) -> None:
        init_ucx(self._progress_mode)
        self._place_staging()
        ucxx.continuous_ucx_progress()
        self._booster = booster_for_running_loop(current_progress_mode())
        self._holder.booster = self._booster
        self._holder.worker_address = ucxx.get_worker_address().tobytes()
        self._server = await asyncio.start_server(
            self._holder.handle_connection, self._host, self._port
        )
        port = self._server.sockets[0].getsockname()[1]
        self._address = PeerAddress(self._host, int(port))

    def _place_staging(self) -> None:
        """Decide ``wire_memory`` (``ucx_memory``) and put both sides' staging where UCX's
        bytes live: the KV device, or pinned host memory for staged GPU KV."""
        kv_device = self.kv_caches_by_group[0][0].device
        memory = self.wire_memory = choose_wire_memory(kv_device, self._device_memory)
        staging_device, pinned = wire_device(memory, kv_device), memory == "staged"
        self.staging = StagingPool(self.staging.capacity_bytes, staging_device, pinned=pinned)
        self._holder.place_staging(staging_device, pinned=pinned)

    async def close(self) -> None:
        for state in list(self._reads.values()):
            state.cancel_event.set()
        if self._server is not None:
            self._server.close()
        await self._holder.close()
        for conn in [*self._conns.values(), *self._notice_conns.values()]:
            await conn.close()
        self._conns.clear()
        self._notice_conns.clear()
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

    async def _open(self, peer: PeerAddress, *, notices_only: bool = False) -> HolderConnection:
        """A handshaken control connection to ``peer``: for reads (both sides check the other
        is compatible; a UCX endpoint, and a same-host offer where accepted) or, with
        ``notices_only``, for release notices alone (neither check, no endpoint).

        Raises:
            TransportError: unreachable. HandshakeError: refused, or no valid answer.
        """
        clock = HandshakeClock("requester", format_host_port(*peer))
        try:
            return await self._open_timed(peer, clock, notices_only)
        finally:
            clock.report()

    async def _open_timed(
        self, peer: PeerAddress, clock: HandshakeClock, notices_only: bool
    ) -> HolderConnection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(peer.host, peer.port), HANDSHAKE_TIMEOUT_S
            )
        except (TimeoutError, OSError) as exc:
            raise PeerUnreachableError(
                f"peer {format_host_port(*peer)} unreachable: {exc}") from None
        clock.mark("TCP connect")
        try:
            nonce = new_nonce() if self.auth_key is not None else b""
            hello = Hello(
                metadata=self.metadata,
                compat_hash=self.metadata.compat_hash,
                worker_address=self._holder.worker_address,
                auth_nonce=nonce,
                notices_only=notices_only,
            )
            reply = await exchange_hello(reader, writer, peer, hello, self.auth_key)
            clock.mark("Hello to HelloOk")
            if notices_only:
                return HolderConnection(reader, writer, reply.metadata, reply.worker_address)
            check_compatible(self.metadata, reply.metadata)
            try:
                check_worker_address(reply.worker_address, self._holder.worker_address)
                endpoint = await endpoint_from_worker_address(reply.worker_address)
            except WireError as exc:
                raise HandshakeError(f"bad handshake answer from {tuple(peer)}: {exc}") from None
            clock.mark("UCX endpoint")
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
        self,
        peer: PeerAddress | tuple[str, int],
        request_ids: Sequence[str],
        tokens: Sequence[str] = (),
    ) -> None:
        await self.connect(peer)
        heartbeat = Heartbeat(request_ids=list(request_ids), tokens=list(tokens))
        await self._conns[PeerAddress(*peer)].send(heartbeat)

    async def notify_transfer_done(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        *,
        success: bool,
        reason: str = "",
        token: str = "",
        puller_rank: int = 0,
        num_pullers: int = 1,
    ) -> None:
        notice = transfer_done_notice(
            peer_engine_id=self.engine_id, request_id=request_id, success=success, reason=reason,
            token=token, puller_rank=puller_rank, num_pullers=num_pullers,
        )
        conn = await self._notice_connection(PeerAddress(*peer))
        await conn.send(notice)

    async def _notice_connection(self, peer: PeerAddress) -> HolderConnection:
        """Where a release notice to ``peer`` goes: its read connection (made now if needed:
        the reads that follow a notice then find it open), or, when ``peer`` refused that
        handshake, a notices-only connection (module docstring), kept for the next notice.

        Raises:
            TransportError: unreachable. HandshakeError: the notices-only handshake was refused
                too (the cluster key).
        """
        conn = self._conns.get(peer)
        if conn is not None and conn.alive:
            return conn
        conn = self._notice_conns.get(peer)
        if conn is not None and conn.alive:  # this peer refused a read connection before
            return conn
        try:
            await self.connect(peer)
            return self._conns[peer]
        except HandshakeError as exc:
            logger.info("notices to %s go over a notices-only connection: %s", tuple(peer), exc)
        async with self._connect_locks.setdefault(peer, asyncio.Lock()):
            conn = self._notice_conns.get(peer)
            if conn is None or not conn.alive:
                conn = await self._open(peer, notices_only=True)
                self._notice_conns[peer] = conn
            return conn

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
        lease: LeaseRef | None = None,
        heads: tuple[int, int] | None = None,
    ) -> ReadResult:
        read, state = begin_read(
            self.metadata, request_id, groups, deadline_s=deadline_s,
            chunk_bytes=self.chunk_bytes, lease=lease, heads=heads,
        )
        transfer_id = read.transfer_id
        self._reads[transfer_id] = state
        try:
            with self._booster.hold():  # a first connection creates a UCX endpoint
                try:
                    async with asyncio.timeout(deadline_s):
                        await self.connect(peer)
                except HandshakeError:
                    raise
                except (TransportError, TimeoutError) as exc:
                    raise state.error(TransferError, f"cannot reach holder: {exc!r}") from None
            path = self._read_path(self._conns[PeerAddress(*peer)], read, state)
            # a UCX read progresses UCX on every turn of the loop until it ends
            # (``ucx_progress``); a same-host read moves no UCX message, so the loop may sleep
            with self._booster.hold() if path.progresses_ucx else contextlib.nullcontext():
                return await drive_read(state, path.run(), lambda _: path.abort(), deadline_s)
        finally:
            del self._reads[transfer_id]

    def one_sided_holders(self) -> list[BoardRef]:
        return sorted(
            BoardRef.of(conn.remote, conn.cma.offer)
            for conn in list(self._conns.values())  # a copy: safe from any thread
            if conn.cma is not None and conn.cma.offer.board_address is not None
        )

    def read_one_sided(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        groups: Sequence[GroupRead],
        *,
        lease: LeaseRef,
        incarnation: str,
        heads: tuple[int, int] | None = None,
    ) -> ReadResult | None:
        """See ``Transport.read_one_sided``: for a connected same-host holder with a board, a
        read of at most ``cma.INLINE_COPY_MAX_BYTES`` (``cma_one_sided``)."""
        conn = self._conns.get(PeerAddress(*peer))  # one dict read: safe from any thread
        if conn is None or conn.cma is None or conn.remote.incarnation != incarnation:
            return None
        try:
            msgs, local_block_ids = build_group_msgs(self.metadata, groups)
            one = OneSidedRead(
                conn.cma, conn.remote, self.kv_caches_by_group, msgs, local_block_ids, lease,
                heads=heads, local=self.metadata,
            )
            if not one.before_copy() or one.plan.nbytes > INLINE_COPY_MAX_BYTES:
                return None
            conn.cma.copy_here(one.plan)
            if not one.after_copy():
                return None
        except (ValueError, CmaReadError):  # read_blocks reports what is wrong
            return None
        self.board_counts.add(one_sided=1)
        return ReadResult(request_id, one.num_blocks, one.plan.nbytes, ())

    def _read_path(self, conn: HolderConnection, read: Read, state: ReadState) -> ReadPath:
        """The data path of one read from ``conn``: a same-host copy when the holder's offer
        was accepted at handshake, else UCX tag messages."""
        common = {"metadata": self.metadata, "drop_connection": self._drop_connection,
                  "kv_caches_by_group": self.kv_caches_by_group}
        if conn.cma is not None:
            return CmaReadPath(conn, read, state, **common,
                               unreadable_incarnations=self._cma_failed,
                               on_batch=self._cma_on_batch, board_counts=self.board_counts)
        return UcxReadPath(conn, read, state, **common, staging=self.staging, window=self.window)

    async def _drop_connection(self, conn: HolderConnection) -> None:
        """Forget ``conn`` (the next read from its peer reconnects) and close it, which aborts
        its endpoint: every receive still posted on it ends."""
        for peer, known in list(self._conns.items()):
            if known is conn:
                del self._conns[peer]
        await conn.close()
