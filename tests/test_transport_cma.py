"""Same-host reads (``kvbridge.transport.cma``): the requester copies blocks out of the holder's
KV tensors with ``process_vm_readv``.

Plans and copies are checked in this process (a process may read itself the same way); reads
between processes use the holder of ``tests/_transport_helpers.py``, whose tensors the requester
rebuilds from the seed to compare bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch

pytest.importorskip("ucxx")

import kvbridge.transport.cma as cma
import kvbridge.transport.serve as serve
from _transport_helpers import NUM_BLOCKS, make_kv_caches, make_metadata
from kvbridge.transport import (
    GroupRead,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
    UcxxTransport,
)
from kvbridge.transport.control import read_frame
from kvbridge.transport.wire import (
    Cancel,
    CancelOk,
    ErrorMsg,
    GroupReadMsg,
    Heartbeat,
    Hello,
    Read,
    ReadCopied,
    ReadDone,
    ReadOk,
    TransferDoneNotice,
    decode_message,
    encode_message,
)
from test_transport_ucxx import (
    HolderProcess,
    _assert_landed,
    _random_read,
    assert_changed_hash_reported_not_sent,
    assert_lease_guards_the_block_without_a_hash,
)

pytestmark = pytest.mark.timeout(60)
in_module_loop = pytest.mark.asyncio(loop_scope="module")

if not cma.available():
    pytest.skip("this system has no process_vm_readv", allow_module_level=True)

SEED = 21
BIG_SEED = 23
BIG_BLOCK_SIZE = 256  # 16 KiB per block and layer: a read of all blocks is about 5 MiB


def _self_peer(caches: list[list[torch.Tensor]]) -> cma.CmaPeer:
    """A peer for ``caches`` of this very process (the kernel lets a process read itself)."""
    host = cma.CmaHost(caches)
    peer, why = cma.CmaPeer.accept(host.offer, make_metadata("self", caches), caches)
    assert peer is not None, why
    peer._host = host  # keeps the probe buffer alive
    return peer


# ----------------------------------------------------------------------------- plans, in-process


def test_plan_sorts_by_source_merges_runs_and_splits_long_ones(monkeypatch):
    caches = make_kv_caches(seed=1, layers_per_group=(2,), block_size=256)
    local = make_kv_caches(seed=0, layers_per_group=(2,), block_size=256)
    peer = _self_peer(caches)
    block_nbytes = caches[0][0][0].nbytes  # 16 KiB
    # remote 10..13 -> local 20..23 is one run; 40 -> 5 and 3 -> 60 stand alone
    entries = [(0, [40, 10, 11, 12, 13, 3], [5, 20, 21, 22, 23, 60])]
    plan = peer.plan(local, entries)
    assert len(plan.parts) == 1  # 2 layers x 6 blocks x 16 KiB = 192 KiB: one inline part
    local_iov, remote_iov = plan.parts[0]
    assert plan.nbytes == 2 * 6 * block_nbytes
    assert list(remote_iov[:, 0]) == sorted(remote_iov[:, 0])
    assert list(local_iov[:, 1]) == list(remote_iov[:, 1])
    assert sorted(remote_iov[:, 1] // block_nbytes) == [1, 1, 1, 1, 4, 4]  # per layer: 3, 40, run

    # a long run splits into MAX_SEGMENT_BYTES pieces, cut into parts of about equal bytes
    monkeypatch.setattr(cma, "MAX_SEGMENT_BYTES", 4 * block_nbytes)
    monkeypatch.setattr(cma, "INLINE_COPY_MAX_BYTES", 0)
    ids = list(range(1, 41))
    plan = peer.plan(local, [(0, ids, ids)])
    assert len(plan.parts) == cma.COPY_PARTS
    lengths = np.concatenate([part[0][:, 1] for part in plan.parts])
    assert set(lengths) == {4 * block_nbytes} and lengths.sum() == plan.nbytes == 80 * block_nbytes
    part_bytes = [int(part[0][:, 1].sum()) for part in plan.parts]
    assert max(part_bytes) - min(part_bytes) <= 4 * block_nbytes


@in_module_loop
async def test_copy_in_threads_lands_random_ids_exactly(monkeypatch):
    monkeypatch.setattr(cma, "IOV_MAX", 7)  # several calls per part
    monkeypatch.setattr(cma, "INLINE_COPY_MAX_BYTES", 1 << 20)  # 50 big blocks: threads
    source = make_kv_caches(seed=SEED, block_size=BIG_BLOCK_SIZE)
    local = make_kv_caches(seed=0, block_size=BIG_BLOCK_SIZE)
    peer = _self_peer(source)
    rng = random.Random(1)
    reads = _random_read(rng, num_blocks=50)
    plan = peer.plan(local, [(r.group_id, r.remote_block_ids, r.local_block_ids) for r in reads])
    assert plan.nbytes > cma.INLINE_COPY_MAX_BYTES and len(plan.parts) == cma.COPY_PARTS
    await peer.copy(plan)
    _assert_landed(local, source, reads)
    untouched = set(range(NUM_BLOCKS)) - set(reads[0].local_block_ids)
    assert not any(local[0][0][b].any() for b in untouched)


@in_module_loop
async def test_cancelled_copy_returns_only_after_its_threads_stopped(monkeypatch):
    monkeypatch.setattr(cma, "IOV_MAX", 1)
    monkeypatch.setattr(cma, "INLINE_COPY_MAX_BYTES", 0)
    source = make_kv_caches(seed=SEED)
    local = make_kv_caches(seed=0)
    peer = _self_peer(source)
    ids = list(range(1, NUM_BLOCKS))
    plan = peer.plan(local, [(0, ids, ids[::-1])])
    calls = []
    started = threading.Event()

    def slow_batch() -> None:
        calls.append(threading.get_ident())
        started.set()
        time.sleep(0.01)

    task = asyncio.ensure_future(peer.copy(plan, slow_batch))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen = len(calls)
    await asyncio.sleep(0.1)
    assert len(calls) == seen < 3 * (NUM_BLOCKS - 1)  # stopped early, and nothing ran after


@in_module_loop
async def test_a_gone_process_is_a_read_error_naming_esrch():
    source = make_kv_caches(seed=SEED)
    peer = _self_peer(source)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = cma.CmaPeer(msgspec.structs.replace(peer.offer, pid=int(gone.stdout)), peer.remote)
    with pytest.raises(cma.CmaReadError, match="ESRCH") as info:
        dead.read_probe()
    assert info.value.errno_name == "ESRCH"


def test_accept_refuses_offers_it_cannot_use():
    caches = make_kv_caches(seed=SEED)
    metadata = make_metadata("self", caches)
    host = cma.CmaHost(caches)
    offer = host.offer
    replace = msgspec.structs.replace
    cases = {
        "offers no same-host reads": None,
        "another host": replace(offer, host_id="another-boot"),
        "different bytes": replace(offer, probe=bytes(cma.PROBE_BYTES)),
        "regions": replace(offer, regions=[*offer.regions[:1], []]),
        # the kernel refuses the read (here EFAULT; EPERM under ptrace rules or seccomp)
        "probe read failed": replace(offer, probe_address=8),
    }
    for reason, bad in cases.items():
        peer, why = cma.CmaPeer.accept(bad, metadata, caches)
        assert peer is None and reason in why, (reason, why)
    peer, why = cma.CmaPeer.accept(offer, metadata, caches)
    assert peer is not None and why == ""


# ----------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def holder():
    process = HolderProcess("--seed", str(SEED))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def big_holder():
    process = HolderProcess("--seed", str(BIG_SEED), "--block-size", str(BIG_BLOCK_SIZE))
    yield process
    process.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def requester():
    caches = make_kv_caches(seed=0)
    transport = UcxxTransport(make_metadata("cma-requester", caches), caches)
    await transport.start()
    yield transport
    await transport.close()


def _assert_clean(transport: UcxxTransport) -> None:
    assert transport.num_inflight_reads == 0
    assert transport.staging.num_outstanding == 0


@in_module_loop
async def test_random_ids_two_groups_land_exactly_by_cma(holder, requester):
    reads = _random_read(random.Random(2), num_blocks=30)
    result = await requester.read_blocks(holder.address, "cma-1", reads, deadline_s=20)
    assert requester.peer_data_path(holder.address) == "cma"
    assert (result.num_blocks_landed, result.failed_local_block_ids) == (60, ())
    assert result.num_bytes_landed == 30 * 3 * 1024 + 30 * 2 * 1024
    _assert_landed(requester.kv_caches_by_group, make_kv_caches(seed=SEED), reads)
    _assert_clean(requester)


@in_module_loop
async def test_large_read_in_copy_threads_lands_exactly(big_holder):
    caches = make_kv_caches(seed=0, block_size=BIG_BLOCK_SIZE)
    transport = UcxxTransport(make_metadata("cma-big", caches), caches)
    await transport.start()
    try:
        reads = _random_read(random.Random(3), num_blocks=NUM_BLOCKS - 1)
        result = await transport.read_blocks(big_holder.address, "cma-big", reads, deadline_s=20)
        assert result.num_bytes_landed == (NUM_BLOCKS - 1) * 5 * 16384  # > inline: threads
        _assert_landed(caches, make_kv_caches(seed=BIG_SEED, block_size=BIG_BLOCK_SIZE), reads)
        _assert_clean(transport)
    finally:
        await transport.close()


@in_module_loop
async def test_the_reads_lease_guards_the_block_without_a_hash_by_cma(holder, requester):
    await assert_lease_guards_the_block_without_a_hash(holder.address, requester, SEED)
    assert requester.peer_data_path(holder.address) == "cma"


@in_module_loop
async def test_mismatched_hash_is_never_copied_and_bad_ids_are_refused(holder, requester):
    await assert_changed_hash_reported_not_sent(holder.address, requester, SEED)

    out_of_range = GroupRead(group_id=1, remote_block_ids=[3, NUM_BLOCKS], local_block_ids=[4, 5])
    with pytest.raises(TransferError, match=f"block id {NUM_BLOCKS} at position 1") as info:
        await requester.read_blocks(holder.address, "cma-bad", [out_of_range], deadline_s=20)
    assert info.value.local_block_ids == (4, 5)
    reads = _random_read(random.Random(4), num_blocks=5)  # the connection still serves
    result = await requester.read_blocks(holder.address, "cma-after", reads, deadline_s=20)
    assert result.num_blocks_landed == 10
    _assert_clean(requester)


@in_module_loop
async def test_holder_killed_mid_copy_fails_naming_every_block(monkeypatch):
    process = HolderProcess("--seed", str(SEED))
    caches = make_kv_caches(seed=0)
    transport = UcxxTransport(make_metadata("cma-kill", caches), caches)
    await transport.start()
    try:
        monkeypatch.setattr(cma, "IOV_MAX", 2)
        calls = []

        def kill_on_third_call() -> None:
            calls.append(1)
            if len(calls) == 3:
                process.proc.kill()
                process.proc.wait(10)

        transport._cma_on_batch = kill_on_third_call
        reads = _random_read(random.Random(5), num_blocks=20)
        with pytest.raises(TransferError) as info:
            await transport.read_blocks(process.address, "cma-kill", reads, deadline_s=20)
        assert not isinstance(info.value, TransferTimeoutError)
        assert "ESRCH" in str(info.value) or "probe" in str(info.value)
        assert sorted(info.value.local_block_ids) == sorted(
            b for r in reads for b in r.local_block_ids
        )
        _assert_clean(transport)
    finally:
        process.stop()
        await transport.close()


@in_module_loop
@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_cancel_or_deadline_mid_copy_stops_the_copy_first(holder, monkeypatch, how):
    monkeypatch.setattr(cma, "IOV_MAX", 1)
    monkeypatch.setattr(cma, "INLINE_COPY_MAX_BYTES", 0)  # copy threads, so the loop runs
    caches = make_kv_caches(seed=0)
    transport = UcxxTransport(make_metadata(f"cma-{how}", caches), caches)
    await transport.start()
    try:
        calls = []
        transport._cma_on_batch = lambda: (calls.append(1), time.sleep(0.01))
        reads = _random_read(random.Random(6), num_blocks=40)
        deadline = 0.3 if how == "deadline" else 20
        task = asyncio.ensure_future(
            transport.read_blocks(holder.address, f"cma-{how}", reads, deadline_s=deadline)
        )
        if how == "cancel":
            while not calls:
                await asyncio.sleep(0.01)
            assert await transport.cancel(f"cma-{how}") == 1
        expected = TransferCancelledError if how == "cancel" else TransferTimeoutError
        with pytest.raises(expected):
            await task
        seen = len(calls)
        await asyncio.sleep(0.1)
        assert len(calls) == seen < 5 * 40  # stopped mid-way; no copy runs after the error
        _assert_clean(transport)
        transport._cma_on_batch = None
        monkeypatch.setattr(cma, "IOV_MAX", 1024)
        result = await transport.read_blocks(holder.address, "again", reads, deadline_s=20)
        assert result.num_blocks_landed == 80
        _assert_landed(caches, make_kv_caches(seed=SEED), reads)
    finally:
        await transport.close()


@in_module_loop
async def test_without_cma_on_either_side_reads_go_over_ucx(holder, monkeypatch):
    caches = make_kv_caches(seed=0)
    monkeypatch.setenv("KVBRIDGE_CMA", "0")
    off_by_env = UcxxTransport(make_metadata("cma-env-off", caches), caches)
    monkeypatch.delenv("KVBRIDGE_CMA")
    source = make_kv_caches(seed=31)
    no_offer = UcxxTransport(make_metadata("holder-no-offer", source), source, cma=False)
    on = UcxxTransport(make_metadata("cma-on", make_kv_caches(seed=0)), make_kv_caches(seed=0))
    for transport in (off_by_env, no_offer, on):
        await transport.start()
    try:
        assert not off_by_env.cma_enabled and on.cma_enabled
        reads = _random_read(random.Random(7), num_blocks=6)
        await off_by_env.read_blocks(holder.address, "env-off", reads, deadline_s=20)
        assert off_by_env.peer_data_path(holder.address) == "ucx"
        _assert_landed(caches, make_kv_caches(seed=SEED), reads)
        await on.read_blocks(no_offer.address, "no-offer", reads, deadline_s=20)
        assert on.peer_data_path(no_offer.address) == "ucx"
        _assert_landed(on.kv_caches_by_group, source, reads)
    finally:
        for transport in (off_by_env, no_offer, on):
            await transport.close()


# ----------------------------------------------------------------------------- holder protocol


@contextlib.asynccontextmanager
async def _raw_peer(holder: UcxxTransport, requester_metadata):
    """A hand-driven requester connection to an in-process holder (after the handshake)."""
    import ucxx

    reader, writer = await asyncio.open_connection(*holder.address)
    hello = Hello(
        metadata=requester_metadata,
        compat_hash=requester_metadata.compat_hash,
        worker_address=ucxx.get_worker_address().tobytes(),
    )
    writer.write(encode_message(hello))
    decode_message(await read_frame(reader))

    async def ask(message):
        writer.write(encode_message(message))
        return decode_message(await asyncio.wait_for(read_frame(reader), 10))

    try:
        yield writer, ask
    finally:
        writer.close()


def _cma_read(transfer_id: int, hashes: bool, deadline_ms: int = 20_000) -> Read:
    ids = [3, 4]
    return Read(
        transfer_id=transfer_id,
        request_id=f"raw-{transfer_id}",
        tag_base=transfer_id << 20,
        chunk_bytes=1 << 14,
        deadline_ms=deadline_ms,
        groups=[
            GroupReadMsg(
                group_id=0,
                block_ids=ids,
                expected_hashes=[f"0:{b}".encode() for b in ids] if hashes else None,
            )
        ],
        cma=True,
    )


@in_module_loop
async def test_holder_answers_cma_messages_and_refuses_misuse(monkeypatch):
    from _transport_helpers import make_hash_validator

    monkeypatch.setattr(serve, "DEADLINE_GRACE_S", 0.05)
    caches = make_kv_caches(seed=SEED)
    holder = UcxxTransport(make_metadata("raw-holder", caches), caches)
    holder.set_callbacks(block_validator=make_hash_validator(set()))
    no_offer = UcxxTransport(make_metadata("raw-no-offer", caches), caches, cma=False)
    await holder.start()
    await no_offer.start()
    requester_metadata = make_metadata("raw", make_kv_caches(seed=0))
    try:
        async with _raw_peer(holder, requester_metadata) as (writer, ask):
            stray = await ask(ReadCopied(transfer_id=77))
            assert isinstance(stray, ErrorMsg) and stray.code == "bad_request"
            assert "not a same-host read" in stray.message
            # a read without hashes has no ReadCopied to wait for: one is refused, not ignored
            assert isinstance(await ask(_cma_read(9, hashes=False)), ReadOk)
            assert isinstance(await ask(ReadCopied(transfer_id=9)), ErrorMsg)

            # with hashes: ReadOk, then ReadCopied -> ReadDone; a second ReadCopied is refused
            assert isinstance(await ask(_cma_read(1, hashes=True)), ReadOk)
            assert holder.num_active_serves == 1
            assert await ask(ReadCopied(transfer_id=1)) == ReadDone(transfer_id=1, mismatched=[[]])
            assert isinstance(await ask(ReadCopied(transfer_id=1)), ErrorMsg)
            # without hashes the holder has nothing more to say
            assert isinstance(await ask(_cma_read(2, hashes=False)), ReadOk)
            # a Cancel ends a serve waiting for ReadCopied at once
            assert isinstance(await ask(_cma_read(3, hashes=True)), ReadOk)
            assert await ask(Cancel(transfer_id=3, num_chunks_posted=0)) == CancelOk(
                transfer_id=3, num_chunks_issued=0
            )
            # a requester that never reports: the serve ends after deadline + grace
            assert isinstance(await ask(_cma_read(4, hashes=True, deadline_ms=50)), ReadOk)
            for _ in range(100):
                if holder.num_active_serves == 0:
                    break
                await asyncio.sleep(0.01)
            assert holder.num_active_serves == 0
            writer.write(encode_message(Heartbeat(request_ids=["raw-1"])))  # still serving
            assert isinstance(await ask(_cma_read(5, hashes=False)), ReadOk)

        # a validator that raises fails that read with an error, and the holder keeps serving
        def broken(group_id, block_ids, hashes, lease):
            raise RuntimeError("validator bug")

        holder.set_callbacks(block_validator=make_hash_validator(set()), block_rechecker=broken)
        async with _raw_peer(holder, requester_metadata) as (_, ask):
            assert isinstance(await ask(_cma_read(1, hashes=True)), ReadOk)
            failed = await ask(ReadCopied(transfer_id=1))
            assert isinstance(failed, ErrorMsg) and failed.code == "holder_error"
            assert "validator bug" in failed.message
            assert isinstance(await ask(_cma_read(2, hashes=False)), ReadOk)
        assert holder.num_active_serves == 0
        async with _raw_peer(no_offer, requester_metadata) as (_, ask):
            refused = await ask(_cma_read(1, hashes=False))
            assert isinstance(refused, ErrorMsg) and "offered none" in refused.message
    finally:
        await holder.close()
        await no_offer.close()
    assert os.getpid() == holder._holder.cma_host.offer.pid


@in_module_loop
async def test_holder_delivers_a_transfer_done_only_from_the_peer_it_names():
    """The release notice is one type from wire to callback; a peer naming another engine
    cannot end that engine's lease."""
    caches = make_kv_caches(seed=SEED)
    holder = UcxxTransport(make_metadata("notice-holder", caches), caches)
    notices = []
    holder.set_callbacks(on_transfer_done=notices.append)
    await holder.start()
    requester_metadata = make_metadata("notice-peer", make_kv_caches(seed=0))
    try:
        async with _raw_peer(holder, requester_metadata) as (writer, ask):
            forged = TransferDoneNotice(
                peer_engine_id="someone-else", request_id="r", success=True, reason=""
            )
            refused = await ask(forged)
            assert isinstance(refused, ErrorMsg) and refused.code == "bad_message"
            assert "peer_engine_id 'someone-else'" in refused.message
            own = msgspec.structs.replace(forged, peer_engine_id="notice-peer")
            writer.write(encode_message(own))
            assert isinstance(await ask(_cma_read(1, hashes=False)), ReadOk)  # still serving
        assert notices == [own]
    finally:
        await holder.close()


