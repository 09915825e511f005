"""Notice an HTTP client that went away while its handler waits, so the work can be aborted.

Starlette cancels a streaming response when the client disconnects, but not a handler that is
still awaiting a whole answer: without this, a non-streaming request runs to completion for
nobody (on a node: every decode step; on the proxy: both hops). :class:`DisconnectWatch` reads
the request's ASGI ``receive`` channel, which after the body has been read yields only
``http.disconnect`` (the ASGI HTTP spec; uvicorn sends it when the connection is lost, httpx's
ASGI transport once the response is complete), and cancels the awaited work when that arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from types import TracebackType
from typing import TypeVar

from fastapi import Request

__all__ = ["CLIENT_CLOSED_STATUS", "ClientDisconnected", "DisconnectWatch"]

T = TypeVar("T")

# nginx's "client closed request": the status a handler answers when nobody is listening.
CLIENT_CLOSED_STATUS = 499


class ClientDisconnected(Exception):
    """The client went away while the handler waited; the awaited work was cancelled."""


class DisconnectWatch:
    """Async context manager watching ``request`` for ``http.disconnect``.

    Use only after the body has been read (``await request.json()``), and leave the context
    before returning a ``StreamingResponse`` (which watches the channel itself: two readers of
    one ``receive`` would compete for its messages).

        async with DisconnectWatch(request) as watch:
            result = await watch.wait(work())   # raises ClientDisconnected
    """

    def __init__(self, request: Request) -> None:
        self._request = request
        self._watcher: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DisconnectWatch:
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            # A receive channel that failed counts as a disconnect; its error is not the
            # handler's.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watcher

    async def _watch(self) -> None:
        while True:
            message = await self._request.receive()
            if message["type"] == "http.disconnect":
                return

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """``await awaitable`` unless the client disconnects first.

        Returns its result (a result that is ready wins over a disconnect seen at the same
        time). Raises whatever it raises; ``ClientDisconnected`` after cancelling it when the
        client went away; ``RuntimeError`` outside the context.
        """
        if self._watcher is None:
            raise RuntimeError("DisconnectWatch.wait called outside 'async with'")
        work = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({work, self._watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            raise ClientDisconnected
        return work.result()
