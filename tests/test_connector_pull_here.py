"""``Puller.submit`` lands a handoff on the worker thread when the transport can read it
one-sided (``Transport.read_one_sided``), and otherwise starts the pull on the connector loop;
either way the request is reported once by ``pop_settled`` and the holder gets its release
notice."""

from __future__ import annotations

import time

from kvbridge.connector.loop_thread import get_loop_thread
from kvbridge.connector.metadata import HolderRef, PullPlan, Ticket
from kvbridge.connector.puller import Puller
from kvbridge.connector.stats import KVTransferStats
from kvbridge.transport import GroupRead, ReadResult

BYTES_PER_BLOCK = 1024


class _FakeTransport:
    """Answers ``read_one_sided`` with ``one_sided`` (None: cannot) and ``read_blocks`` by
    landing every block; records what the puller asked of it."""

    def __init__(self, one_sided: bool):
        self.one_sided = one_sided
        self.calls: list[str] = []
        self.notices: list[tuple[str, bool, str]] = []

    def read_one_sided(self, peer, request_id, groups, *, lease, incarnation, heads=None):
        self.calls.append(f"one_sided:{incarnation}:{lease.request_id}")
        if not self.one_sided:
            return None
        num = sum(len(g.local_block_ids) for g in groups)
        return ReadResult(request_id, num, num * BYTES_PER_BLOCK, ())

    async def connect(self, peer):
        self.calls.append("connect")

        class _Meta:
            engine_id, incarnation = "p", "inc-1"

        return _Meta()

    async def read_blocks(self, peer, request_id, groups, *, deadline_s, lease=None, heads=None):
        self.calls.append("read_blocks")
        num = sum(len(g.local_block_ids) for g in groups)
        return ReadResult(request_id, num, num * BYTES_PER_BLOCK, ())

    def peer_data_path(self, peer):
        return "cma"

    async def notify_transfer_done(self, peer, request_id, *, success, reason, token,
                                   puller_rank=0, num_pullers=1):
        self.notices.append((request_id, success, token))

    async def send_heartbeat(self, peer, request_ids, tokens):
        self.calls.append("heartbeat")


def _plan(request_id: str, *, sync: bool = False) -> PullPlan:
    return PullPlan(
        request_id=request_id,
        holder=HolderRef(engine_id="p", incarnation="inc-1", host="127.0.0.1", port=9),
        lease=Ticket("127.0.0.1", 9, "p-" + request_id, "tok"),
        groups=[GroupRead(group_id=0, remote_block_ids=[3, 4], local_block_ids=[7, 8],
                          expected_hashes=[b"h0", b""])],
        unloadable_block_ids=[],
        num_external_tokens=40,
        created_at=time.monotonic(),
        sync=sync,
    )


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_one_sided_handoff_is_settled_when_submit_returns():
    stats = KVTransferStats()
    puller = Puller(load_timeout_s=5.0, heartbeat_interval_s=1.0, stats=stats)
    transport = _FakeTransport(one_sided=True)
    puller.submit(transport, _plan("d-1"))
    # settled before any loop turn: this step's get_finished reports it
    settled = puller.pop_settled()
    assert settled.request_ids == {"d-1"} and not settled.failed_block_ids
    assert puller.num_inflight == 0
    assert transport.calls == ["one_sided:inc-1:p-d-1"]  # never the loop's read
    snapshot = stats.snapshot()
    assert (snapshot["num_loads"], snapshot["num_blocks_received"]) == (1, 2)
    assert snapshot["bytes_received_same_host"] == 2 * BYTES_PER_BLOCK
    # The release notice waits until the end of the next step: the end of this one
    # (``get_finished`` -> ``send_deferred_notices``) still belongs to the step that computes
    # the request's first token, and waking the loop there takes the GIL from it.
    time.sleep(0.2)
    assert transport.notices == []
    puller.send_deferred_notices(transport)  # end of the step that read the handoff
    time.sleep(0.2)
    assert transport.notices == []
    puller.send_deferred_notices(transport)  # end of the next step
    _wait_for(lambda: transport.notices)
    assert transport.notices == [("p-d-1", True, "tok")]
    puller.send_deferred_notices(transport)  # sent once
    puller.send_deferred_notices(transport)
    time.sleep(0.2)
    assert transport.notices == [("p-d-1", True, "tok")]


