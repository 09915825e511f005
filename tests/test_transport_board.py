"""One-sided same-host handoff reads (``kvbridge.transport.cma_board``): the holder publishes
its leased blocks on a block board, and a requester checks the board before and after its copy
instead of asking the holder; whenever a check does not pass it asks the holder after all.

The board and its checks are exercised in this process (a process may read itself with
``process_vm_readv``); the reads run between two ``UcxxTransport`` objects of this process whose
holder has the connector's real lease table and checks, so that a test can change the holder's
leases at a chosen point of the requester's copy.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import pytest_asyncio
import torch

pytest.importorskip("ucxx")

import kvbridge.transport.cma as cma
from _transport_helpers import make_kv_caches, make_metadata
from kvbridge.connector.holder import HeldBlockHashes, HolderChecks
from kvbridge.connector.lease import LeaseTable
from kvbridge.connector.stats import KVTransferStats
from kvbridge.transport import (
    BlockBoard,
    GroupRead,
    LeaseRef,
    PeerAddress,
    TransferError,
    UcxxTransport,
    full_block_tag,
    lease_block_tag,
)
from kvbridge.transport.cma_board import BoardCheck

pytestmark = pytest.mark.timeout(60)
in_module_loop = pytest.mark.asyncio(loop_scope="module")

if not cma.available():
    pytest.skip("this system has no process_vm_readv", allow_module_level=True)

HASHES = [b"hash-of-block-0", b"hash-of-block-1"]


# ------------------------------------------------------------------------- the board itself


def _check(board: BlockBoard, blocks) -> BoardCheck:
    return BoardCheck(os.getpid(), board.address, board.num_blocks_by_group, blocks)


def test_a_set_moves_the_version_by_two_and_publishes_the_tag():
    board = BlockBoard([8, 4])
    tag = full_block_tag(b"h")
    board.set(1, 3, tag)
    assert board.tag(1, 3) == tag and board.tag(0, 3) is None
    board.set(1, 3, None)
    assert board.tag(1, 3) is None
    # two writes, each odd while writing and even after: 0 -> 2 -> 4
    assert int(board._words[board.entry_index(1, 3), 0]) == 4
    with pytest.raises(IndexError):
        board.entry_index(1, 4)
    with pytest.raises(ValueError, match="16 bytes"):
        board.set(0, 1, b"short")


def test_tags_are_sixteen_nonzero_bytes_in_separate_domains():
    assert len(full_block_tag(b"x")) == len(lease_block_tag("r", "t")) == 16
    # a lease's tag names the request and the token; a block hash that spells the same bytes
    # is another domain
    assert lease_block_tag("r", "t") != lease_block_tag("r", "u") != lease_block_tag("s", "t")
    assert full_block_tag(b"r\0t") != lease_block_tag("r", "t")


def test_the_check_passes_only_on_matching_stable_entries():
    board = BlockBoard([8])
    tags = [full_block_tag(b"a"), full_block_tag(b"b")]
    board.set(0, 2, tags[0])
    board.set(0, 5, tags[1])
    check = _check(board, [(0, [2, 5], tags)])
    assert check.before_copy() and check.after_copy()

    # another hash expected at one position: no pass
    assert not _check(board, [(0, [2, 5], [tags[0], full_block_tag(b"c")])]).before_copy()
    # a block nothing holds: no pass
    assert not _check(board, [(0, [2, 6], [tags[0], tags[1]])]).before_copy()
    # an entry the holder is rewriting (odd version): no pass, even with the right tag
    board._words[board.entry_index(0, 5), 0] += 1
    assert not _check(board, [(0, [2, 5], tags)]).before_copy()


def test_an_entry_rewritten_between_the_checks_fails_the_second_even_with_the_same_tag():
    """The block was released and held again (same hash) during the copy: its bytes may have
    been rewritten in between, so the version, not the tag, decides."""
    board = BlockBoard([8])
    tag = full_block_tag(b"a")
    board.set(0, 2, tag)
    check = _check(board, [(0, [2], [tag])])
    assert check.before_copy()
    board.set(0, 2, None)
    board.set(0, 2, tag)
    assert not check.after_copy()


def test_many_entries_are_read_in_calls_of_at_most_iov_max(monkeypatch):
    monkeypatch.setattr("kvbridge.transport.cma_board.IOV_MAX", 3)
    board = BlockBoard([20])
    ids = list(range(1, 11))
    tags = [full_block_tag(bytes([i])) for i in ids]
    for block_id, tag in zip(ids, tags, strict=True):
        board.set(0, block_id, tag)
    check = _check(board, [(0, ids, tags)])
    assert check.before_copy()
    board.set(0, 10, tags[-1])  # the last entry, read by the fourth call, moves
    assert not check.after_copy()


def test_a_check_refuses_ids_outside_the_board_and_a_tag_count_that_does_not_fit():
    board = BlockBoard([8])
    with pytest.raises(ValueError, match="outside the holder's board"):
        _check(board, [(0, [8], [full_block_tag(b"a")])])
    with pytest.raises(ValueError, match="1 tags for 2 blocks"):
        _check(board, [(0, [1, 2], [full_block_tag(b"a")])])


def test_a_gone_holder_fails_the_check_with_esrch():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    check = BoardCheck(proc.pid, 1 << 20, [8], [(0, [1], [full_block_tag(b"a")])])
    with pytest.raises(cma.CmaReadError) as info:
        check.before_copy()
    assert info.value.errno_name == "ESRCH"


# --------------------------------------------------------------- the lease table publishes it


def _leases_with_board(num_blocks=16, groups=1) -> tuple[LeaseTable, BlockBoard]:
    leases = LeaseTable(lease_s=30.0)
    board = BlockBoard([num_blocks] * groups)
    leases.attach_board(board)
    return leases, board


def test_a_grant_publishes_full_blocks_by_hash_and_the_partial_block_by_lease():
    leases, board = _leases_with_board(groups=2)
    # group 1 is a sliding window: its position 0 is the null block, never published
    leases.grant("p-1", [[3, 4, 5], [0, 7, 8]], HASHES, token="tok")
    assert board.tag(0, 3) == full_block_tag(HASHES[0])
    assert board.tag(0, 4) == full_block_tag(HASHES[1])
    assert board.tag(0, 5) == lease_block_tag("p-1", "tok")  # position 2: no hash
    assert board.tag(1, 7) == full_block_tag(HASHES[1]) and board.tag(1, 0) is None
    assert board.tag(1, 8) == lease_block_tag("p-1", "tok")


def test_a_released_lease_is_off_the_board_before_its_blocks_are_handed_back():
    leases, board = _leases_with_board()
    leases.grant("p-1", [[3, 4]], HASHES[:1], token="tok")
    assert leases.release("p-1", "tok")
    assert board.tag(0, 3) is None and board.tag(0, 4) is None
    assert leases.pop_finished() == ({"p-1"}, 0)


def test_an_expired_lease_leaves_the_board_when_it_is_popped():
    now = [0.0]
    leases = LeaseTable(lease_s=1.0, clock=lambda: now[0])
    board = BlockBoard([16])
    leases.attach_board(board)
    leases.grant("p-1", [[3]], HASHES[:1])
    now[0] = 5.0
    # expired but not yet handed back: its block is still held, so still readable
    assert board.tag(0, 3) == full_block_tag(HASHES[0])
    assert leases.pop_finished() == ({"p-1"}, 1)
    assert board.tag(0, 3) is None


def test_a_block_two_leases_share_stays_on_the_board_until_both_end():
    leases, board = _leases_with_board()
    leases.grant("p-1", [[3, 4]], HASHES, token="a")
    leases.grant("p-2", [[3, 9]], HASHES[:1], token="b")  # shares block 3 (same first block)
    entry = board.entry_index(0, 3)
    version = int(board._words[entry, 0])
    leases.release("p-1", "a")
    # still held by p-2 with the same tag: not rewritten (a reader's copy stays valid)
    assert board.tag(0, 3) == full_block_tag(HASHES[0])
    assert int(board._words[entry, 0]) == version
    assert board.tag(0, 4) is None
    leases.release("p-2", "b")
    assert board.tag(0, 3) is None and board.tag(0, 9) is None


def test_a_pinned_lease_released_meanwhile_stays_on_the_board_until_its_last_unpin():
    leases, board = _leases_with_board()
    leases.grant("p-1", [[3]], HASHES[:1], token="tok")
    assert leases.pin("p-1", "tok", 10.0)
    assert leases.release("p-1", "tok")
    assert board.tag(0, 3) == full_block_tag(HASHES[0])  # the pin still holds the block
    leases.unpin("p-1")
    assert board.tag(0, 3) is None


def test_leases_that_disagree_on_a_block_clear_its_entry():
    """A block id held with two different tags (a corrupt grant): nobody reads it one-sided."""
    leases, board = _leases_with_board()
    leases.grant("p-1", [[3]], [b"one"])
    leases.grant("p-2", [[3]], [b"two"])
    assert board.tag(0, 3) is None
    leases.release("p-2")
    assert board.tag(0, 3) == full_block_tag(b"one")


def test_attach_board_after_a_grant_is_refused():
    leases = LeaseTable(lease_s=30.0)
    leases.grant("p-1", [[3]], HASHES[:1])
    with pytest.raises(RuntimeError, match="after leases were granted"):
        leases.attach_board(BlockBoard([16]))


# ------------------------------------------------------------ reads between two transports

HOLDER_SEED = 31


class _Holder:
    """A holder transport with the connector's lease table and checks."""

    def __init__(self, transport: UcxxTransport):
        self.transport = transport
        self.leases = LeaseTable(lease_s=30.0)
        self.leases.attach_board(transport.block_board)
        caches = transport.kv_caches_by_group
        self.checks = HolderChecks(
            leases=self.leases,
            hashes=HeldBlockHashes(),
            stats=KVTransferStats(),
            num_blocks=caches[0][0].shape[0],
            bytes_per_block=[sum(t[0].nbytes for t in group) for group in caches],
        )
        transport.set_callbacks(**self.checks.as_kwargs())


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair():
    holder_caches = make_kv_caches(seed=HOLDER_SEED)
    holder = UcxxTransport(make_metadata("board-holder", holder_caches), holder_caches, cma=True)
    requester_caches = make_kv_caches(seed=0)
    requester = UcxxTransport(
        make_metadata("board-requester", requester_caches), requester_caches, cma=True
    )
    await holder.start()
    await requester.start()
    yield _Holder(holder), requester
    await requester.close()
    await holder.close()


