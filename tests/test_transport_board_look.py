"""A scheduler's look at a holder's block board before it plans a handoff
(``kvbridge.transport.look_at_board``, issue 28 item 4): the holder's real lease table writes
the board in this process (a process may read itself with ``process_vm_readv``), and the look
tells a ticket the holder would refuse (another prompt's blocks, blocks reused since) from one
it would serve and from one only the holder can answer for (a lease not granted yet, or ended).
"""

from __future__ import annotations

import os

import kvbridge.transport.cma as cma
import numpy as np
import pytest
from kvbridge.connector.lease import LeaseTable
from kvbridge.transport import (
    BlockBoard,
    BoardLook,
    BoardRef,
    full_block_tag,
    lease_block_tag,
    look_at_board,
)

if not cma.available():
    pytest.skip("this system has no process_vm_readv", allow_module_level=True)

X = [b"x-block-0", b"x-block-1"]  # the request's own full blocks
Y = [b"y-block-0", b"y-block-1"]  # another prompt's
IDS = [3, 4, 5]  # the ticket's blocks on the holder: two full, then the partial last block


class _Holder:
    """A holder's lease table, board and probe in this process, and its ``BoardRef``."""

    def __init__(self) -> None:
        self.leases = LeaseTable(lease_s=30.0)
        self.board = BlockBoard([16])
        self.leases.attach_board(self.board)
        self.probe = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        self.ref = BoardRef("prefill", "1", os.getpid(), self.board.address, (16,),
                            int(self.probe.ctypes.data), self.probe.tobytes())

    def look(self, hashes=X, *, token: str = "tok", ids=IDS, ref: BoardRef | None = None):
        """What a ticket (lease ``p-1`` with ``token``) for a request of ``hashes`` sees."""
        tags = [full_block_tag(h) for h in hashes] + [lease_block_tag("p-1", token)]
        return look_at_board(ref or self.ref, [(0, ids, tags[: len(ids)])])


def test_the_ticket_s_own_live_lease_is_vouched_for():
    holder = _Holder()
    holder.leases.grant("p-1", [IDS], X, token="tok")
    assert holder.look() is BoardLook.VOUCHED


@pytest.mark.parametrize("case", ["another prompt's ticket", "stale: blocks leased again",
                                  "another lease's partial block"])
def test_blocks_the_holder_holds_for_other_content_are_other_blocks(case):
    holder = _Holder()
    if case == "another prompt's ticket":  # the ticket is y's: P holds y there
        holder.leases.grant("p-1", [IDS], Y, token="tok")
    elif case == "stale: blocks leased again":  # x's lease ended; P reused the blocks for z
        holder.leases.grant("p-1", [IDS], X, token="tok")
        holder.leases.release("p-1", "tok")
        holder.leases.grant("p-2", [IDS], Y, token="other")
    else:  # only the partial last block differs: it is p-2's, another lease's
        holder.leases.grant("p-2", [[9, 9 + 1, 5]], [b"z0", b"z1"], token="other")
        assert holder.look(ids=[5], hashes=[]) is BoardLook.OTHER_BLOCKS
        return
    assert holder.look() is BoardLook.OTHER_BLOCKS


@pytest.mark.parametrize("case", ["not granted yet", "released", "partly on the board",
                                  "being rewritten"])
def test_what_only_the_holder_can_answer_is_unsettled(case):
    holder = _Holder()
    if case == "released":  # a stale ticket whose blocks nobody leased since
        holder.leases.grant("p-1", [IDS], X, token="tok")
        holder.leases.release("p-1", "tok")
    elif case == "partly on the board":  # another lease shares x's first block
        holder.leases.grant("p-2", [[3]], X[:1], token="other")
    elif case == "being rewritten":
        holder.leases.grant("p-1", [IDS], X, token="tok")
        holder.board._words[holder.board.entry_index(0, 4), 0] += 1  # odd: mid-write
    assert holder.look() is BoardLook.UNSETTLED


def test_a_board_whose_process_is_gone_or_replaced_says_nothing():
    holder = _Holder()
    holder.leases.grant("p-1", [IDS], Y, token="tok")  # would be OTHER_BLOCKS
    replaced = holder.ref._replace(probe=bytes(16))  # another process has the pid now
    assert holder.look(ref=replaced) is BoardLook.UNREADABLE
    gone = holder.ref._replace(pid=2**22 + 7)  # above Linux's pid_max: no such process
    assert holder.look(ref=gone) is BoardLook.UNREADABLE


def test_caller_mistakes_raise():
    holder = _Holder()
    with pytest.raises(ValueError, match="at least one block"):
        look_at_board(holder.ref, [(0, [], [])])
    with pytest.raises(ValueError, match="outside"):
        holder.look(ids=[3, 4, 16])
