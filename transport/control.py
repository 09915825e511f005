"""The control channel: length-prefixed msgpack frames (``wire``) over an asyncio TCP stream,
and the requester's view of one holder connection.

TCP carries only control messages; it is also how a requester learns that a holder died (the
socket closes), because the shared-memory UCX endpoints run without peer-failure handling
(docs/architecture.md, "The transport").
"""

from __future__ import annotations

import asyncio
import contextlib

from .errors import TransportError, WireError
from .metadata import NodeMetadata
from .wire import (
    CancelOk,
    ErrorMsg,
    Message,
    ReadDone,
    ReadOk,
    decode_message,
    encode_message,
    frame_length,
)


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame's payload.

    Raises:
        asyncio.IncompleteReadError: the stream ended.
        WireError: the length prefix is out of range (the stream cannot be resynchronised).
    """
    header = await reader.readexactly(4)
    return await reader.readexactly(frame_length(header))


async def write_message(writer: asyncio.StreamWriter, message: Message) -> None:
    """Send one message; raises ``TransportError`` if the connection is gone."""
    try:
        writer.write(encode_message(message))
        await writer.drain()
    except (ConnectionError, RuntimeError) as exc:
        raise TransportError(f"control connection lost: {exc}") from None


class HolderConnection:
    """A requester's control connection to one holder, after a successful handshake.

    Replies (``ReadOk``, ``ReadDone``, ``CancelOk``, ``ErrorMsg``) are routed by ``transfer_id``
    to whoever waits for them; ``lost`` completes when the connection ends for any reason, and
    then the UCX ``endpoint`` (created once per connection, never per read) is aborted,
    cancelling every receive still posted on it.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        remote: NodeMetadata,
        remote_worker_address: bytes,
        endpoint: object = None,
        cma: object = None,
    ):
        self.reader = reader
        self.writer = writer
        self.remote = remote
        self.remote_worker_address = remote_worker_address
        self.endpoint = endpoint  # ucxx endpoint to the holder's worker: the reads' receives
        self.cma = cma  # ``cma.CmaPeer`` when this holder's blocks are copied directly
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters: dict[tuple[int, type], asyncio.Future[Message]] = {}
        self._reader_task = asyncio.ensure_future(self._read_loop())

    @property
    def alive(self) -> bool:
        return not self.lost.done()

    def expect(self, transfer_id: int, kind: type) -> asyncio.Future[Message]:
        """A future for the next ``kind`` reply (or ``ErrorMsg``) about ``transfer_id``."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiters[(transfer_id, kind)] = future
        return future

    def forget(self, transfer_id: int, kind: type) -> None:
        self._waiters.pop((transfer_id, kind), None)

    async def send(self, message: Message) -> None:
        if not self.alive:
            raise TransportError(f"control connection to {self.remote.engine_id!r} lost")
        await write_message(self.writer, message)

    async def _read_loop(self) -> None:
        reason = "closed by peer"
        try:
            while True:
                message = decode_message(await read_frame(self.reader))
                if isinstance(message, ReadOk | ReadDone | CancelOk):
                    key = (message.transfer_id, type(message))
                elif isinstance(message, ErrorMsg) and message.transfer_id != 0:
                    # an error answers whichever request of that transfer is waiting
                    key = next(
                        (k for k in self._waiters if k[0] == message.transfer_id), (0, ErrorMsg)
                    )
                elif isinstance(message, ErrorMsg):
                    reason = f"peer error {message.code}: {message.message}"
                    break
                else:
                    reason = f"unexpected {type(message).__name__} from holder"
                    break
                future = self._waiters.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except WireError as exc:
            reason = f"bad message from holder: {exc}"
        finally:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        if not self.lost.done():
            self.lost.set_result(reason)
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(TransportError(f"control connection lost: {reason}"))
        self._waiters.clear()
        # abort, not close: close() keeps flushing to a peer that may have stopped reading
        self.writer.transport.abort()
        if self.endpoint is not None:  # cancels every receive still posted from this holder
            with contextlib.suppress(Exception):
                self.endpoint.abort(period=10**8)  # type: ignore[attr-defined]

    async def close(self) -> None:
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
        self._fail("closed")
