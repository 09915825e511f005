"""The store node's write path (issue 7, part 1): an asyncio TCP server for ``put`` frames.

Schema and checks: ``store_wire.py``. Per connection, frames are handled one after another; each
gets exactly one reply. A bad message is an ``error`` reply to that writer only, and the server
keeps serving everyone: after an error in the header (framing, schema version, a field) the
connection is closed because the payload length can no longer be trusted; after an error about
the content (another model, a group or size that does not fit this store) the payload has been
consumed and the connection stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from .store_wire import (
    FRAME_HEADER,
    MAX_HEADER_BYTES,
    StoreWireError,
    decode_header,
    decode_put,
    encode_error,
    encode_reply,
)

if TYPE_CHECKING:
    from .store_node import StoreNode

__all__ = ["StoreWriteServer"]

logger = logging.getLogger(__name__)

_READ_CHUNK_BYTES = 4 << 20


class _FramingLost(Exception):
    """The stream cannot be resynchronised: reply, then close the connection."""


class StoreWriteServer:
    """Accepts writes for ``node`` on ``host:port`` (port 0: any free one)."""

    def __init__(self, node: StoreNode, *, host: str, port: int) -> None:
        self.node = node
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("StoreWriteServer.address read before start()")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, limit=_READ_CHUNK_BYTES
        )

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    prefix = await reader.readexactly(FRAME_HEADER.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the writer went away between frames
                try:
                    reply = await self._handle(FRAME_HEADER.unpack(prefix)[0], reader)
                except _FramingLost as exc:
                    self.node.stats.add(num_put_errors=1)
                    logger.warning("store %s: bad write frame: %s", self.node.engine_id, exc)
                    writer.write(encode_error(str(exc)))
                    await writer.drain()
                    return
                except StoreWireError as exc:
                    self.node.stats.add(num_put_errors=1)
                    logger.warning("store %s: refused a put: %s", self.node.engine_id, exc)
                    reply = encode_error(str(exc))
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            logger.info("store %s: writer connection lost: %s", self.node.engine_id, exc)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, header_nbytes: int, reader: asyncio.StreamReader) -> bytes:
        """One frame: header, payload, store. Raises ``_FramingLost`` or ``StoreWireError``."""
        if not 0 < header_nbytes <= MAX_HEADER_BYTES:
            raise _FramingLost(f"header of {header_nbytes} bytes not in [1, {MAX_HEADER_BYTES}]")
        raw = await reader.readexactly(header_nbytes)
        try:
            put = decode_put(decode_header(raw), max_payload_nbytes=self.node.max_put_bytes)
        except StoreWireError as exc:
            raise _FramingLost(str(exc)) from None
        payload = bytearray(put.payload_nbytes)
        view = memoryview(payload)
        filled = 0
        while filled < len(payload):
            chunk = await reader.read(min(len(payload) - filled, _READ_CHUNK_BYTES))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(view[:filled]), len(payload))
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        self.node.check_put(put)
        return encode_reply(await self.node.put(put, payload))