# ----------------------------------------------------------------------------- review findings


@in_module_loop
async def test_calls_are_capped_by_bytes_as_well_as_by_ranges(monkeypatch):
    """Linux copies at most 2 GiB less a page per call and returns a short count beyond it, so
    a huge read is cut by bytes too (here scaled down: 3 blocks a call)."""
    source = make_kv_caches(seed=SEED, layers_per_group=(1,))
    local = make_kv_caches(seed=0, layers_per_group=(1,))
    peer = _self_peer(source)
    block_nbytes = source[0][0][0].nbytes
    monkeypatch.setattr(cma, "MAX_BYTES_PER_CALL", 3 * block_nbytes)
    remote = list(range(1, 21))
    local_ids = random.Random(9).sample(range(1, NUM_BLOCKS), 20)
    calls = []
    plan = peer.plan(local, [(0, remote, local_ids)])
    await peer.copy(plan, lambda: calls.append(1))
    assert len(calls) == 7  # 20 ranges of one block, 3 a call
    for r, b in zip(remote, local_ids, strict=True):
        assert torch.equal(local[0][0][b], source[0][0][r])


def test_the_offer_names_the_process_that_sends_it(monkeypatch):
    """A holder forked after its transport was built has the parent's probe at the same address:
    it must send its own pid, or requesters would copy the parent's tensors."""
    host = cma.CmaHost(make_kv_caches(seed=SEED))
    assert host.offer.pid == os.getpid()
    monkeypatch.setattr(cma.os, "getpid", lambda: 424242)
    assert host.offer.pid == 424242


