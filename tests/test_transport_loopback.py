"""LoopbackTransport: the same contract as UcxxTransport, in one process, with faults."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _transport_helpers import make_kv_caches, make_metadata
from kvbridge.transport import (
    GroupRead,
    HandshakeError,
    LeaseRef,
    LoopbackFaults,
    LoopbackNetwork,
    LoopbackTransport,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
    TransportError,
)

pytestmark = pytest.mark.timeout(20)


async def _pair(*, holder_seed: int = 7, chunk_bytes: int = 4096, **holder_cache_kwargs):
    network = LoopbackNetwork()
    holder_caches = make_kv_caches(seed=holder_seed, **holder_cache_kwargs)
    holder = LoopbackTransport(
        make_metadata("prefill", holder_caches), holder_caches, network=network
    )
    requester_caches = make_kv_caches(seed=0)
    requester = LoopbackTransport(
        make_metadata("decode", requester_caches),
        requester_caches,
        network=network,
        chunk_bytes=chunk_bytes,
    )
    await holder.start()
    await requester.start()
    return holder, requester


def _reads(remote: list[int], local: list[int], group_id: int = 0, hashes=None) -> list[GroupRead]:
    return [
        GroupRead(
            group_id=group_id,
            remote_block_ids=remote,
            local_block_ids=local,
            expected_hashes=hashes,
        )
    ]


def _assert_block_equal(requester, holder, group_id: int, local_id: int, remote_id: int) -> None:
    for dst, src in zip(
        requester.kv_caches_by_group[group_id], holder.kv_caches_by_group[group_id], strict=True
    ):
        assert torch.equal(dst[local_id].view(torch.int16), src[remote_id].view(torch.int16))


async def test_read_lands_both_groups_by_position():
    holder, requester = await _pair()
    reads = [
        GroupRead(group_id=0, remote_block_ids=[9, 3, 40], local_block_ids=[2, 50, 7]),
        GroupRead(group_id=1, remote_block_ids=[1], local_block_ids=[63]),  # edge ids
    ]
    result = await requester.read_blocks(holder.address, "r", reads, deadline_s=5)
    # 3 blocks * 3 layers + 1 block * 2 layers, 1 KiB each
    assert result == (result.request_id, 4, 11 * 1024, (), False)
    assert result.ok
    for local_id, remote_id in [(2, 9), (50, 3), (7, 40)]:
        _assert_block_equal(requester, holder, 0, local_id, remote_id)
    _assert_block_equal(requester, holder, 1, 63, 1)
    assert requester.num_inflight_reads == 0 and holder.serving_transfer_ids == set()


async def test_empty_read_returns_empty_result():
    holder, requester = await _pair()
    result = await requester.read_blocks(holder.address, "r", _reads([], []), deadline_s=5)
    assert (result.num_blocks_landed, result.failed_local_block_ids) == (0, ())


async def test_validator_and_fail_block_ids_report_failed_local_ids():
    holder, requester = await _pair()
    holder.set_callbacks(
        block_validator=lambda g, ids, hashes, _: [i for i, h in enumerate(hashes) if h != b"ok"]
    )
    holder.faults.fail_block_ids = {12}
    reads = _reads([10, 11, 12], [20, 21, 22], hashes=[b"ok", b"stale", b"ok"])
    result = await requester.read_blocks(holder.address, "r", reads, deadline_s=5)
    # 11 fails the hash check, 12 is failed by injection; 10 lands
    assert result.failed_local_block_ids == (21, 22)
    assert result.num_blocks_landed == 1
    assert not requester.kv_caches_by_group[0][0][21].any()


async def test_caller_mistakes_raise_value_error():
    holder, requester = await _pair()
    for reads, fragment in [
        (_reads([1, 2], [3]), "2 remote_block_ids, 1 local"),
        (_reads([1], [0]), "local block id 0 not in [1, 64)"),
        (_reads([1], [64]), "local block id 64"),
        (_reads([1, 2], [3, 3]), "repeats"),
        (_reads([1], [2], group_id=2), "group_id 2 not in [0, 2)"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace(")", r"\)")):
            await requester.read_blocks(holder.address, "r", reads, deadline_s=5)
    with pytest.raises(ValueError, match="deadline_s"):
        await requester.read_blocks(holder.address, "r", _reads([1], [2]), deadline_s=0)


async def test_out_of_range_remote_ids_fail_naming_all_local_ids():
    holder, requester = await _pair()
    with pytest.raises(TransferError, match="block id 64 at position 1") as info:
        await requester.read_blocks(holder.address, "r", _reads([5, 64], [1, 2]), deadline_s=5)
    assert info.value.local_block_ids == (1, 2)
    with pytest.raises(TransferError, match="block id 0"):  # the null block is never served
        await requester.read_blocks(holder.address, "r", _reads([0], [1]), deadline_s=5)


async def test_incompatible_peer_refused_naming_field():
    holder, requester = await _pair(block_size=32)
    with pytest.raises(HandshakeError, match="block_size: local 32, remote 16"):
        await requester.connect(holder.address)


async def test_stalled_holder_hits_deadline():
    holder, requester = await _pair()
    holder.faults.stall = True
    with pytest.raises(TransferTimeoutError) as info:
        await requester.read_blocks(holder.address, "r", _reads([1, 2], [3, 4]), deadline_s=0.05)
    assert info.value.local_block_ids == (3, 4)
    assert requester.num_inflight_reads == 0


async def test_dropped_holder_mid_transfer_names_blocks_not_landed():
    holder, requester = await _pair(
        chunk_bytes=4096
    )  # 4096 // (3 layers * 1 KiB): one block per chunk
    holder.faults.drop_after_chunks = 2
    with pytest.raises(TransferError, match="went away") as info:
        await requester.read_blocks(
            holder.address, "r", _reads([1, 2, 3, 4], [5, 6, 7, 8]), deadline_s=5
        )
    # the first two chunks (one block each) landed before the holder vanished
    assert info.value.local_block_ids == (7, 8)
    with pytest.raises(TransportError, match="unreachable"):
        await requester.send_heartbeat(holder.address, ["r"])


async def test_cancel_by_request_id_and_by_task():
    holder, requester = await _pair(chunk_bytes=4096)
    holder.faults.chunk_delay_s = 0.01
    task = asyncio.ensure_future(
        requester.read_blocks(holder.address, "r", _reads([1, 2, 3, 4], [5, 6, 7, 8]), deadline_s=5)
    )
    await asyncio.sleep(0.015)
    assert await requester.cancel("r") == 1
    with pytest.raises(TransferCancelledError):
        await task
    task = asyncio.ensure_future(
        requester.read_blocks(holder.address, "r2", _reads([1, 2], [5, 6]), deadline_s=5)
    )
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # both cancellations reached the holder, and nothing is left in flight on either side
    assert holder.num_cancels_received == 2
    assert holder.serving_transfer_ids == set() and requester.num_inflight_reads == 0
    assert await requester.cancel("unknown") == 0


async def test_heartbeat_and_transfer_done_reach_holder_callbacks():
    holder, requester = await _pair()
    heartbeats, notices = [], []
    holder.set_callbacks(
        on_heartbeat=lambda peer, ids, tokens: heartbeats.append((peer, ids)),
        on_transfer_done=notices.append,
    )
    await requester.send_heartbeat(holder.address, ["a", "b"])
    await requester.notify_transfer_done(holder.address, "a", success=False, reason="rejected")
    assert heartbeats == [("decode", ["a", "b"])]
    assert [(n.peer_engine_id, n.request_id, n.success, n.reason) for n in notices] == [
        ("decode", "a", False, "rejected")
    ]


async def test_two_requesters_read_concurrently():
    holder, first = await _pair()
    caches = make_kv_caches(seed=0)
    second = LoopbackTransport(make_metadata("decode-2", caches), caches, network=first.network)
    await second.start()
    results = await asyncio.gather(
        first.read_blocks(holder.address, "a", _reads([1, 2, 3], [4, 5, 6]), deadline_s=5),
        second.read_blocks(holder.address, "b", _reads([3, 2, 1], [4, 5, 6]), deadline_s=5),
    )
    assert [r.num_blocks_landed for r in results] == [3, 3]
    _assert_block_equal(first, holder, 0, 4, 1)
    _assert_block_equal(second, holder, 0, 4, 3)


async def test_construction_checks_metadata_against_tensors():
    caches = make_kv_caches(seed=0)
    other = make_metadata("x", make_kv_caches(seed=0, num_blocks=8))
    with pytest.raises(ValueError, match="group 0"):
        LoopbackTransport(other, caches, network=LoopbackNetwork())
    with pytest.raises(RuntimeError, match="before start"):
        _ = LoopbackTransport(make_metadata("x", caches), caches, network=LoopbackNetwork()).address
    assert LoopbackFaults().fail_block_ids == set()  # no faults unless asked


async def test_block_evicted_during_copy_is_failed_not_landed():
    holder, requester = await _pair(chunk_bytes=4096)  # 3 layers * 1 KiB: one block per chunk
    holder.faults.evict_during_copy_block_ids = {11}
    reads = _reads([10, 11, 12], [20, 21, 22], hashes=[b"h10", b"h11", b"h12"])
    result = await requester.read_blocks(holder.address, "r", reads, deadline_s=5)
    # 11 passed the first check, then its block was reused while its chunk was copied out
    assert result.failed_local_block_ids == (21,)
    assert (result.num_blocks_landed, result.num_bytes_landed) == (2, 2 * 3 * 1024)
    _assert_block_equal(requester, holder, 0, 20, 10)
    _assert_block_equal(requester, holder, 0, 22, 12)
    # Without expected hashes there is no check at all (a lease holds handoff blocks).
    result = await requester.read_blocks(holder.address, "r2", _reads([11], [23]), deadline_s=5)
    assert (result.failed_local_block_ids, result.num_blocks_landed) == ((), 1)


async def test_validator_reruns_after_each_chunk_copy():
    """A validator over the holder's block hashes, where block 40 of group 1 is evicted right
    after the first check sees it: the same re-check the UCX holder does catches it."""
    holder, requester = await _pair(chunk_bytes=4096)  # group 1: 2 layers, 2 blocks per chunk
    evicted: set[tuple[int, int]] = set()
    calls: list[tuple[int, list[int]]] = []

    def validate(group_id: int, block_ids: list[int], hashes: list[bytes], lease) -> list[int]:
        calls.append((group_id, list(block_ids)))
        bad = [
            i
            for i, (b, h) in enumerate(zip(block_ids, hashes, strict=True))
            if h != f"{group_id}:{b}".encode() or (group_id, b) in evicted
        ]
        if group_id == 1 and 40 in block_ids:
            evicted.add((1, 40))
        return bad

    holder.set_callbacks(block_validator=validate)
    hashes = [b"1:3", b"1:stale", b"1:40", b"1:5", b"1:6"]
    reads = _reads([3, 4, 40, 5, 6], [10, 11, 12, 13, 14], group_id=1, hashes=hashes)
    result = await requester.read_blocks(holder.address, "r", reads, deadline_s=5)
    # position 1 fails at the first check (never sent), position 2 at the re-check of its chunk
    assert result.failed_local_block_ids == (11, 12)
    assert result.num_blocks_landed == 3
    assert not any(layer[11].any() for layer in requester.kv_caches_by_group[1])
    for local_id, remote_id in [(10, 3), (13, 5), (14, 6)]:
        _assert_block_equal(requester, holder, 1, local_id, remote_id)
    # one check of the whole group, then one per chunk of the 4 blocks sent (2 per chunk)
    assert calls == [(1, [3, 4, 40, 5, 6]), (1, [3, 40]), (1, [5, 6])]


async def test_the_reads_lease_reaches_the_check_and_every_recheck():
    """A read under a lease names it in its own field (``Read.lease``); the holder's validator
    gets it, as it came over the wire, at the check and at each chunk's re-check."""
    holder, requester = await _pair(chunk_bytes=4096)  # one 3-layer block per chunk
    seen: list[tuple[str, LeaseRef | None]] = []

    def validate(group_id: int, block_ids: list[int], hashes: list[bytes], lease) -> list[int]:
        seen.append(("check", lease))
        return [i for i, h in enumerate(hashes) if not h and lease is None]

    def recheck(group_id: int, block_ids: list[int], hashes: list[bytes], lease) -> list[int]:
        seen.append(("recheck", lease))
        return []

    holder.set_callbacks(block_validator=validate, block_rechecker=recheck)
    lease = LeaseRef(request_id="p-" + "x" * 198, token="tok")  # longer than any hash
    reads = _reads([1, 2], [4, 5], hashes=[b"h1", b""])  # block 2 has no hash: the lease's
    result = await requester.read_blocks(holder.address, "r", reads, deadline_s=5, lease=lease)
    assert (result.num_blocks_landed, result.failed_local_block_ids) == (2, ())
    assert seen == [("check", lease), ("recheck", lease), ("recheck", lease)]

    seen.clear()  # the same read without the lease: block 2 is refused, never sent
    result = await requester.read_blocks(holder.address, "r", reads, deadline_s=5)
    assert (result.num_blocks_landed, result.failed_local_block_ids) == (1, (5,))
    assert seen == [("check", None), ("recheck", None)]


async def test_block_rechecker_serves_the_rechecks_when_registered():
    """A validator with once-per-read effects (a store counting hits) registers a separate
    side-effect-free rechecker: the validator then runs once per read, the rechecker per chunk."""
    holder, requester = await _pair(chunk_bytes=4096)  # one 3-layer block per chunk
    num_checked: list[int] = []
    rechecked: list[list[int]] = []

    def validate(group_id: int, block_ids: list[int], hashes: list[bytes], lease) -> list[int]:
        num_checked.append(len(block_ids))
        return []

    def recheck(group_id: int, block_ids: list[int], hashes: list[bytes], lease) -> list[int]:
        rechecked.append(list(block_ids))
        return [i for i, b in enumerate(block_ids) if b == 2]

    holder.set_callbacks(block_validator=validate, block_rechecker=recheck)
    reads = _reads([1, 2, 3], [4, 5, 6], hashes=[b"a", b"b", b"c"])
    result = await requester.read_blocks(holder.address, "r", reads, deadline_s=5)
    assert result.failed_local_block_ids == (5,)
    assert num_checked == [3]  # once, over the whole group
    assert rechecked == [[1], [2], [3]]  # once per chunk