def _handoff(local_ids: list[int], hashes=HASHES) -> list[GroupRead]:
    """Group 0 of the holder's lease (blocks 3, 4, 5; block 5 is partial)."""
    return [
        GroupRead(
            group_id=0,
            remote_block_ids=[3, 4, 5],
            local_block_ids=local_ids,
            expected_hashes=[*hashes, b""],
        )
    ]


_lease_ids = itertools.count()


def _fresh_lease(holder: _Holder) -> LeaseRef:
    """End every lease of the holder and grant a new one on blocks 3, 4, 5 (a new name each
    time: a release of a name not held is remembered, and would end a later grant of it)."""
    for request_id in list(holder.leases._leases):
        holder.leases.release(request_id, "tok")
    holder.leases.pop_finished()
    lease = LeaseRef(request_id=f"p-{next(_lease_ids)}", token="tok")
    holder.leases.grant(lease.request_id, [[3, 4, 5]], HASHES, token="tok")
    return lease


def _zero(requester: UcxxTransport, ids: list[int]) -> None:
    for layer in requester.kv_caches_by_group[0]:
        layer[ids] = 0


def _assert_rows_equal(requester: UcxxTransport, holder: UcxxTransport, pairs) -> None:
    for mine, theirs in zip(requester.kv_caches_by_group[0], holder.kv_caches_by_group[0],
                            strict=True):
        for local_id, remote_id in pairs:
            assert torch.equal(mine[local_id], theirs[remote_id])


