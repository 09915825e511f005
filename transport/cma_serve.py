"""The same-host data path of a read, holder side: ``CmaServe`` sends nothing, since the
requester copies the blocks out of this process itself (``cma``; requester side: ``cma_read``).

A read without expected hashes is done at ``ReadOk``: its serve never runs. With expected
hashes the serve waits for the requester's ``ReadCopied``, re-checks every block it let through
at ``ReadOk`` and answers ``ReadDone``. A ``Cancel``, or no word within the deadline plus
``serve.DEADLINE_GRACE_S``, ends it silently: the holder lent nothing (no staging, no send).
"""

from __future__ import annotations

import asyncio
import logging

from .base import BlockValidator
from .plan import expects_read_done, good_positions, recheck_blocks
from .serve import RequesterConnection, Serve, ServeCount
from .wire import Read

logger = logging.getLogger(__name__)


class CmaServe(Serve):
    """One same-host read (see the module docstring)."""

    def __init__(
        self,
        conn: RequesterConnection,
        read: Read,
        mismatched: list[list[int]],
        *,
        recheck_validator: BlockValidator | None,
        count: ServeCount,
    ):
        super().__init__(conn, read, mismatched, recheck_validator=recheck_validator, count=count)
        self._copied = asyncio.Event()  # ReadCopied arrived, or a Cancel

    def start(self) -> None:
        if expects_read_done(self.read):  # otherwise the holder has nothing more to say
            super().start()

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
        if self.cancelled:
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
