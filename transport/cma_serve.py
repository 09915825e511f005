"""The same-host data path of a read, holder side: ``CmaServe`` sends nothing, since the
requester copies the blocks out of this process itself (``cma``; requester side: ``cma_read``).

A read without expected hashes is done at ``ReadOk``: its serve never runs. With expected
hashes the serve waits for the requester's ``ReadCopied``, re-checks every block it let through
at ``ReadOk`` and answers ``ReadDone``. A ``copy_first`` read's serve only holds the pin on its
lease (taken before ``ReadOk``) until ``ReadCopied`` and then unpins: no re-check, no
``ReadDone``. A ``Cancel``, or no word within the deadline plus ``serve.DEADLINE_GRACE_S``,
ends a serve silently (and unpins): the holder lent nothing (no staging, no send).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .base import BlockValidator
from .plan import expects_read_done, good_positions, recheck_blocks
from .serve import RequesterConnection, Serve, ServeCount
from .wire import Read

logger = logging.getLogger(__name__)


class CmaServe(Serve):
    """One same-host read (see the module docstring); ``unpin`` ends the pin a ``copy_first``
    read's lease got before ``ReadOk`` (None: nothing pinned)."""

    def __init__(
        self,
        conn: RequesterConnection,
        read: Read,
        mismatched: list[list[int]],
        *,
        recheck_validator: BlockValidator | None,
        count: ServeCount,
        unpin: Callable[[], None] | None = None,
    ):
        super().__init__(conn, read, mismatched, recheck_validator=recheck_validator, count=count)
        self._copied = asyncio.Event()  # ReadCopied arrived, or a Cancel
        self._unpin = unpin

    def start(self) -> None:
        # otherwise the holder has nothing more to say
        if expects_read_done(self.read) or self.read.copy_first:
            super().start()
        if self._unpin is not None:
            assert self.task is not None
            started_at = asyncio.get_running_loop().time()
            self.task.add_done_callback(lambda task: self._release_pin(task, started_at))

    def _release_pin(self, task: asyncio.Task[None], started_at: float) -> None:
        """Unpin once the serve ended (a done callback: it runs also for a task cancelled before
        its first step). A serve that ended on ``ReadCopied``, ``Cancel`` or its deadline
        unpins now; one cancelled with its connection (the requester may still be copying)
        keeps the pin to its own end."""
        unpin, self._unpin = self._unpin, None
        if unpin is None:
            return
        loop = asyncio.get_running_loop()
        if task.cancelled():
            loop.call_at(started_at + self.deadline_s, unpin)
        else:
            unpin()

    async def cancel(self, num_chunks_posted: int) -> int:
        self.cancelled = True
        self._copied.set()  # a serve waiting for ReadCopied ends
        return 0  # nothing was ever sent

    def on_copied(self) -> bool:
        if not self.running or self._copied.is_set():
            return False
        self._copied.set()
        return True

    async def _serve(self) -> None:
        read = self.read
        try:
            await asyncio.wait_for(self._copied.wait(), self.deadline_s)
        except TimeoutError:
            logger.info(
                "same-host transfer %d: no ReadCopied before its deadline", read.transfer_id
            )
            return
        if self.cancelled or read.copy_first:
            return
        late = [
            recheck_blocks(
                group,
                good_positions(len(group.block_ids), bad),
                self.recheck_validator,
                read.lease,
            )
            for group, bad in zip(read.groups, self.mismatched, strict=True)
        ]
        await self._send_read_done(late)