@in_module_loop
@pytest.mark.parametrize("path", ["cma", "ucx"])
async def test_hash_checked_blocks_without_read_done_are_named_not_landed(monkeypatch, path):
    """The holder's ReadDone never comes (a lost message, a holder stuck): when the deadline ends
    the read, its hash-checked blocks were copied but never confirmed, so the error names them
    (the puller must not count them as loaded)."""
    from _transport_helpers import make_hash_validator

    real_write = serve.write_message  # the serves send every ReadDone

    async def drop_read_done(writer, message):
        if not isinstance(message, ReadDone):
            await real_write(writer, message)

    monkeypatch.setattr(serve, "write_message", drop_read_done)
    source = make_kv_caches(seed=SEED)
    holder = UcxxTransport(make_metadata(f"silent-{path}", source), source)
    holder.set_callbacks(block_validator=make_hash_validator(set()))
    caches = make_kv_caches(seed=0)
    requester = UcxxTransport(make_metadata(f"r-{path}", caches), caches, cma=path == "cma")
    await holder.start()
    await requester.start()
    try:
        ids = [3, 4, 5]
        reads = [
            GroupRead(
                group_id=0,
                remote_block_ids=ids,
                local_block_ids=[10, 11, 12],
                expected_hashes=[f"0:{b}".encode() for b in ids],
            ),
            GroupRead(group_id=1, remote_block_ids=[6], local_block_ids=[13]),  # no hashes
        ]
        with pytest.raises(TransferTimeoutError) as info:
            await requester.read_blocks(holder.address, "silent", reads, deadline_s=0.5)
        assert requester.peer_data_path(holder.address) == path
        assert info.value.local_block_ids == (10, 11, 12)  # group 1 landed and needs no check
        _assert_clean(requester)
    finally:
        await requester.close()
        await holder.close()


