"""Holder side of one ``UcxxHolder`` read after its ``ReadOk``: ``Serve``, the interface a data
path implements, and the holder's view of one requester connection.

The holder checks every ``Read`` alike (ids, then hashes) and answers ``ReadOk``
(``ucxx_holder``); then one serve, chosen once per read from ``Read.cma``, does what the data
path needs: ``UcxServe`` (``ucx_serve``: gather and send the blocks as UCX tag messages) or
``CmaServe`` (``cma_serve``: nothing to send, the requester copies; with expected hashes, wait for
``ReadCopied`` and re-check). Either ends a read with expected hashes with ``ReadDone`` (the
blocks that failed the re-check after their bytes left; ``plan``, "Hash checks on the holder")
and stops on ``Cancel``. A serve that outlives its read's deadline by ``DEADLINE_GRACE_S`` gives
up: the requester is no longer waiting. A serve that fails (a validator or copy bug) sends its
error to that requester only (``ErrorMsg``, code ``holder_error``) and the holder keeps serving.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from .base import BlockValidator
from .control import write_message
from .errors import TransportError
from .limits import clip_text
from .wire import ErrorMsg, Read, ReadDone

logger = logging.getLogger(__name__)

DEADLINE_GRACE_S = 2.0
"""A serve outlives its read's deadline by this much, so the requester's own deadline and Cancel
come first; past it the requester is not receiving (a UCX serve then drops its connection)."""
COPY_FIRST_MAX_S = 30.0
"""A ``copy_first`` read's copy counts only if it ended within this long of the ``Read`` (or its
deadline, if sooner), and the holder pins the read's lease that long plus
``DEADLINE_GRACE_S``: a requester cannot keep a lease from ending for longer (a 2 MiB copy
takes milliseconds)."""


def copy_first_window_s(read: Read) -> float:
    """How long after a ``copy_first`` read went out its copy may end and still count (the
    requester's side of the pin: ``cma_read``, ``UcxxHolder._pin_copy_first``)."""
    return min(read.deadline_ms / 1000, COPY_FIRST_MAX_S)


@dataclass(kw_only=True, slots=True)
class RequesterConnection:
    """The holder's side of one requester's control connection, after the handshake.

    Attributes:
        peer_engine_id: the requester's engine id (its ``Hello``).
        endpoint: ucxx endpoint to the requester's worker, one per control connection; None on
            a notices-only connection.
        writer: the control stream (replies and errors go out here).
        notices_only: the requester asked for a connection that carries release notices
            (``TransferDoneNotice``) alone (``Hello.notices_only``): no compatibility check,
            no endpoint, every other message refused.
        serves: transfer id -> serve, the running ones and the latest finished ones.
        fillers: empty sends completing receives a cancelled read posted but was never sent.
    """

    peer_engine_id: str
    endpoint: object
    writer: asyncio.StreamWriter
    notices_only: bool = False
    serves: OrderedDict[int, Serve] = field(default_factory=OrderedDict)
    fillers: set[asyncio.Future[object]] = field(default_factory=set)


@dataclass(slots=True)
class ServeCount:
    """Serves running right now, over every connection of one holder (``num_active``)."""

    num_active: int = 0


class Serve(abc.ABC):
    """One read this holder serves after its ``ReadOk``; built per read, started once.

    Args:
        conn: the requester's connection.
        read: the read, checked (``plan.check_read``).
        mismatched: per group entry, the positions refused at ``ReadOk`` (never served).
        recheck_validator: the re-check run over blocks once their bytes left
            (``HolderCallbacks.recheck_validator`` when the read arrived), or None.
        count: the holder's running-serve count (this serve counts while its task runs).
    """

    def __init__(
        self,
        conn: RequesterConnection,
        read: Read,
        mismatched: list[list[int]],
        *,
        recheck_validator: BlockValidator | None,
        count: ServeCount,
    ):
        self.conn = conn
        self.read = read
        self.mismatched = mismatched
        self.recheck_validator = recheck_validator
        self.cancelled = False
        self.task: asyncio.Task[None] | None = None
        self._count = count

    @property
    def deadline_s(self) -> float:
        """How long this serve may run: the read's deadline (a ``copy_first`` read's copy
        window, ``copy_first_window_s``: its pin) plus ``DEADLINE_GRACE_S``."""
        read = self.read
        window_s = copy_first_window_s(read) if read.copy_first else read.deadline_ms / 1000
        return window_s + DEADLINE_GRACE_S

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        """Start serving in a task of its own."""
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        self._count.num_active += 1
        try:
            await self._serve()
        except (asyncio.CancelledError, TransportError):
            pass  # dropped: the requester is gone
        except Exception as exc:  # a validator or copy bug: fail this read, keep serving
            logger.warning("serving transfer %d failed: %r", self.read.transfer_id, exc)
            with contextlib.suppress(TransportError):
                message = f"serving the read failed: {exc!r}"
                await send_error(self.conn.writer, self.read.transfer_id, "holder_error", message)
        finally:
            self._count.num_active -= 1

    @abc.abstractmethod
    async def _serve(self) -> None:
        """The data path's part of the read, to its ``ReadDone`` (a read with expected hashes)
        or its cancel. Releases whatever it took before it returns or raises."""

    @abc.abstractmethod
    async def cancel(self, num_chunks_posted: int) -> int:
        """Stop serving (``Cancel``): the requester has posted receives for chunks
        ``[0, num_chunks_posted)``. Returns how many chunks were issued (``CancelOk``); a
        serve that sends chunks completes those posted and never issued."""

    def on_copied(self) -> bool:
        """The requester reports a same-host copy done (``ReadCopied``); False when this serve
        waits for no such report (the holder refuses it)."""
        return False

    async def _send_read_done(self, late: list[list[int]]) -> None:
        """The holder's last word on the read: ``late[i]``, positions of ``groups[i]`` that
        failed the re-check after their bytes left."""
        await write_message(
            self.conn.writer, ReadDone(transfer_id=self.read.transfer_id, mismatched=late)
        )


async def send_error(
    writer: asyncio.StreamWriter, transfer_id: int, code: str, message: str
) -> None:
    """An ``ErrorMsg`` to one peer (``transfer_id`` 0: about the connection)."""
    await write_message(
        writer, ErrorMsg(transfer_id=transfer_id, code=code, message=clip_text(message))
    )
