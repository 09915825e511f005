"""The store node's write path (issue 7, part 1): a TCP server for ``hello`` and ``put`` frames.

Schema and checks: ``wire.py``. Per connection, frames are handled one after another; each
gets exactly one reply. A bad message is an ``error`` reply to that writer only, and the server
keeps serving everyone: after an error in the header (framing, schema version, a field) the
connection is closed because the payload length can no longer be trusted; after an error about
the content (another model, a group or size that does not fit this store) the payload has been
consumed and the connection stays open.

Copies. A payload is received with ``loop.sock_recv_into`` straight into the connection's receive
buffer (a host tensor, reused from frame to frame, grown to the largest payload seen, never past
``PutHandler.max_put_bytes``), and copied once from there into the store's KV tensors
(``StoreCache.put``). No ``bytes`` object is made of the payload on the way: a stream reader's
buffer-then-slice costs two extra copies, and a freshly allocated buffer per frame costs more in
page faults than the copy itself (measured by ``benchmarks/bench_store.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Protocol

import torch

from .framing import PeerClosedError, recv_exactly
from .profile import StoreProfile
from .wire import (
    FRAME_HEADER,
    MAX_HEADER_BYTES,
    PutReply,
    PutRequest,
    StoreWireError,
    decode_header,
    decode_hello,
    decode_put,
    encode_error,
    encode_hello_ok,
    encode_reply,
)

__all__ = ["PutHandler", "StoreWriteServer"]

logger = logging.getLogger(__name__)

_LISTEN_BACKLOG = 128
_REFUSED = object()  # a connection's shelf after its hello was refused


class PutHandler(Protocol):
    """What the write server needs of a store (``StoreNode`` is one). Called on the server's
    event loop only.

    ``engine_id``: names the store in logs. ``incarnation``: the store's, in a ``hello_ok``.
    ``max_put_bytes``: the largest payload accepted. ``hello``: takes a writer's profile and
    returns the shelf its connection's puts go to (opened for a geometry the store has none
    for), or raises ``StoreWireError`` naming why it refuses the writer. ``check_put``: raises
    ``StoreWireError`` naming the field when a decoded put does not fit the connection's shelf
    (None: no hello on it; the store picks by the put's ``compat_hash``); its payload is then
    read and dropped and the connection stays open. ``put``: stores a checked put from
    ``payload`` (uint8 ``[put.payload_nbytes]``, reused by the server once it returns) on that
    shelf and returns the reply. ``count_put_error``: one malformed or refused frame.
    """

    @property
    def engine_id(self) -> str: ...

    @property
    def incarnation(self) -> int: ...

    @property
    def max_put_bytes(self) -> int: ...

    async def hello(self, profile: StoreProfile) -> Any: ...

    def check_put(self, put: PutRequest, shelf: Any) -> None: ...

    async def put(self, put: PutRequest, payload: torch.Tensor, shelf: Any) -> PutReply: ...

    def count_put_error(self) -> None: ...


class _FramingLost(Exception):
    """The stream cannot be resynchronised: reply, then close the connection."""


class StoreWriteServer:
    """Accepts writes for ``node`` on ``host:port`` (port 0: any free one). Everything runs on
    the event loop that called ``start``."""

    def __init__(self, node: PutHandler, *, host: str, port: int) -> None:
        self.node = node
        self._host, self._port = host, port
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("StoreWriteServer.address read before start()")
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(_LISTEN_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accept_task = loop.create_task(self._accept_loop(listener))

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        tasks = [t for t in (self._accept_task, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        listener.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of file descriptors: keep the server up
                logger.warning("store %s: accept failed: %s", self.node.engine_id, exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._serve(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        prefix = bytearray(FRAME_HEADER.size)
        receive_buffer = torch.empty(0, dtype=torch.uint8)
        shelf: list[Any] = [None]  # the shelf this connection's hello named
        try:
            while True:
                try:
                    await recv_exactly(sock, memoryview(prefix))
                except PeerClosedError as exc:
                    if exc.num_received:
                        logger.info("store %s: writer left mid-frame", self.node.engine_id)
                    return  # the writer went away (between frames: a normal close)
                try:
                    reply, receive_buffer = await self._handle(
                        FRAME_HEADER.unpack(prefix)[0], sock, receive_buffer, shelf
                    )
                except _FramingLost as exc:
                    self.node.count_put_error()
                    logger.warning("store %s: bad write frame: %s", self.node.engine_id, exc)
                    await loop.sock_sendall(sock, encode_error(str(exc)))
                    return
                except StoreWireError as exc:
                    self.node.count_put_error()
                    logger.warning("store %s: refused a write: %s", self.node.engine_id, exc)
                    reply = encode_error(str(exc))
                await loop.sock_sendall(sock, reply)
        except (PeerClosedError, OSError) as exc:
            logger.info("store %s: writer connection lost: %s", self.node.engine_id, exc)
        finally:
            sock.close()

    async def _handle(
        self, header_nbytes: int, sock: socket.socket, receive_buffer: torch.Tensor,
        shelf: list[Any],
    ) -> tuple[bytes, torch.Tensor]:
        """One frame: header, payload, store. Returns the reply and the (possibly grown)
        receive buffer; a hello sets ``shelf[0]``, the shelf of the connection's later puts.
        Raises ``_FramingLost``, ``StoreWireError``, ``PeerClosedError``."""
        if not 0 < header_nbytes <= MAX_HEADER_BYTES:
            raise _FramingLost(f"header of {header_nbytes} bytes not in [1, {MAX_HEADER_BYTES}]")
        raw = bytearray(header_nbytes)
        await recv_exactly(sock, memoryview(raw))
        try:
            header = decode_header(bytes(raw))
        except StoreWireError as exc:
            raise _FramingLost(str(exc)) from None
        if header["type"] == "hello":  # no payload: a refused hello leaves the stream whole
            shelf[0] = _REFUSED  # until the store takes it: puts after a refusal are refused
            shelf[0] = await self.node.hello(decode_hello(header))
            return encode_hello_ok(self.node.incarnation), receive_buffer
        try:
            put = decode_put(header, max_payload_nbytes=self.node.max_put_bytes)
        except StoreWireError as exc:
            raise _FramingLost(str(exc)) from None
        payload_nbytes = put.payload_nbytes  # <= max_put_bytes: checked by decode_put
        if receive_buffer.numel() < payload_nbytes:
            receive_buffer = torch.empty(payload_nbytes, dtype=torch.uint8)
        payload = receive_buffer[:payload_nbytes]
        if payload_nbytes:
            await recv_exactly(sock, memoryview(payload.numpy()))
        if shelf[0] is _REFUSED:
            raise StoreWireError("this connection's hello was refused: no put is taken on it")
        self.node.check_put(put, shelf[0])
        return encode_reply(await self.node.put(put, payload, shelf[0])), receive_buffer