def _counts(requester: UcxxTransport) -> tuple[int, int]:
    return requester.board_counts.one_sided, requester.board_counts.fallbacks


@in_module_loop
async def test_a_handoff_read_lands_on_the_board_alone(pair):
    holder, requester = pair
    lease = _fresh_lease(holder)
    await requester.connect(holder.transport.address)
    assert requester.peer_data_path(holder.transport.address) == "cma"
    before = _counts(requester)
    serves_before = holder.transport.num_active_serves
    _zero(requester, [10, 11, 12])
    result = await requester.read_blocks(
        holder.transport.address, "d-1", _handoff([10, 11, 12]), deadline_s=20, lease=lease
    )
    assert (result.num_blocks_landed, result.failed_local_block_ids) == (3, ())
    _assert_rows_equal(requester, holder.transport, [(10, 3), (11, 4), (12, 5)])
    one_sided, fallbacks = _counts(requester)
    assert (one_sided - before[0], fallbacks - before[1]) == (1, 0)
    assert holder.transport.num_active_serves == serves_before == 0


@in_module_loop
@pytest.mark.parametrize(
    "case",
    ["another prompt's hashes", "another token", "a lease that ended", "no lease granted yet"],
)
async def test_a_read_the_board_does_not_vouch_for_asks_the_holder(pair, case):
    """The holder's own checks then decide, and name what is wrong; only a lease it may yet
    be handed makes the refusal worth asking again (``ReadResult.lease_pending``: the
    requester fails another prompt's ticket or a stale one at once)."""
    holder, requester = pair
    lease = _fresh_lease(holder)
    hashes = HASHES
    if case == "another prompt's hashes":
        hashes = [HASHES[0], b"another prompt"]
    elif case == "another token":
        lease = LeaseRef(request_id=lease.request_id, token="guess")
    elif case == "a lease that ended":
        holder.leases.release(lease.request_id, "tok")
        holder.leases.pop_finished()
    else:
        lease = LeaseRef(request_id=f"p-{next(_lease_ids)}", token="tok")
    before = _counts(requester)
    result = await requester.read_blocks(
        holder.transport.address, "d-2", _handoff([13, 14, 15], hashes), deadline_s=20,
        lease=lease,
    )
    assert _counts(requester) == (before[0], before[1] + 1)
    # a copy-first read the holder refuses fails as a whole (its lease vouches for nothing)
    expected_failed = {
        "another prompt's hashes": (14,),
        "another token": (13, 14, 15),
        "a lease that ended": (13, 14, 15),
        "no lease granted yet": (13, 14, 15),
    }[case]
    assert result.failed_local_block_ids == expected_failed
    # a read without the lease's token learns nothing of the lease: it reads as not granted
    assert result.lease_pending == (case in ("another token", "no lease granted yet"))