@in_module_loop
async def test_a_second_cancel_still_waits_for_the_copy_threads(holder, monkeypatch):
    monkeypatch.setattr(cma, "IOV_MAX", 1)
    monkeypatch.setattr(cma, "INLINE_COPY_MAX_BYTES", 0)
    caches = make_kv_caches(seed=0)
    transport = UcxxTransport(make_metadata("cma-twice", caches), caches)
    await transport.start()
    try:
        started = threading.Event()
        ended: list[float] = []  # when each copy call returned
        # each call stands for one long process_vm_readv
        transport._cma_on_batch = lambda: (
            started.set(),
            time.sleep(0.05),
            ended.append(time.monotonic()),
        )
        reads = _random_read(random.Random(10), num_blocks=40)
        task = asyncio.ensure_future(
            transport.read_blocks(holder.address, "twice", reads, deadline_s=20)
        )
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()  # a second cancel while the first is being handled (wait_for, shutdown)
        with pytest.raises(asyncio.CancelledError):
            await task
        raised_at = time.monotonic()
        await asyncio.sleep(0.2)
        assert not [t for t in ended if t > raised_at]  # no copy ran after read_blocks raised
        _assert_clean(transport)
    finally:
        await transport.close()


@in_module_loop
async def test_a_holder_whose_memory_cannot_be_read_is_read_over_ucx_next(holder, monkeypatch):
    caches = make_kv_caches(seed=0)
    transport = UcxxTransport(make_metadata("cma-efault", caches), caches)
    await transport.start()
    real_copy = cma.CmaPeer.copy

    async def refused(self, plan, on_batch=None):
        raise cma.CmaReadError("process_vm_readv of ranges 0..3 failed: EFAULT", "EFAULT")

    try:
        reads = _random_read(random.Random(11), num_blocks=4)
        monkeypatch.setattr(cma.CmaPeer, "copy", refused)
        with pytest.raises(TransferError, match="EFAULT") as info:
            await transport.read_blocks(holder.address, "efault", reads, deadline_s=20)
        assert len(info.value.local_block_ids) == 8
        monkeypatch.setattr(cma.CmaPeer, "copy", real_copy)
        result = await transport.read_blocks(holder.address, "after", reads, deadline_s=20)
        assert transport.peer_data_path(holder.address) == "ucx"
        assert result.num_blocks_landed == 8
        _assert_landed(caches, make_kv_caches(seed=SEED), reads)
    finally:
        await transport.close()


