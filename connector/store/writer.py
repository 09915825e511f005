"""The store tier's writer client: one TCP connection from a node to a store's write server,
sending ``put`` frames (``wire.py``) and reading their replies, on the connector's event loop.
Each new connection starts with a ``hello`` naming the writer's ``StoreProfile`` (when it has
one), from which a store without a geometry takes its own."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from typing import Any

from .framing import recv_exactly
from .profile import StoreProfile
from .wire import (
    FRAME_HEADER,
    MAX_HEADER_BYTES,
    PutReply,
    PutRequest,
    StoreRefusedError,
    StoreWireError,
    check_reply,
    decode_header,
    decode_hello_reply,
    decode_reply,
    encode_hello,
    encode_put_header,
)

__all__ = ["StoreWriter"]

_PUT_TIMEOUT_S = 30.0
_REFUSED_RETRY_S = 10.0


class StoreWriter:
    """One TCP connection to a store's write server at ``host:port``, used from one event loop
    (the connector's loop thread); puts are sent one at a time (an asyncio lock), and the
    connection is reopened by the next put after any error.

    The payload parts go out with ``loop.sock_sendall`` straight from the caller's memory (no
    copy into a stream buffer, no msgpack of the bytes): only the small header is packed.

    ``hello``: the writer's profile, sent first on each connection (None: no hello). A store
    that refuses it is not asked again for ``refused_retry_s``: puts in between raise the same
    ``StoreRefusedError`` at once, without a connection."""

    def __init__(self, host: str, port: int, *, put_timeout_s: float = _PUT_TIMEOUT_S,
                 refused_retry_s: float = _REFUSED_RETRY_S) -> None:
        self.host, self.port = host, port
        self.put_timeout_s = put_timeout_s
        self.refused_retry_s = refused_retry_s
        self.hello: StoreProfile | None = None
        self._refused: tuple[float, str] | None = None  # (retry after, monotonic s; message)
        self._lock = asyncio.Lock()
        self._sock: socket.socket | None = None

    async def put(self, put: PutRequest, payloads: Sequence[memoryview]) -> PutReply:
        """Send ``put`` with its payload parts (byte views, ``put.payload_nbytes`` in all; read
        only, the caller keeps them alive until this returns); returns the store's reply.

        Raises:
            ValueError: the parts do not add up to ``put.payload_nbytes``.
            StoreWireError: the store refused the put (its message) or replied garbage, or a
                reply that does not answer this put (``wire.check_reply``);
                ``StoreRefusedError``: it refused this writer's hello (another geometry).
            OSError, EOFError, TimeoutError: the store is unreachable, closed the connection
                or took longer than ``put_timeout_s``.
        """
        num_bytes = sum(part.nbytes for part in payloads)
        if num_bytes != put.payload_nbytes:
            raise ValueError(f"payload parts hold {num_bytes} bytes, the put {put.payload_nbytes}")
        async with self._lock:
            if self._refused is not None and time.monotonic() < self._refused[0]:
                raise StoreRefusedError(self._refused[1])
            try:
                return await asyncio.wait_for(self._put(put, payloads), self.put_timeout_s)
            except BaseException:
                await self.close()  # the stream may be out of step; the next put reconnects
                raise

    async def _connect(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _say_hello(self, sock: socket.socket, profile: StoreProfile) -> None:
        """Send the hello and read the answer; a refusal is remembered (``refused_retry_s``)."""
        await asyncio.get_running_loop().sock_sendall(sock, encode_hello(profile))
        try:
            decode_hello_reply(await self._read_reply(sock))
        except StoreRefusedError as exc:
            self._refused = (time.monotonic() + self.refused_retry_s, str(exc))
            raise
        self._refused = None

    async def _put(self, put: PutRequest, payloads: Sequence[memoryview]) -> PutReply:
        loop = asyncio.get_running_loop()
        if self._sock is None:
            self._sock = await self._connect()
            if self.hello is not None:
                await self._say_hello(self._sock, self.hello)
        sock = self._sock
        await loop.sock_sendall(sock, encode_put_header(put))
        for part in payloads:
            if part.nbytes:
                await loop.sock_sendall(sock, part.cast("B") if part.format != "B" else part)
        reply = decode_reply(await self._read_reply(sock))
        check_reply(put, reply)
        return reply

    async def _read_reply(self, sock: socket.socket) -> dict[Any, Any]:
        prefix = bytearray(FRAME_HEADER.size)
        await recv_exactly(sock, memoryview(prefix))
        (header_nbytes,) = FRAME_HEADER.unpack(prefix)
        if not 0 < header_nbytes <= MAX_HEADER_BYTES:  # what a store may frame
            raise StoreWireError(f"reply header of {header_nbytes} bytes")
        raw = bytearray(header_nbytes)
        await recv_exactly(sock, memoryview(raw))
        return decode_header(bytes(raw))

    async def close(self) -> None:
        """Close the connection (the next put opens a new one). Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
