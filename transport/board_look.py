"""A look at a same-host holder's block board before a handoff is planned (``cma_board``).

A decode node's worker half reads a handoff one-sided, checking the holder's board around its
copy (``cma_one_sided``), but only once the scheduler has committed the request to that load.
The scheduler decides earlier, and a ticket the board would decline (another prompt's, a stale
one) then costs a step committed to a load that fails. ``look_at_board`` lets the scheduler read
the same entries first (one ``process_vm_readv``, no message to the holder) and learn one of:

- every entry is stable and names the expected block: the read will very likely land (the
  worker still checks around its copy: the board may change in between);
- some stable entry names *another* block (a non-zero tag that is not the expected one): the
  holder holds other content at that position under a live lease. A ticket's own live lease
  would publish the ticket's tag there, or clear the entry where two leases disagree, and a
  block the ticket's request still holds is held by any other lease with the same hash (a
  block hash names its tokens; a partial block is never shared). So the holder's own check
  would refuse the read: another prompt's ticket, or a stale one whose blocks were reused;
- some entry empty or being rewritten (a lease not granted yet, or ended): only the holder can
  answer;
- the board cannot be read from this process (another pid namespace, ptrace rules), or the
  holder's probe no longer reads back (another process has the pid): the look says nothing.

Owner: any thread (a pure read of another process's memory; nothing here keeps state).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .cma import PROBE_BYTES, CmaReadError, read_ranges
from .cma_board import BoardCheck
from .metadata import NodeMetadata
from .wire_fields import CmaOffer

__all__ = ["BoardLook", "BoardRef", "look_at_board"]


class BoardLook(enum.Enum):
    """What a look at a holder's board found (``look_at_board``; module docstring)."""

    VOUCHED = "every entry stable and naming its expected block"
    OTHER_BLOCKS = "a stable entry names another block: the holder would refuse the read"
    UNSETTLED = "an entry empty or being rewritten: only the holder can answer"
    UNREADABLE = "the board cannot be read from this process, or its process is gone"


class BoardRef(NamedTuple):
    """Where a connected same-host holder's block board is, as a requester accepted it at
    handshake (``CmaPeer.accept``: its probe read back): ``Transport.one_sided_holders``.

    Attributes:
        engine_id, incarnation: the holder process (``NodeMetadata``).
        pid: its process id; ``board_address``: its board's first entry there.
        board_blocks: the board's shape, ``num_blocks`` of each KV cache group.
        probe_address, probe: the holder's 16-byte probe and its content (``CmaOffer``): read
            after the board, it proves the pid still names that process.
    """

    engine_id: str
    incarnation: str
    pid: int
    board_address: int
    board_blocks: tuple[int, ...]
    probe_address: int
    probe: bytes

    @classmethod
    def of(cls, remote: NodeMetadata, offer: CmaOffer) -> BoardRef:
        """The board of the holder ``remote`` whose accepted offer is ``offer`` (its
        ``board_address`` set)."""
        assert offer.board_address is not None
        return cls(remote.engine_id, str(remote.incarnation), offer.pid, offer.board_address,
                   tuple(g.num_blocks for g in remote.groups), offer.probe_address, offer.probe)


def look_at_board(
    board: BoardRef, blocks: Sequence[tuple[int, Sequence[int], Sequence[bytes]]]
) -> BoardLook:
    """What ``board`` says now of ``blocks`` (one ``process_vm_readv`` of their entries, one of
    the probe; module docstring).

    Args:
        board: the holder's board.
        blocks: per KV cache group read, ``(group_id, holder block ids, expected tags)``
            (``cma_board.full_block_tag`` / ``lease_block_tag``, 16 bytes each), at least one
            block in all.

    Raises:
        ValueError: no block, or block ids outside the board (caller mistakes).
    """
    if not any(len(ids) for _, ids, _ in blocks):
        raise ValueError("a look at a board needs at least one block")
    check = BoardCheck(board.pid, board.board_address, board.board_blocks, blocks)
    try:
        verdict = check.verdict()
        if _read_probe(board) != board.probe:
            return BoardLook.UNREADABLE  # another process has the pid: not the board
    except CmaReadError:
        return BoardLook.UNREADABLE
    if verdict is None:
        return BoardLook.UNSETTLED
    return BoardLook.VOUCHED if verdict else BoardLook.OTHER_BLOCKS


def _read_probe(board: BoardRef) -> bytes:
    buffer = np.zeros(PROBE_BYTES, dtype=np.uint8)
    local = np.array([[buffer.ctypes.data, PROBE_BYTES]], dtype=np.uint64)
    remote = np.array([[board.probe_address, PROBE_BYTES]], dtype=np.uint64)
    read_ranges(board.pid, local, remote, PROBE_BYTES, "the holder's probe")
    return buffer.tobytes()