@in_module_loop
async def test_a_read_under_its_lease_copies_while_the_holder_checks(monkeypatch):
    """A same-host read under a handoff's lease, with hashes in every group, is copy-first
    (``Read.copy_first``): the requester copies before the holder's ``ReadOk`` (held back here
    until the requester's first copy call); the holder vouches for the blocks through the
    lease alone, pins the lease before ``ReadOk`` and unpins it at ``ReadCopied``, and sends
    no ``ReadDone``. A read without a lease still waits for ``ReadOk`` before it copies, and
    for the re-check's ``ReadDone`` after."""
    import kvbridge.transport.ucxx_holder as ucxx_holder
    from _transport_helpers import HELPER_LEASE, make_hash_validator

    copied = asyncio.Event()
    read_ok_sent: list[str] = []
    real_write = ucxx_holder.write_message
    real_serve_write = serve.write_message
    events: list[str] = []

    async def record_read_done(writer, message):
        events.append(type(message).__name__)
        await real_serve_write(writer, message)

    monkeypatch.setattr(serve, "write_message", record_read_done)

    async def read_ok_only_after_a_copy(writer, message):
        if isinstance(message, ReadOk):
            events.append("ReadOk")
            try:
                await asyncio.wait_for(copied.wait(), 1.0)
                read_ok_sent.append("after the copy began")
            except TimeoutError:
                read_ok_sent.append("with no copy begun")
        await real_write(writer, message)

    monkeypatch.setattr(ucxx_holder, "write_message", read_ok_only_after_a_copy)
    calls = {"hash": 0, "lease": 0}

    def counted(kind, validate):
        def wrapper(*args):
            calls[kind] += 1
            return validate(*args)

        return wrapper

    source = make_kv_caches(seed=SEED)
    holder = UcxxTransport(make_metadata("copy-first-holder", source), source)
    def pin(lease, seconds):
        events.append(f"pin {seconds:.1f} s")
        return lease == HELPER_LEASE

    holder.set_callbacks(
        block_validator=counted("hash", make_hash_validator(set())),
        lease_validator=counted("lease", make_hash_validator(set(), by_lease=True)),
        lease_pin=pin,
        lease_unpin=lambda lease: events.append("unpin"),
    )
    caches = make_kv_caches(seed=0)
    requester = UcxxTransport(make_metadata("copy-first-requester", caches), caches)
    requester._cma_on_batch = copied.set  # a small read copies inline, on this loop
    await holder.start()
    await requester.start()
    try:
        ids = [3, 4, 5, 6]
        reads = [
            GroupRead(
                group_id=0,
                remote_block_ids=ids,
                local_block_ids=[10, 11, 12, 13],
                expected_hashes=[f"0:{b}".encode() for b in ids],
            )
        ]
        result = await requester.read_blocks(
            holder.address, "copy-first", reads, deadline_s=20, lease=HELPER_LEASE
        )
        assert requester.peer_data_path(holder.address) == "cma"
        assert read_ok_sent == ["after the copy began"]
        assert (result.num_blocks_landed, result.failed_local_block_ids) == (4, ())
        _assert_landed(caches, source, reads)
        assert calls == {"hash": 0, "lease": 1}  # the check only: the pin replaces a re-check
        for _ in range(100):  # the serve unpins once the ReadCopied is in
            if "unpin" in events:
                break
            await asyncio.sleep(0.01)
        assert events == ["pin 22.0 s", "ReadOk", "unpin"]  # deadline 20 s + the grace

        copied.clear()
        events.clear()
        result = await requester.read_blocks(holder.address, "no-lease", reads, deadline_s=20)
        assert read_ok_sent[1:] == ["with no copy begun"]
        assert (result.num_blocks_landed, result.failed_local_block_ids) == (4, ())
        assert calls == {"hash": 2, "lease": 1}
        assert events == ["ReadOk", "ReadDone"]
        _assert_clean(requester)
    finally:
        await requester.close()
        await holder.close()


