"""Tickets as capabilities (issue 15, "Security"): a pull ticket carries an unguessable token,
and a heartbeat, a release notice or a read of a block only the lease guards must present it.

Before this, any peer that could reach P's transport could extend or end a lease by request id
alone. Now a wrong or missing token is refused, counted (``num_refused_lease_tokens``) and leaves
the lease exactly as it was; the real puller, holding the ticket, is served as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time

import torch
from _engine_builders import reference_greedy
from _pd_builders import assert_pair_empty, decode, long_prompt, make_pd_pair, prefill
from kvbridge.connector.holder import HeldBlockHashes, HolderChecks
from kvbridge.connector.lease import LeaseTable
from kvbridge.connector.metadata import BlockHashDelta
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.transfer_params import RemotePrefillParams
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.transport import (
    GroupRead,
    LeaseRef,
    LoopbackTransport,
    ReadResult,
    TransferDoneNotice,
)

TOKEN = "tok-right-0123456789ab"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _table() -> tuple[LeaseTable, _Clock]:
    clock = _Clock()
    leases = LeaseTable(10.0, clock=clock)
    leases.grant("r1", [[3, 4]], [b"h3"], TOKEN)
    return leases, clock


# ----------------------------------------------------------------------------- the lease table


def test_heartbeat_extends_only_with_the_right_token():
    leases, clock = _table()
    clock.now += 8
    assert leases.extend(["r1"]) == 0  # no token presented
    assert leases.extend(["r1"], ["tok-wrong"]) == 0
    clock.now += 3  # past the granted expiry (1000 + 10): the refused heartbeats changed nothing
    assert not leases.is_held("r1")

    leases, clock = _table()
    clock.now += 8
    assert leases.extend(["r1"], [TOKEN]) == 1
    clock.now += 3
    assert leases.is_held("r1")  # extended to 1008 + 10


def test_release_with_a_wrong_token_leaves_the_lease_untouched():
    leases, _ = _table()
    assert leases.release("r1") is False
    assert leases.release("r1", "tok-wrong") is False
    assert leases.is_held("r1") and leases.block_ids("r1") == ((3, 4),)
    assert leases.pop_finished() == (set(), 0)  # nothing handed back to the scheduler
    assert leases.release("r1", TOKEN) is True
    assert leases.pop_finished() == ({"r1"}, 0)


def test_an_early_release_ends_a_later_grant_only_with_its_token():
    leases = LeaseTable(10.0)
    leases.release("early-forged", "tok-wrong")  # a stranger, before P granted the lease
    leases.grant("early-forged", [[5]], [], TOKEN)
    assert leases.is_held("early-forged")
    leases.release("early-real", TOKEN)  # the real puller's notice overtook the grant
    leases.grant("early-real", [[6]], [], TOKEN)
    assert not leases.is_held("early-real")
    assert leases.pop_finished()[0] == {"early-real"}


def test_the_unhashed_block_is_served_only_under_the_tickets_token():
    leases, _ = _table()
    assert leases.covers("r1", 0, 4, None, TOKEN)  # position 1 has no hash: lease only
    assert not leases.covers("r1", 0, 4, None, "tok-wrong")
    assert not leases.covers("r1", 0, 4, None)


def test_a_pinned_lease_outlives_its_expiry_and_its_release_until_the_last_unpin():
    """A copy-first read pins its lease (``LeaseTable.pin``): the lease then neither expires
    nor ends by a release before its last unpin, so its blocks cannot be freed under a copy."""
    leases, clock = _table()  # r1 expires at 1010
    assert not leases.pin("r1", "tok-wrong", 30.0)  # a stranger pins nothing
    assert leases.pin("r1", TOKEN, 30.0) and leases.pin("r1", TOKEN, 5.0)  # two reads
    clock.now += 20  # past the granted expiry, inside the first pin (1030)
    assert leases.pop_finished() == (set(), 0)  # the pin keeps the blocks...
    assert not leases.is_held("r1") and not leases.pin("r1", TOKEN, 5.0)  # ...for no new read
    assert leases.release("r1", TOKEN)  # D's notice while a read still copies: deferred
    assert not leases.is_held("r1") and not leases.covers("r1", 0, 4, None, TOKEN)
    assert not leases.pin("r1", TOKEN, 5.0)  # released: no new read may pin it
    assert leases.pop_finished() == (set(), 0)  # the blocks stay held
    leases.unpin("r1")
    assert leases.pop_finished() == (set(), 0)  # one read is still copying
    leases.unpin("r1")
    assert leases.pop_finished() == ({"r1"}, 0)  # the last unpin ended it, once
    leases.unpin("r1")  # a late unpin of an ended lease changes nothing
    assert leases.pop_finished() == (set(), 0)

    leases, clock = _table()
    assert leases.pin("r1", TOKEN, 30.0)
    clock.now += 31  # the pin's own end: a reader that never unpins cannot hold it forever
    assert leases.pop_finished() == ({"r1"}, 1)

    leases, clock = _table()
    assert leases.pin("r1", TOKEN, 86_400.0)  # a read with a day-long deadline...
    leases.unpin("r1")  # ...that copied at once
    clock.now += 11  # past lease_s without a heartbeat: a pin never moved the lease's expiry
    assert leases.pop_finished() == ({"r1"}, 1)


def test_an_idle_holder_wakes_at_a_release_not_at_its_timeout():
    """An idle holder's step waits in ``wait_for_release`` (``idle_hold_wait_s``): a completion
    notice from the loop thread wakes it at once, so the freed blocks reach the scheduler in
    that step; a release deferred by a pin wakes it only at the last unpin."""
    leases, _ = _table()
    assert leases.wait_for_release(0.01) is False  # nothing ended: the wait runs out

    timer = threading.Timer(0.05, leases.release, ("r1", TOKEN))  # D's notice, another thread
    timer.start()
    started = time.monotonic()
    assert leases.wait_for_release(30.0) is True
    assert time.monotonic() - started < 15.0  # woken by the notice (0.05 s), not at 30 s
    timer.join()
    assert leases.pop_finished() == ({"r1"}, 0)
    assert leases.wait_for_release(0.0) is False  # handed over: nothing is waiting any more

    leases, _ = _table()
    assert leases.pin("r1", TOKEN, 30.0) and leases.release("r1", TOKEN)
    assert leases.wait_for_release(0.01) is False  # deferred: the blocks stay held
    timer = threading.Timer(0.05, leases.unpin, ("r1",))
    timer.start()
    assert leases.wait_for_release(30.0) is True
    timer.join()
    assert leases.pop_finished() == ({"r1"}, 0)


def test_leases_keep_time_on_the_monotonic_clock(monkeypatch):
    """A wall-clock step (NTP, a resume) must neither end a lease nor cut a pin short: the
    table's default clock is monotonic (the ticket's ``lease_expires_at`` is wall time, for
    the puller to read)."""
    leases = LeaseTable(10.0)
    leases.grant("r1", [[3]], [b"h3"], TOKEN)
    assert leases.pin("r1", TOKEN, 5.0)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)
    assert leases.is_held("r1") and leases.pop_finished() == (set(), 0)


# ----------------------------------------------------------------------------- the holder checks


def _checks() -> tuple[HolderChecks, LeaseTable, KVTransferStats]:
    leases, _ = _table()
    stats = KVTransferStats()
    checks = HolderChecks(
        leases=leases, hashes=HeldBlockHashes(), stats=stats, num_blocks=16, bytes_per_block=[64]
    )
    return checks, leases, stats


def test_holder_counts_and_refuses_forged_heartbeats_and_notices():
    checks, leases, stats = _checks()
    checks.on_heartbeat("stranger", ["r1", "unknown"], ["tok-wrong", "x"])
    checks.on_heartbeat("stranger", ["r1"], [])  # no tokens at all
    forged = TransferDoneNotice(peer_engine_id="s", request_id="r1", success=True, reason="")
    checks.on_transfer_done(forged)
    assert stats.num_refused_lease_tokens == 3  # r1 twice by heartbeat, once by notice
    assert leases.is_held("r1") and stats.num_released_leases == 0
    # Block 4 is r1's partial last block (no hash): the read's lease alone vouches for it.
    assert checks.validate_blocks(0, [4], [b""], LeaseRef(request_id="r1", token=TOKEN)) == []
    wrong = LeaseRef(request_id="r1", token="tok-wrong")
    assert checks.validate_blocks(0, [4], [b""], wrong) == [0]  # the wrong token's read refused
    assert checks.validate_blocks(0, [4], [b""], LeaseRef(request_id="r2", token=TOKEN)) == [0]
    # Without a lease only a hash vouches: block 3's passes, block 4 (no hash) is refused.
    assert checks.validate_blocks(0, [3, 4], [b"h3", b""], None) == [1]
    assert stats.num_refused_lease_tokens == 3  # a refused read counts nothing
    real = TransferDoneNotice(peer_engine_id="d", request_id="r1", success=True, reason="",
                              token=TOKEN)
    checks.on_transfer_done(real)
    assert not leases.is_held("r1") and stats.num_released_leases == 1
    assert stats.bytes_sent == 2 * 64


def test_a_copy_first_read_is_vouched_for_by_its_own_lease_alone():
    """``validate_by_lease`` (a read that copies before the check, ``Read.copy_first``): the
    prefix cache's word is not enough (the block may be reused and recomputed during the
    copy), nor is another lease's; only the read's own lease, with its token and the hash it
    holds the block at, vouches."""
    checks, leases, _ = _checks()
    checks.hashes.apply_stores(
        BlockHashDelta(stored_block_ids=[3, 7], stored_hashes=[
            make_block_hash_with_group_id(b"h3", 0), make_block_hash_with_group_id(b"h7", 0)
        ])
    )
    own = LeaseRef(request_id="r1", token=TOKEN)
    assert checks.validate_by_lease(0, [3, 4], [b"h3", b""], own) == []
    # block 7 is in the prefix cache, which validate_blocks accepts; no lease covers it
    assert checks.validate_blocks(0, [7], [b"h7"], None) == []
    assert checks.validate_by_lease(0, [7], [b"h7"], own) == [0]
    assert checks.validate_by_lease(0, [3], [b"h3"], None) == [0]
    assert checks.validate_by_lease(0, [3], [b"h3"], LeaseRef(request_id="r1", token="x")) == [0]
    assert checks.validate_by_lease(0, [3], [b"other"], own) == [0]  # another prompt's hash
    assert checks.validate_by_lease(0, [0, 16], [b"h3", b"h3"], own) == [0, 1]  # out of range
    leases.release("r1", TOKEN)  # the lease ended: nothing vouches any more
    assert checks.validate_by_lease(0, [3, 4], [b"h3", b""], own) == [0, 1]


# ----------------------------------------------------------------------------- P and D


def test_tickets_carry_fresh_unguessable_tokens_and_a_stranger_cannot_end_the_lease():
    pair = make_pd_pair(lease_s=30.0)
    try:
        prompt = long_prompt(50)
        params = prefill(pair, "req-a", prompt)
        other = prefill(pair, "req-b", long_prompt(40, salt="b"))
        token = params["remote_lease_token"]
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", token)  # 16 random bytes, URL-safe base64
        assert token != other["remote_lease_token"]
        parsed = RemotePrefillParams.parse(params, num_groups=1, block_size=16)
        assert parsed.remote_lease_token == token

        # (1) a stranger on the network, knowing the request ids but not the tokens
        d_transport = pair.d.runner.connector.worker_half.transport
        stranger = LoopbackTransport(
            dataclasses.replace(d_transport.metadata, engine_id="stranger"),
            d_transport.kv_caches_by_group,
            network=pair.network,
        )
        p_address = pair.p.runner.connector.worker_half.transport.address

        async def forge() -> None:
            await stranger.start()
            await stranger.send_heartbeat(p_address, ["req-a", "req-b"])
            for rid in ("req-a", "req-b"):
                await stranger.notify_transfer_done(p_address, rid, success=True, token="guess")

        p_worker = pair.p.runner.connector.worker_half
        held = list(p_worker.leases.block_ids("req-a")[0])
        local = list(range(1, len(held) + 1))
        d_rows = [t[local].clone() for t in d_transport.kv_caches_by_group[0]]

        async def read_unchecked() -> list[ReadResult]:
            # Reads of req-a's held blocks naming neither hash nor lease: no expected hashes at
            # all, and empty ones. Nothing vouches for the blocks, so none may be served.
            results = []
            for hashes in (None, [b""] * len(held)):
                group = GroupRead(
                    group_id=0, remote_block_ids=held, local_block_ids=local,
                    expected_hashes=hashes,
                )
                results.append(await stranger.read_blocks(p_address, "req-a", [group],
                                                          deadline_s=10.0))
            return results

        asyncio.run(forge())
        for result in asyncio.run(read_unchecked()):
            assert (result.num_blocks_landed, result.num_bytes_landed) == (0, 0)
            assert sorted(result.failed_local_block_ids) == local
        for before, t in zip(d_rows, d_transport.kv_caches_by_group[0], strict=True):
            assert torch.equal(t[local], before)  # the stranger wrote nothing into these rows
        assert p_worker.leases.is_held("req-a") and p_worker.leases.is_held("req-b")
        assert p_worker.stats.num_refused_lease_tokens == 4
        assert p_worker.stats.num_released_leases == 0

        # (2) D, holding the ticket, pulls and releases as before
        out = decode(pair, "d-a", prompt, params, max_tokens=3)
        assert out.finish_reason == "length"
        pair.d.step()
        assert pair.d.scheduler.connector.stats.snapshot()["num_loads"] == 1
        decode(pair, "d-b", long_prompt(40, salt="b"), other, max_tokens=2)
        assert_pair_empty(pair)
        assert p_worker.stats.num_released_leases == 2
        assert p_worker.stats.num_refused_lease_tokens == 4  # the real puller was never refused
    finally:
        pair.close()


def test_a_prefill_request_id_of_200_bytes_still_hands_over_its_partial_block(pair_factory):
    # The lease was once smuggled through the read's expected-hash field, whose wire bound is
    # 128 bytes: a P request id this long made P refuse D's whole read (D then recomputed).
    pair = pair_factory()
    p_request_id = "p-" + "x" * 198
    assert len(p_request_id.encode()) == 200
    prompt = long_prompt(40)  # 2 full blocks and a partial third, which only the lease guards

    # (1) P prefills under the long id; (2) D pulls every position, the partial one included.
    params = prefill(pair, p_request_id, prompt)
    assert params["remote_request_id"] == p_request_id
    output = decode(pair, "d-0", prompt, params, max_tokens=4)
    assert output.token_ids == reference_greedy(prompt, 4, hybrid=False)
    assert output.num_cached_tokens == 39  # all pulled; the last token is recomputed
    d_stats = pair.d.scheduler.connector.stats.snapshot()
    assert (d_stats["num_loads"], d_stats["num_failed_loads"]) == (1, 0)
    assert d_stats["num_blocks_received"] == 3

    # (3) D's notice released P's lease under the same long id; nothing leaks.
    assert_pair_empty(pair)
    assert pair.p.scheduler.connector.stats.snapshot()["num_released_leases"] == 1
