"""Socket framing helpers shared by the store's write server and its writer client: fill a
buffer from a non-blocking socket on the running asyncio loop, and the error for a peer that
closed mid-way. The frame layout itself (length prefix, msgpack header) is ``wire.py``'s."""

from __future__ import annotations

import asyncio
import socket

__all__ = ["PeerClosedError", "recv_exactly"]


class PeerClosedError(EOFError):
    """The peer closed its end of a connection; ``num_received`` bytes of the expected ones had
    arrived (0: it closed between frames)."""

    def __init__(self, num_received: int) -> None:
        super().__init__(f"connection closed after {num_received} bytes")
        self.num_received = num_received


async def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` (mutated) from the non-blocking ``sock`` on the running loop.

    Raises:
        PeerClosedError: the peer closed before ``len(view)`` bytes arrived.
        OSError: the connection failed.
    """
    loop = asyncio.get_running_loop()
    filled, total = 0, len(view)
    while filled < total:
        n = await loop.sock_recv_into(sock, view[filled:])
        if n == 0:
            raise PeerClosedError(filled)
        filled += n