@in_module_loop
async def test_a_copy_first_read_that_ends_past_its_deadline_lands_nothing(holder, monkeypatch):
    """The holder pins a copy-first read's lease only until the read's deadline (plus a
    grace): a copy that ended later may have read blocks the holder reused meanwhile, so the
    read fails naming every block, whatever the holder answered."""
    import kvbridge.transport.cma_read as cma_read
    from _transport_helpers import HELPER_LEASE

    class _Clock:  # the requester's monotonic clock, which the copy moves past the deadline
        offset_s = 0.0

        def monotonic(self) -> float:
            return time.monotonic() + self.offset_s

    clock = _Clock()
    monkeypatch.setattr(cma_read, "time", clock)
    caches = make_kv_caches(seed=0)
    requester = UcxxTransport(make_metadata("copy-late", caches), caches)

    def late_copy() -> None:
        clock.offset_s = 3600.0

    requester._cma_on_batch = late_copy
    await requester.start()
    try:
        ids = [3, 4]
        reads = [
            GroupRead(
                group_id=0,
                remote_block_ids=ids,
                local_block_ids=[20, 21],
                expected_hashes=[f"0:{b}".encode() for b in ids],
            )
        ]
        with pytest.raises(TransferError, match="past the read's deadline") as info:
            await requester.read_blocks(
                holder.address, "late", reads, deadline_s=20, lease=HELPER_LEASE
            )
        assert info.value.local_block_ids == (20, 21)
        assert clock.offset_s == 3600.0  # the same-host copy ran (and its connection dropped)
        _assert_clean(requester)
    finally:
        await requester.close()