def test_each_steps_notices_go_out_at_the_end_of_the_step_after_it():
    """Two handoffs read in consecutive steps: each notice leaves one step after its read."""
    puller = Puller(load_timeout_s=5.0, heartbeat_interval_s=1.0, stats=KVTransferStats())
    transport = _FakeTransport(one_sided=True)
    puller.submit(transport, _plan("d-1"))
    puller.send_deferred_notices(transport)  # step 1 ends: d-1 held
    puller.submit(transport, _plan("d-2"))
    puller.send_deferred_notices(transport)  # step 2 ends: d-1 sent, d-2 held
    _wait_for(lambda: transport.notices)
    time.sleep(0.1)
    assert transport.notices == [("p-d-1", True, "tok")]
    puller.send_deferred_notices(transport)  # step 3 ends: d-2 sent
    _wait_for(lambda: len(transport.notices) == 2)
    assert transport.notices[1] == ("p-d-2", True, "tok")


def test_a_heartbeat_tick_sends_the_notices_of_an_engine_that_stopped_stepping():
    """An offline engine whose caller stops stepping once no request is unfinished never
    ends the step after the read: the connector loop's heartbeat tick sends the notice, so
    the holder does not keep the blocks until the lease expires."""
    puller = Puller(load_timeout_s=5.0, heartbeat_interval_s=0.05, stats=KVTransferStats())
    transport = _FakeTransport(one_sided=True)
    puller.start_heartbeats(transport, timeout_s=5.0)
    try:
        puller.submit(transport, _plan("d-3"))
        puller.send_deferred_notices(transport)  # the read's step ends; no step follows
        _wait_for(lambda: transport.notices, timeout_s=2.0)
        assert transport.notices == [("p-d-3", True, "tok")]
        assert puller.take_deferred_notices() == []  # the tick took it: nothing sent twice
        time.sleep(0.2)
        assert transport.notices == [("p-d-3", True, "tok")]
    finally:
        get_loop_thread().run(puller.close(), 5.0)


def test_notices_not_yet_sent_are_taken_by_a_worker_shutting_down():
    """``KVBridgeWorker.shutdown`` sends the notices of the last step's one-sided loads
    itself (their holders would otherwise keep the blocks until the leases expire)."""
    puller = Puller(load_timeout_s=5.0, heartbeat_interval_s=1.0, stats=KVTransferStats())
    transport = _FakeTransport(one_sided=True)
    puller.submit(transport, _plan("d-9"))
    notices = puller.take_deferred_notices()
    assert [(n.ticket.remote_request_id, n.success) for n in notices] == [("p-d-9", True)]
    assert puller.take_deferred_notices() == []
    puller.send_deferred_notices(transport)  # nothing left to send
    time.sleep(0.2)
    assert transport.notices == []


def test_a_sync_one_sided_pull_reports_nothing_but_its_failures():
    puller = Puller(load_timeout_s=5.0, heartbeat_interval_s=1.0, stats=KVTransferStats())
    puller.submit(_FakeTransport(one_sided=True), _plan("d-2", sync=True))
    puller.wait_settled(["d-2"])  # returns at once
    assert puller.pop_settled().request_ids == set()


def test_a_pull_the_transport_cannot_read_one_sided_goes_to_the_loop():
    puller = Puller(load_timeout_s=5.0, heartbeat_interval_s=1.0, stats=KVTransferStats())
    transport = _FakeTransport(one_sided=False)
    puller.submit(transport, _plan("d-3"))
    assert puller.wait_for_any(5.0)
    assert puller.pop_settled().request_ids == {"d-3"}
    assert transport.calls == ["one_sided:inc-1:p-d-3", "connect", "read_blocks"]
    _wait_for(lambda: transport.notices)
    assert transport.notices == [("p-d-3", True, "tok")]


def test_an_index_pull_never_tries_one_sided():
    """Without a lease nothing guards a block on the holder's board."""
    puller = Puller(load_timeout_s=5.0, heartbeat_interval_s=1.0, stats=KVTransferStats())
    transport = _FakeTransport(one_sided=True)
    plan = _plan("d-4")
    puller.submit(transport, PullPlan(**{**{f: getattr(plan, f) for f in plan.__struct_fields__},
                                         "lease": None}))
    assert puller.wait_for_any(5.0)
    assert puller.pop_settled().request_ids == {"d-4"}
    assert "read_blocks" in transport.calls and not transport.calls[0].startswith("one_sided")
