"""Holder side of ``UcxxTransport``: accepts control connections, checks every message, answers
each ``Read`` with ``ReadOk``, and hands the rest of the read to a serve of its data path.
With a cluster key the handshake first runs ``auth``'s challenge-response: a peer that fails it
gets one ``ErrorMsg`` (code ``"unauthenticated"``) and nothing else.

Per read: check ids (``plan.check_read``), ask the connector's ``block_validator`` (under the
read's ``lease``), answer ``ReadOk`` (positions whose block failed the check are never served;
``lease_pending`` when the read's lease may yet be granted, ``HolderCallbacks.refusal_pending``),
then start one
``serve.Serve`` chosen from ``Read.cma``: ``ucx_serve.UcxServe`` sends the blocks as UCX tag
messages, ``cma_serve.CmaServe`` lets the requester copy them (same host) and re-checks them on
its ``ReadCopied``. ``Cancel`` and ``ReadCopied`` go to the read's serve; ``Heartbeat`` and
``TransferDone`` to the connector's callbacks. A closed control connection (dead requester)
aborts its endpoint at once, ending every send issued to it, and stops its serves.

A ``Hello`` with ``notices_only`` opens a connection for release notices alone: after the
cluster key check (when set) it is answered ``HelloOk`` whatever the peer's layout, no UCX
endpoint is made, and every message on it but ``TransferDone`` is refused. A requester whose
node is incompatible with this one (it refused the handoff for that) frees this node's blocks
through it at once instead of at the lease's expiry.

Every malformed message gets an ``ErrorMsg`` to that peer only; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence

import torch
import ucxx
from ucxx.exceptions import UCXError

from .auth import NONCE_BYTES, holder_proof, new_nonce, proof_matches, requester_proof
from .base import HolderCallbacks
from .cma import CmaHost
from .cma_serve import CmaServe
from .control import read_frame, write_message
from .errors import HandshakeError, TransportError, WireError
from .limits import clip_text
from .metadata import NodeMetadata, check_compatible
from .plan import check_read, find_mismatched
from .serve import (
    DEADLINE_GRACE_S,
    RequesterConnection,
    Serve,
    ServeCount,
    copy_first_window_s,
    send_error,
)
from .staging import StagingPool
from .ucx_hello import HandshakeClock
from .ucx_progress import ProgressBooster
from .ucx_serve import UcxServe
from .wire import (
    AuthChallenge,
    AuthProof,
    Cancel,
    CancelOk,
    ErrorMsg,
    Heartbeat,
    Hello,
    HelloOk,
    Read,
    ReadCopied,
    ReadOk,
    TransferDoneNotice,
    decode_message,
)

_MAX_FINISHED_KEPT = 1024
HANDSHAKE_TIMEOUT_S = 10.0
"""A peer that has not finished its handshake this long after connecting is dropped."""


def check_worker_address(address: bytes, own_address: bytes) -> None:
    """Refuse a peer's UCX worker address that this UCX build would not parse.

    UCX does not validate a packed worker address: a malformed one stops the whole process on
    an assertion (``address.c``: "addr version 14", found by ``tests/test_fuzz_wire.py``). Every
    node of a cluster runs the same UCX, so a peer's address starts with the header byte ours
    starts with (version and flags). This stops random bytes, not a crafted address: only a
    cluster key (``auth``, checked before any address is parsed) keeps strangers out of UCX.

    Raises:
        WireError: naming the field.
    """
    if len(address) < 16 or address[:1] != own_address[:1]:
        raise WireError(
            "field 'worker_address' is not a UCX worker address of this UCX version "
            f"({len(address)} bytes, header {address[:1].hex() or 'none'})"
        )


async def endpoint_from_worker_address(address: bytes) -> object:
    """A UCX endpoint to a peer's worker (no peer-failure handling, ``ucxx_transport``).

    Raises:
        WireError: UCX refused the address (invalid, unreachable), naming the field.
    """
    try:
        return await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False
        )
    except UCXError as exc:
        raise WireError(f"field 'worker_address': UCX cannot use it: {exc!r}") from None


class _Unauthenticated(HandshakeError):
    """A peer that did not prove the cluster key."""


class UcxxHolder:
    """Serves reads of ``kv_caches_by_group`` to peers. Owned by ``UcxxTransport``."""

    def __init__(
        self,
        metadata: NodeMetadata,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        callbacks: HolderCallbacks,
        window: int,
        auth_key: bytes | None = None,
    ):
        self.metadata = metadata
        self.auth_key = auth_key
        self.num_refused_peers = 0  # handshakes refused for want of the cluster key
        self.kv_caches_by_group = kv_caches_by_group
        self.callbacks = callbacks
        self.window = window
        self.pools: dict[int, StagingPool] = {}
        self._staging_device = kv_caches_by_group[0][0].device
        self._staging_pinned = False
        self.worker_address = b""
        self.booster = ProgressBooster(ucxx.progress, enabled=False)  # the transport's, at start
        self.cma_host: CmaHost | None = None  # set by the transport when it offers same-host reads
        self._conns: set[asyncio.Task[None]] = set()
        self._count = ServeCount()

    @property
    def num_active_serves(self) -> int:
        """Serves running right now, over all connections."""
        return self._count.num_active

    def place_staging(self, device: torch.device, *, pinned: bool) -> None:
        """Where serves' staging lives (``UcxxTransport.start``, ``ucx_memory``): pools made
        from now on."""
        self._staging_device, self._staging_pinned = device, pinned
        self.pools.clear()

    def pool_for(self, chunk_bytes: int, max_block_bytes: int) -> StagingPool:
        """The staging pool of UCX serves of ``chunk_bytes`` chunks (created on first use)."""
        capacity = max(chunk_bytes, max_block_bytes)
        if capacity not in self.pools:
            self.pools[capacity] = StagingPool(
                capacity, self._staging_device, pinned=self._staging_pinned
            )
        return self.pools[capacity]

    async def handle_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """``asyncio.start_server`` callback: one requester's control connection."""
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        conn: RequesterConnection | None = None
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

    async def _drop(self, conn: RequesterConnection) -> None:
        """The requester is gone (or misbehaved): abort the endpoint, which cancels every send
        still issued to it, and stop its serves; each serve releases its own staging."""
        if conn.endpoint is not None:
            with contextlib.suppress(Exception):
                conn.endpoint.abort(period=10**8)  # type: ignore[attr-defined]
        tasks = [s.task for s in conn.serves.values() if s.task is not None and s.running]
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
    ) -> RequesterConnection | None:
        clock = HandshakeClock("holder", writer.get_extra_info("peername"))
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):  # a silent stranger holds nothing
                payload = await read_frame(reader)
                clock.mark("Hello")
                message = decode_message(payload)
                if not isinstance(message, Hello):
                    raise WireError(f"expected Hello first, got {type(message).__name__}")
                if self.auth_key is not None:  # before anything about this node is told
                    await self._authenticate(reader, writer, message, payload)
            endpoint = None
            if not message.notices_only:  # a notice needs neither (module docstring)
                check_compatible(self.metadata, message.metadata)
                check_worker_address(message.worker_address, self.worker_address)
                endpoint = await endpoint_from_worker_address(message.worker_address)
                clock.mark("UCX endpoint")
        except (WireError, HandshakeError, TimeoutError) as exc:
            clock.report()
            if isinstance(exc, _Unauthenticated):
                self.num_refused_peers += 1
                code = "unauthenticated"
            else:
                code = "incompatible" if isinstance(exc, HandshakeError) else "bad_message"
            message_text = clip_text(str(exc) or "handshake timed out")
            await write_message(writer, ErrorMsg(transfer_id=0, code=code, message=message_text))
            return None
        offer = self.cma_host.offer if self.cma_host is not None else None
        hello_ok = HelloOk(
            metadata=self.metadata,
            compat_hash=self.metadata.compat_hash,
            worker_address=self.worker_address,
            cma=None if message.notices_only else offer,
        )
        await write_message(writer, hello_ok)
        clock.mark("HelloOk")
        clock.report()
        return RequesterConnection(
            peer_engine_id=message.metadata.engine_id,
            endpoint=endpoint,
            writer=writer,
            notices_only=message.notices_only,
        )

    async def _authenticate(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello: Hello,
        hello_payload: bytes,
    ) -> None:
        """The holder's half of the challenge-response (``auth``).

        Raises:
            _Unauthenticated: no nonce, or a reply that is not the right ``AuthProof``.
        """
        assert self.auth_key is not None
        if len(hello.auth_nonce) != NONCE_BYTES:
            raise _Unauthenticated("this node requires the cluster key (auth_key)")
        nonce = new_nonce()
        proof = holder_proof(self.auth_key, hello.auth_nonce, nonce, hello_payload)
        await write_message(writer, AuthChallenge(nonce=nonce, proof=proof))
        try:
            reply = decode_message(await read_frame(reader))
        except WireError as exc:
            raise _Unauthenticated(f"no valid AuthProof: {exc}") from None
        expected = requester_proof(self.auth_key, hello.auth_nonce, nonce, hello_payload)
        if not isinstance(reply, AuthProof) or not proof_matches(expected, reply.proof):
            raise _Unauthenticated("cluster key check failed")

    async def _serve_connection(
        self, conn: RequesterConnection, reader: asyncio.StreamReader
    ) -> None:
        while True:
            try:
                payload = await read_frame(reader)
            except WireError as exc:  # bad length prefix: the stream cannot be trusted further
                await send_error(conn.writer, 0, "bad_frame", str(exc))
                return
            try:
                message = decode_message(payload)
            except WireError as exc:
                await send_error(conn.writer, 0, "bad_message", str(exc))
                continue
            await self._dispatch(conn, message)

    async def _dispatch(self, conn: RequesterConnection, message: object) -> None:
        if conn.notices_only and not isinstance(message, TransferDoneNotice):
            await send_error(
                conn.writer,
                0,
                "bad_request",
                f"{type(message).__name__} on a notices-only connection (it carries TransferDone "
                "alone)",
            )
        elif isinstance(message, Read):
            await self._start_read(conn, message)
        elif isinstance(message, Cancel):
            serve = conn.serves.get(message.transfer_id)
            issued = 0 if serve is None else await serve.cancel(message.num_chunks_posted)
            await write_message(
                conn.writer, CancelOk(transfer_id=message.transfer_id, num_chunks_issued=issued)
            )
        elif isinstance(message, ReadCopied):
            serve = conn.serves.get(message.transfer_id)
            if serve is None or not serve.on_copied():
                await send_error(
                    conn.writer,
                    message.transfer_id,
                    "bad_request",
                    f"ReadCopied for transfer {message.transfer_id}, which is not a "
                    "same-host read with expected hashes waiting for it",
                )
        elif isinstance(message, Heartbeat):
            if self.callbacks.on_heartbeat is not None:
                self.callbacks.on_heartbeat(
                    conn.peer_engine_id, message.request_ids, message.tokens
                )
        elif isinstance(message, TransferDoneNotice):
            if message.peer_engine_id != conn.peer_engine_id:
                await send_error(
                    conn.writer,
                    0,
                    "bad_message",
                    f"TransferDone.peer_engine_id {message.peer_engine_id!r} is not this "
                    f"connection's peer {conn.peer_engine_id!r}",
                )
            elif self.callbacks.on_transfer_done is not None:
                self.callbacks.on_transfer_done(message)
        else:
            await send_error(
                conn.writer,
                0,
                "bad_message",
                f"{type(message).__name__} is not a requester message",
            )

    async def _start_read(self, conn: RequesterConnection, read: Read) -> None:
        if read.transfer_id in conn.serves:
            message = f"transfer_id {read.transfer_id} already used"
            await send_error(conn.writer, read.transfer_id, "bad_request", message)
            return
        try:
            if read.cma and self.cma_host is None:
                raise WireError("a same-host (cma) read, but this node offered none")
            check_read(self.metadata, read)
            mismatched = find_mismatched(
                read,
                self.callbacks.validators_for(read.copy_first)[0],
                serve_unchecked=self.callbacks.serve_unchecked_reads,
            )
        except WireError as exc:
            await send_error(conn.writer, read.transfer_id, "bad_request", str(exc))
            return
        unpin = None
        if read.copy_first:
            mismatched, unpin = self._pin_copy_first(read, mismatched)
        reply = ReadOk(
            transfer_id=read.transfer_id,
            mismatched=mismatched,
            lease_pending=self.callbacks.refusal_pending(read.lease, mismatched),
        )
        try:
            await write_message(conn.writer, reply)
        except BaseException:
            if unpin is not None:  # no serve will run to unpin it
                unpin()
            raise
        serve = self._serve_for(conn, read, mismatched, unpin)
        conn.serves[read.transfer_id] = serve
        while len(conn.serves) > _MAX_FINISHED_KEPT:
            oldest_id, oldest = next(iter(conn.serves.items()))
            if oldest.running:
                break
            del conn.serves[oldest_id]
        serve.start()

    def _pin_copy_first(
        self, read: Read, mismatched: list[list[int]]
    ) -> tuple[list[list[int]], Callable[[], None] | None]:
        """Pin a ``copy_first`` read's lease for its copy window plus ``DEADLINE_GRACE_S``
        (``serve.copy_first_window_s``): the requester may be copying already, and counts its
        copy only if it ended within that window (``cma_read``). Returns the read's mismatched
        positions (every position when the lease cannot be pinned) and the unpin for its serve
        (None: nothing pinned, also for a raw transport, which vouches for nothing)."""
        callbacks, lease = self.callbacks, read.lease
        if not callbacks.vouches:
            return mismatched, None
        pin, unpin = callbacks.lease_pin, callbacks.lease_unpin
        if (
            lease is not None
            and pin is not None
            and unpin is not None
            and pin(lease, copy_first_window_s(read) + DEADLINE_GRACE_S)
        ):
            return mismatched, functools.partial(unpin, lease)
        return [list(range(len(group.block_ids))) for group in read.groups], None

    def _serve_for(
        self,
        conn: RequesterConnection,
        read: Read,
        mismatched: list[list[int]],
        unpin: Callable[[], None] | None = None,
    ) -> Serve:
        """The serve of ``read``'s data path: the requester copies (``read.cma``) or UCX sends.
        Its re-checks use the validator registered now; ``unpin`` ends a ``copy_first`` read's
        pin when its serve ends."""
        validator = self.callbacks.validators_for(read.copy_first)[1]
        if read.cma:
            return CmaServe(
                conn, read, mismatched, recheck_validator=validator, count=self._count, unpin=unpin
            )
        max_block_bytes = max(g.num_layers * g.block_nbytes for g in self.metadata.groups)
        return UcxServe(
            conn,
            read,
            mismatched,
            recheck_validator=validator,
            count=self._count,
            kv_caches_by_group=self.kv_caches_by_group,
            metadata=self.metadata,
            pool=self.pool_for(read.chunk_bytes, max_block_bytes),
            window=self.window,
            booster=self.booster,
        )