class _SinkWriter:
    """A control stream's writer that keeps nothing (the holder's replies go nowhere)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


@in_module_loop
async def test_a_copy_first_pin_outlives_a_dropped_connection_to_its_own_end(monkeypatch):
    """The requester's connection ends right behind its copy-first ``Read`` (in the same
    buffer: the holder pins, answers, starts the serve and drops the connection before that
    serve ever ran). The requester may still be copying, so the pin holds to its own end
    (the read's window plus the grace), then goes: no pin is leaked, none is cut short."""
    from kvbridge.connector.holder import HeldBlockHashes, HolderChecks
    from kvbridge.connector.lease import LeaseTable
    from kvbridge.connector.stats import KVTransferStats
    from kvbridge.transport.base import HolderCallbacks
    from kvbridge.transport.serve import RequesterConnection
    from kvbridge.transport.ucxx_holder import UcxxHolder
    from kvbridge.transport.wire import LeaseRef

    monkeypatch.setattr(serve, "DEADLINE_GRACE_S", 0.1)
    token = "tok-pin-0123456789abcdef"
    leases = LeaseTable(30.0)
    leases.grant("p-1", [[3, 4]], [b"h3"], token)
    checks = HolderChecks(leases=leases, hashes=HeldBlockHashes(), stats=KVTransferStats(),
                          num_blocks=NUM_BLOCKS, bytes_per_block=[1, 1])
    caches = make_kv_caches(seed=0)
    holder = UcxxHolder(make_metadata("pin-holder", caches), caches,
                        HolderCallbacks(**checks.as_kwargs()), window=4)
    holder.cma_host = object()  # offers same-host reads (the requester would copy)

    async def no_handshake(reader, writer):
        return RequesterConnection(peer_engine_id="d", endpoint=None, writer=writer)

    holder._handshake = no_handshake
    read = Read(transfer_id=1, request_id="d-1", tag_base=0, chunk_bytes=1 << 20,
                deadline_ms=200, cma=True, copy_first=True,
                lease=LeaseRef(request_id="p-1", token=token),
                groups=[GroupReadMsg(group_id=0, block_ids=[3, 4], expected_hashes=[b"h3", b""])])
    reader = asyncio.StreamReader()
    reader.feed_data(encode_message(read))
    reader.feed_eof()
    started = time.monotonic()
    await asyncio.wait_for(holder.handle_connection(reader, _SinkWriter()), 5)
    assert leases._leases["p-1"].num_pins == 1  # the requester may still be copying
    assert leases.release("p-1", token)  # its notice: deferred while pinned
    assert leases.pop_finished() == (set(), 0)
    while leases._leases.get("p-1") is not None and time.monotonic() - started < 5:
        await asyncio.sleep(0.02)
    assert time.monotonic() - started >= 0.3 - 0.05  # the 0.2 s window plus the 0.1 s grace
    assert leases.pop_finished() == ({"p-1"}, 0)  # the last unpin ended the released lease