@in_module_loop
async def test_a_lease_that_ends_during_the_copy_is_caught_by_the_second_check(pair):
    """The release lands between the copy's calls: the board moved, so the requester asks the
    holder, which no longer holds the lease, and nothing counts as landed."""
    holder, requester = pair
    lease = _fresh_lease(holder)
    calls = []

    def release_during_the_copy() -> None:
        calls.append(1)
        holder.leases.release(lease.request_id, "tok")

    requester._cma_on_batch = release_during_the_copy
    before = _counts(requester)
    try:
        result = await requester.read_blocks(
            holder.transport.address, "d-3", _handoff([16, 17, 18]), deadline_s=20, lease=lease
        )
    finally:
        requester._cma_on_batch = None
    assert calls, "the copy ran"
    assert _counts(requester) == (before[0], before[1] + 1)
    assert result.num_blocks_landed == 0
    assert result.failed_local_block_ids == (16, 17, 18)


@in_module_loop
async def test_a_holder_without_a_board_is_asked_every_time(pair):
    _, requester = pair
    caches = make_kv_caches(seed=HOLDER_SEED)
    plain = UcxxTransport(make_metadata("no-board", caches), caches, cma=True, cma_board=False)
    assert plain.block_board is None
    await plain.start()
    try:
        holder = _Holder(plain)
        lease = LeaseRef(request_id="p-plain", token="tok")
        holder.leases.grant(lease.request_id, [[3, 4, 5]], HASHES, token="tok")
        before = _counts(requester)
        result = await requester.read_blocks(
            plain.address, "d-4", _handoff([19, 20, 21]), deadline_s=20, lease=lease
        )
        assert (result.num_blocks_landed, result.failed_local_block_ids) == (3, ())
        assert _counts(requester) == before  # never tried: nothing offered
    finally:
        await plain.close()


# ------------------------------------------------- read_one_sided: on the caller's thread


def _incarnation(holder: _Holder) -> str:
    return holder.transport.metadata.incarnation


@in_module_loop
async def test_read_one_sided_lands_on_the_calling_thread_without_a_message(pair):
    """No event loop turn between the call and its result: the copy ran here, and the holder
    saw no read."""
    holder, requester = pair
    lease = _fresh_lease(holder)
    await requester.connect(holder.transport.address)
    before = _counts(requester)
    _zero(requester, [22, 23, 24])
    result = requester.read_one_sided(
        holder.transport.address, "d-5", _handoff([22, 23, 24]), lease=lease,
        incarnation=_incarnation(holder),
    )
    assert result is not None
    assert (result.num_blocks_landed, result.failed_local_block_ids) == (3, ())
    assert result.num_bytes_landed == 3 * sum(
        t[0].nbytes for t in holder.transport.kv_caches_by_group[0]
    )
    _assert_rows_equal(requester, holder.transport, [(22, 3), (23, 4), (24, 5)])
    assert _counts(requester) == (before[0] + 1, before[1])


@in_module_loop
@pytest.mark.parametrize(
    "case",
    ["unknown holder", "another incarnation", "another prompt's hashes", "no lease granted",
     "too large to copy here", "remote id outside the holder"],
)
async def test_read_one_sided_declines_what_it_cannot_vouch_for(pair, monkeypatch, case):
    """None and nothing counted: the caller reads through ``read_blocks``, which says what is
    wrong."""
    holder, requester = pair
    lease = _fresh_lease(holder)
    await requester.connect(holder.transport.address)
    address, incarnation = holder.transport.address, _incarnation(holder)
    groups = _handoff([25, 26, 27])
    if case == "unknown holder":
        address = ("127.0.0.1", 1)
    elif case == "another incarnation":
        incarnation = "not-" + incarnation
    elif case == "another prompt's hashes":
        groups = _handoff([25, 26, 27], [HASHES[0], b"another prompt"])
    elif case == "no lease granted":
        holder.leases.release(lease.request_id, "tok")
        holder.leases.pop_finished()
    elif case == "too large to copy here":
        monkeypatch.setattr("kvbridge.transport.ucxx_transport.INLINE_COPY_MAX_BYTES", 1)
    else:
        groups = [GroupRead(group_id=0, remote_block_ids=[3, 4, 1 << 20],
                            local_block_ids=[25, 26, 27], expected_hashes=[*HASHES, b""])]
    before = _counts(requester)
    result = requester.read_one_sided(
        address, "d-6", groups, lease=lease, incarnation=incarnation
    )
    assert result is None
    assert _counts(requester) == before


def test_a_tag_that_moved_under_an_unchanged_version_fails_the_second_check():
    """What a first read torn between two writes could look like: the second check compares
    the tags again, not only the versions."""
    board = BlockBoard([8])
    tag = full_block_tag(b"a")
    board.set(0, 2, tag)
    check = _check(board, [(0, [2], [tag])])
    assert check.before_copy()
    board._words[board.entry_index(0, 2), 1:3] = 0  # cleared, version left as it was
    assert not check.after_copy()


@in_module_loop
async def test_ids_beyond_the_holders_blocks_are_never_copied_before_its_check(pair):
    """A ticket's block ids are network input: a read naming a block the holder does not have
    is not copied first (no read of the holder's memory past its KV tensors); the holder
    refuses it, and the holder stays readable by the same-host path."""
    holder, requester = pair
    lease = _fresh_lease(holder)
    address = holder.transport.address
    await requester.connect(address)
    beyond = holder.transport.metadata.groups[0].num_blocks + 1000
    groups = [GroupRead(group_id=0, remote_block_ids=[3, beyond], local_block_ids=[28, 29],
                        expected_hashes=[HASHES[0], HASHES[1]])]
    before = _counts(requester)
    with pytest.raises(TransferError, match="holder refused the read"):
        await requester.read_blocks(address, "d-7", groups, deadline_s=20, lease=lease)
    assert _counts(requester) == before  # not tried on the board either
    assert not requester._cma_failed
    assert requester.peer_data_path(address) == "cma"


@in_module_loop
async def test_a_failed_one_sided_copy_drops_the_connection_and_marks_the_holder(
    pair, monkeypatch
):
    """Memory the kernel will not copy (not a holder that is gone): the read fails naming its
    blocks, the connection is dropped, and the next connection to that holder goes over UCX."""
    holder, requester = pair
    lease = _fresh_lease(holder)
    address = holder.transport.address
    await requester.connect(address)

    async def refuse(self, plan, on_batch=None):
        raise cma.CmaReadError("process_vm_readv failed: EFAULT", "EFAULT")

    monkeypatch.setattr(cma.CmaPeer, "copy", refuse)
    with pytest.raises(TransferError, match="same-host copy"):
        await requester.read_blocks(address, "d-8", _handoff([30, 31, 32]), deadline_s=20,
                                    lease=lease)
    assert requester.peer_data_path(address) is None  # dropped
    monkeypatch.undo()
    try:
        await requester.connect(address)
        assert requester.peer_data_path(address) == "ucx"
    finally:
        requester._cma_failed.clear()  # later tests of this module read the same holder
        await requester._drop_connection(requester._conns[PeerAddress(*address)])
