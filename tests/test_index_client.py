"""IndexClient never makes its caller wait on the index (docs/architecture.md, "The two
connector halves": a scheduling step never waits on the network; issue 12).

A real ``redis-server`` (``tests/_redis_fixture.py``) is paused with ``CLIENT PAUSE ms ALL``
from another connection: it then answers nobody, as a stalled or partitioned Redis would. Node
"node-a" publishes, node "node-b" looks up (a node never finds its own blocks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from _identity_builders import BASE_IDENTITY
from kvbridge.connector.index import (
    IndexClient,
    IndexNamespace,
    InMemoryBlockIndex,
    LookupResult,
    RedisBlockIndex,
    new_incarnation,
    open_index,
)
from kvbridge.connector.index.node_directory import (
    InMemoryNodeDirectory,
    NodeAddress,
    RedisNodeDirectory,
)
from kvbridge.connector.index.protocol import ParkedParts
from kvbridge.kvmanager.kv_events import BlockRemoved, BlockStored
from redis.backoff import NoBackoff
from redis.retry import Retry

_NS = IndexNamespace(identity=BASE_IDENTITY)
_TTL_S = 30.0  # no heartbeat falls inside a test
_HOST = "127.0.0.1"
_PORTS = {"node-a": 7001, "node-b": 7002}
# What "returns at once" means here: a call that waited on Redis could return only once the pause
# is over, so calls that never wait return while it lasts. The margin is for a loaded CI host (a
# wall-clock bound of a few ms per call failed there: 201 publishes took 0.31 s under load).
_PAUSE_MARGIN_S = 0.3


def _assert_returned_while_paused(pause_ends_s: float) -> None:
    """The calls made since the pause began returned before Redis answered anybody again."""
    left_s = pause_ends_s - time.monotonic()
    assert left_s > _PAUSE_MARGIN_S, f"calls returned only {left_s:.2f} s before the pause ended"


def _hashes(num_blocks: int, *, prompt: str = "p") -> list[bytes]:
    """A chain of distinct 32-byte block hashes (stand-ins for a prompt's block hashes)."""
    return [hashlib.sha256(f"{prompt}/{i}".encode()).digest() for i in range(num_blocks)]


def _stored(
    block_hashes: list[bytes], *, first_block_id: int = 1, parent_block_hash: bytes | None = None
) -> BlockStored:
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=[],
        block_size=_NS.block_size,
        lora_name=None,
        medium=None,
        group_id=0,
        block_ids=list(range(first_block_id, first_block_id + len(block_hashes))),
    )


def _removed(block_hashes: list[bytes]) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=None, group_id=0, block_ids=[])


def _redis_backends(
    url: str, socket_timeout_s: float
) -> tuple[RedisBlockIndex, RedisNodeDirectory]:
    """Backends whose calls wait ``socket_timeout_s`` for an answer (5 s: longer than any pause,
    so a call made during one is stuck until it ends, unless interrupted), no back-off."""
    index = RedisBlockIndex(
        _NS, url, socket_timeout_s=socket_timeout_s, connect_timeout_s=socket_timeout_s,
        retry_interval_s=0.0,
    )
    client = redis.Redis.from_url(
        url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    return index, RedisNodeDirectory(client, _NS.key_prefix)


@pytest.fixture
def clients(redis_url: str) -> Iterator[Callable[..., IndexClient]]:
    """``clients(node_id, **kwargs)``: a started IndexClient on the test's Redis (closed at the
    end); ``socket_timeout_s`` (default 5 s) goes to the backends, the rest to IndexClient."""
    made: list[IndexClient] = []

    def build(node_id: str, *, socket_timeout_s: float = 5.0, **kwargs) -> IndexClient:
        index, directory = _redis_backends(redis_url, socket_timeout_s)
        client = IndexClient(
            index, directory, node_id=node_id, incarnation=new_incarnation(), group_ids=(0,),
            ttl_s=_TTL_S, **kwargs,
        )
        client.start(_HOST, _PORTS[node_id])
        made.append(client)
        return client

    yield build
    for client in made:
        client.close()


def _poll_until_done(
    client: IndexClient, key: str, *, timeout_s: float = 5.0
) -> tuple[LookupResult, list[str]]:
    """Poll every 5 ms until the lookup is answered: the answer and every status seen."""
    seen: list[str] = []
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        result = client.poll_lookup(key)
        seen.append(result.status)
        if result.done:
            return result, seen
        time.sleep(0.005)
    raise AssertionError(f"lookup {key!r} still pending after {timeout_s} s: {seen[-3:]}")


def _flush_once_registered(client: IndexClient, timeout_s: float = 5.0) -> bool:
    """``flush`` returns at once while the client's registration goes unanswered: try again
    until it is answered and the held batches went, or ``timeout_s`` ran out."""
    deadline_s = time.monotonic() + timeout_s
    while not client.flush(timeout_s=0.1):
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.05)
    return True


def _production_client(redis_url: str) -> tuple[IndexClient, list[int]]:
    """Node "node-a" on production's index settings (0.25 s timeouts, 1 s back-off), not yet
    started, with a resync source that records each time it is read (and reads nothing)."""
    index, directory = open_index(redis_url, _NS)
    client = IndexClient(index, directory, node_id="node-a", incarnation=new_incarnation(),
                         group_ids=(0,), ttl_s=_TTL_S)
    snapshots: list[int] = []
    client.set_resync_source(lambda: snapshots.append(1) or [])
    return client, snapshots


def _wait_until(ends_at_s: float) -> None:
    time.sleep(max(0.0, ends_at_s - time.monotonic()))


def _start(client: IndexClient, key: str, hashes: list[bytes]) -> None:
    client.start_lookup(key, hashes, num_local_blocks=0, min_gain_blocks=1)


def _worker_alive(node_id: str) -> bool:
    return any(t.name == f"kvbridge-index-{node_id}" for t in threading.enumerate())


def test_paused_redis_never_blocks_the_caller_and_the_prefix_is_found_after(
    clients, pause_redis
):
    a, b = clients("node-a"), clients("node-b", lookup_timeout_s=0.3)
    prompt = _hashes(12)
    # (1) Redis answers nobody for 3 s. A publishes the prompt's blocks in two batches and B
    # starts 16 lookups: every call returns at once.
    pause_ends_s = pause_redis(3000)
    a.publish([_stored(prompt[:6], first_block_id=1)])
    a.publish([_stored(prompt[6:], first_block_id=7, parent_block_hash=prompt[5])])
    for i in range(16):
        _start(b, f"req-{i}", prompt)
    all_started_s = time.monotonic()
    _assert_returned_while_paused(pause_ends_s)
    # (2) req-0 is pending until its 0.3 s run out, then timed out, long before Redis answers.
    result, seen = _poll_until_done(b, "req-0")
    assert result == LookupResult("timed_out")
    assert seen[0] == "pending" and set(seen[:-1]) == {"pending"}
    assert time.monotonic() < pause_ends_s - 1.0
    # Once the last one's 0.3 s have run out too (on a loaded machine the 16 starts can spread
    # past req-0's deadline), each poll of the 15 others answers "timed_out" at once.
    _wait_until(all_started_s + 0.3)
    assert {b.poll_lookup(f"req-{i}").status for i in range(1, 16)} == {"timed_out"}
    _assert_returned_while_paused(pause_ends_s)
    assert b.stats.lookups_timed_out == 16
    # (3) Redis answers again: A's batches land, and a new lookup of B finds all 12 blocks on A
    # (A's address from the node directory, A's block ids).
    _wait_until(pause_ends_s)
    assert a.flush(timeout_s=5.0)
    _start(b, "req-after", prompt)
    result, _ = _poll_until_done(b, "req-after")
    assert result.status == "hit"
    found = result.prefix
    assert (found.holder.node_id, found.holder.incarnation) == ("node-a", a.incarnation)
    assert found.address == NodeAddress(_HOST, _PORTS["node-a"], a.incarnation)
    assert found.num_blocks == 12
    assert found.block_ids == [list(range(1, 13))]
    assert b.num_lookups_in_flight == 0


def test_batches_published_before_an_unanswered_registration_is_answered_land_without_a_step(
    redis_url, clients, pause_redis
):
    """An engine whose registration at start runs past the index's socket timeout (a loaded
    host: CI saw it) serves a request and goes idle. Its batch waits queued until the
    registration is answered and is then sent as it is: a resync would need the engine's next
    step to read its cached set, and an idle engine takes none (its blocks unlisted for good)."""
    b = clients("node-b")
    prompt = _hashes(8)
    a, snapshots = _production_client(redis_url)
    index = a.index
    pause_ends_s = pause_redis(1500)
    try:
        a.start(_HOST, _PORTS["node-a"])  # its registration: no answer
        assert not index.available
        a.publish([_stored(prompt, first_block_id=1)])  # the engine's last step; then idle
        _wait_until(pause_ends_s)
        assert _flush_once_registered(a)
        _start(b, "req", prompt)
        result, _ = _poll_until_done(b, "req")
        assert result.status == "hit", result
        assert (result.prefix.holder.node_id, result.prefix.num_blocks) == ("node-a", 8)
        assert result.prefix.address == NodeAddress(_HOST, _PORTS["node-a"], a.incarnation)
        assert snapshots == [] and a.num_resyncs == 0 and not a.resync_pending
    finally:
        a.close()


def test_a_publish_past_the_socket_timeout_lands_once_redis_answers_without_a_step(
    redis_url, clients, pause_redis
):
    """CI: a registered engine's publish ran past the index's 0.25 s socket timeout on a
    loaded host, in the step before the engine went idle. The call is made again, the same
    call, once Redis answers: the blocks are listed with no engine step and no resync
    (``"replayed"`` if the server ran the timed-out call after all)."""
    b = clients("node-b")
    prompt = _hashes(8)
    a, snapshots = _production_client(redis_url)
    index = a.index
    a.start(_HOST, _PORTS["node-a"])
    try:
        assert a.flush(timeout_s=5.0) and index.available  # registered
        pause_ends_s = pause_redis(1500)
        a.publish([_stored(prompt, first_block_id=1)])  # the engine's last step; then idle
        _wait_until(pause_ends_s)
        assert index.stats.publishes_dropped >= 1  # the call did time out
        assert a.flush(timeout_s=10.0)
        _start(b, "req", prompt)
        result, _ = _poll_until_done(b, "req")
        assert result.status == "hit", result
        assert (result.prefix.holder.node_id, result.prefix.num_blocks) == ("node-a", 8)
        assert snapshots == [] and a.num_resyncs == 0 and not a.resync_pending
    finally:
        a.close()


@pytest.mark.parametrize("socket_timeout_s", [None, 2.0])
def test_the_index_s_redis_calls_wait_its_socket_timeout(redis_url, socket_timeout_s):
    """``index_socket_timeout_s`` (default 0.25 s) reaches every connection the engine's index
    opens: the index's own and its node directory's, for reads and for connects."""
    kwargs = {} if socket_timeout_s is None else {"socket_timeout_s": socket_timeout_s}
    index, directory = open_index(redis_url, _NS, **kwargs)
    want = socket_timeout_s or 0.25
    for client in (index._client, directory._client):
        settings = client.connection_pool.connection_kwargs
        assert (settings["socket_timeout"], settings["socket_connect_timeout"]) == (want, want)


def test_published_batches_land_in_order_across_a_backlog(clients, pause_redis):
    a = clients("node-a")
    h = _hashes(10)
    a.publish([_stored(h, first_block_id=1)])  # blocks 1..10
    # (1) While Redis is paused, 201 batches queue up behind it: block 5's hash is removed and
    # stored again 100 times (block ids 1000..1099), then block 9's hash is removed.
    assert a.flush(timeout_s=5.0)
    pause_ends_s = pause_redis(2000)
    for i in range(100):
        a.publish([_removed([h[5]])])
        a.publish([_stored([h[5]], first_block_id=1000 + i, parent_block_hash=h[4])])
    a.publish([_removed([h[9]])])
    _assert_returned_while_paused(pause_ends_s)
    assert a.stats.publish_ops == 10  # none of the 201 has reached Redis yet
    # (2) Applied in order, the last store of h[5] wins (block 1099) and h[9] is gone; any
    # reordering would leave h[5] removed, another block id, or h[9] held.
    _wait_until(pause_ends_s)
    assert a.flush(timeout_s=5.0)
    assert a.index.longest_prefix(h).num_blocks == 9
    assert a.index.get_block_ids("node-a", a.incarnation, h[:9]) == [[1, 2, 3, 4, 5, 1099, 7, 8, 9]]
    assert a.stats.publish_ops == 10 + 2 * 100 + 1
    assert a.stats.publish_batches_dropped_full == 0


def test_cancel_frees_a_queued_slot_and_the_in_flight_bound_refuses_the_rest(
    clients, pause_redis
):
    a, b = clients("node-a"), clients("node-b", max_lookups_in_flight=2, lookup_timeout_s=5.0)
    prompt = _hashes(4)
    a.publish([_stored(prompt)])
    assert a.flush()
    pause_ends_s = pause_redis(1500)
    # (1) r1 and r2 fill the two slots (r1 runs, stuck on Redis; r2 waits behind it). Starting
    # r1 again is not a second lookup; r3 is refused at once.
    _start(b, "r1", prompt)
    _start(b, "r2", prompt)
    _start(b, "r1", prompt)
    assert b.num_lookups_in_flight == 2
    _start(b, "r3", prompt)
    assert b.poll_lookup("r3") == LookupResult("overloaded")
    assert b.stats.lookups_refused == 1
    # (2) Cancelling r2 (never started) frees its slot at once and forgets the key.
    b.cancel_lookup("r2")
    assert b.num_lookups_in_flight == 1
    with pytest.raises(ValueError, match="r2"):
        b.poll_lookup("r2")
    b.cancel_lookup("never-started")  # nothing to forget: fine
    _start(b, "r4", prompt)
    assert b.num_lookups_in_flight == 2
    # (3) Cancelling the running r1 drops its answer; r4 still gets its own once Redis answers.
    b.cancel_lookup("r1")
    with pytest.raises(ValueError, match="r1"):
        b.poll_lookup("r1")
    _wait_until(pause_ends_s)
    result, _ = _poll_until_done(b, "r4")
    assert (result.status, result.prefix.num_blocks) == ("hit", 4)
    # (4) r1 started again is a fresh lookup with a fresh answer.
    _start(b, "r1", prompt)
    result, _ = _poll_until_done(b, "r1")
    assert result.status == "hit"
    assert b.num_lookups_in_flight == 0
    assert b.stats.lookups_timed_out == 0


def test_close_while_paused_returns_promptly(clients, pause_redis):
    a, b = clients("node-a"), clients("node-b")
    pause_ends_s = pause_redis(3000)
    # (1) Both workers get stuck in a call that Redis will not answer for 3 s (socket timeout
    # 5 s): B in a lookup, A in a publish.
    _start(b, "req-0", _hashes(8))
    a.publish([_stored(_hashes(8))])
    time.sleep(0.1)
    # (2) close interrupts those calls: both return in well under the remaining pause, and
    # their threads are gone.
    started_s = time.monotonic()
    b.close()
    a.close()
    assert time.monotonic() - started_s < 2.0
    assert time.monotonic() < pause_ends_s - 0.5
    assert not _worker_alive("node-a") and not _worker_alive("node-b")


def test_a_full_publish_queue_drops_batches_counts_and_logs_them(clients, pause_redis, caplog):
    a = clients("node-a", max_queued_ops=10)
    h = _hashes(24)
    pause_ends_s = pause_redis(1000)
    # (1) A's worker is stuck on a lookup; six batches of 4 blocks (one chain, 4 ops each) are
    # offered. A batch is accepted while fewer than 10 ops wait: 3 of them (0, 4, 8 waiting),
    # more only if the worker woke late and took some along with its lookup.
    _start(a, "stuck", h)
    time.sleep(0.1)
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.index.worker"):
        for k in range(6):
            parent = h[4 * k - 1] if k else None
            a.publish([_stored(h[4 * k : 4 * k + 4], first_block_id=4 * k + 1,
                               parent_block_hash=parent)])
        _assert_returned_while_paused(pause_ends_s)
    num_dropped = a.stats.publish_batches_dropped_full
    assert num_dropped >= 1
    assert a.stats.publish_ops_dropped_full == 4 * num_dropped
    assert sum("publish queue of node-a full" in r.getMessage() for r in caplog.records) == 1
    # (2) Once Redis answers, the accepted batches (the first ones, in order) are in the index;
    # the dropped ones are missing until a resync (another issue).
    _wait_until(pause_ends_s)
    assert a.flush(timeout_s=5.0)
    assert a.index.longest_prefix(h).num_blocks == 4 * (6 - num_dropped)


def test_production_timeouts_answer_unavailable_during_a_pause(redis_url, pause_redis):
    """With ``open_index``'s 0.25 s socket timeouts a lookup fails fast as "unavailable" (the
    backend then backs off and answers the next one at once) instead of timing out."""
    index, directory = open_index(redis_url, _NS)
    b = IndexClient(
        index, directory, node_id="node-b", incarnation=new_incarnation(), group_ids=(0,),
        ttl_s=_TTL_S, lookup_timeout_s=2.0,
    )
    b.start(_HOST, _PORTS["node-b"])
    try:
        pause_ends_s = pause_redis(1000)
        _start(b, "req-0", _hashes(8))
        result, _ = _poll_until_done(b, "req-0")
        assert result == LookupResult("unavailable")
        assert b.stats.lookups_failed == 1
        _start(b, "req-1", _hashes(8))
        result, _ = _poll_until_done(b, "req-1", timeout_s=0.5)
        assert result == LookupResult("unavailable")
        assert time.monotonic() < pause_ends_s
    finally:
        b.close()


def _memory_clients(model_name: str) -> tuple[IndexClient, IndexClient]:
    """Two started clients on the in-process backend, a namespace of their own."""
    namespace = IndexNamespace(identity=dataclasses.replace(BASE_IDENTITY, model_name=model_name))
    index, directory = open_index("memory", namespace)
    made = []
    for node_id in ("node-a", "node-b"):
        client = IndexClient(
            index, directory, node_id=node_id, incarnation=new_incarnation(), group_ids=(0,),
            ttl_s=_TTL_S,
        )
        client.start(_HOST, _PORTS[node_id])
        made.append(client)
    return made[0], made[1]


def test_in_memory_lookups_short_prompts_and_bad_events():
    a, b = _memory_clients("memory-client-test")
    try:
        prompt = _hashes(6)
        # (1) A bad event costs its batch only: the worker logs it and publishes the next one.
        a.publish([object()])
        a.publish([_stored(prompt)])
        assert a.flush()
        _start(b, "req-0", prompt)
        result, _ = _poll_until_done(b, "req-0")
        assert (result.status, result.prefix.num_blocks, result.prefix.block_ids) == (
            "hit", 6, [[1, 2, 3, 4, 5, 6]],
        )
        # (2) 6 hashes cannot beat 5 local blocks by 2: answered "no_hit" without asking, once.
        b.start_lookup("req-1", prompt, num_local_blocks=5, min_gain_blocks=2)
        assert b.poll_lookup("req-1") == LookupResult("no_hit")
        with pytest.raises(ValueError, match="req-1"):
            b.poll_lookup("req-1")
        # (3) Hashes of different lengths are the caller's mistake.
        with pytest.raises(ValueError, match="one non-zero length"):
            b.start_lookup("req-2", [b"x" * 32, b"y"], num_local_blocks=0, min_gain_blocks=1)
    finally:
        a.close()
        b.close()
    assert not _worker_alive("node-a") and not _worker_alive("node-b")


def test_the_node_directory_says_once_that_redis_is_gone_and_once_that_it_is_back(
    redis_server, caplog
):
    # A node announces itself at every heartbeat: an outage must not log a line each time.
    _, directory = _redis_backends(redis_server.url, 0.2)
    address = NodeAddress(_HOST, _PORTS["node-a"], 1)
    logger_name = "kvbridge.connector.index.reachability"  # shared with the index on it
    redis_server.stop()
    try:
        with caplog.at_level(logging.INFO, logger=logger_name):
            for _ in range(3):
                directory.announce("node-a", address, ttl_s=_TTL_S)
            assert directory.lookup("node-a") is None
    finally:
        redis_server.start()
    with caplog.at_level(logging.INFO, logger=logger_name):
        directory.announce("node-a", address, ttl_s=_TTL_S)
        directory.announce("node-a", address, ttl_s=_TTL_S)
    messages = [r.getMessage() for r in caplog.records if r.name == logger_name]
    assert len(messages) == 2, messages
    assert messages[0].startswith("kvbridge index: cannot reach "), messages
    assert "answers again" in messages[1], messages
    assert directory.lookup("node-a") == address


def test_wait_for_answer_returns_at_the_answer_and_not_before(clients, pause_redis):
    # An idle engine step waits here for its lookups (``idle_lookup_wait_s``): it must return
    # as soon as one is answered, and no later than its timeout while none is.
    a, b = clients("node-a"), clients("node-b", lookup_timeout_s=5.0)
    prompt = _hashes(8)
    a.publish([_stored(prompt, first_block_id=1)])
    assert a.flush(timeout_s=5.0)
    assert not b.wait_for_answer(5.0)  # no lookup out: nothing to wait for, at once
    pause_ends_s = pause_redis(1500)
    _start(b, "req-0", prompt)
    started = time.monotonic()
    assert not b.wait_for_answer(0.05)  # Redis paused: the timeout, not the pause, ends it
    assert time.monotonic() - started >= 0.04
    assert time.monotonic() < pause_ends_s and b.poll_lookup("req-0").status == "pending"
    assert b.wait_for_answer(5.0)  # answered once Redis is back, long before the 5 s
    assert pause_ends_s - 0.05 <= time.monotonic() < pause_ends_s + 2.0
    assert b.wait_for_answer(5.0)  # not yet handed out: at once
    assert b.poll_lookup("req-0").status == "hit"
    assert not b.wait_for_answer(5.0)  # handed out: none left


class _Unanswered:
    """An in-memory index whose first ``num_unanswered`` registrations get no answer (as a
    Redis past its socket timeout answers "unavailable")."""

    def __init__(self, index, num_unanswered: int) -> None:
        self._index, self.num_left = index, num_unanswered

    def register_node(self, *args, **kwargs):
        if self.num_left > 0:
            self.num_left -= 1
            return "unavailable"
        return self._index.register_node(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._index, name)


def test_while_a_registration_is_unanswered_flush_returns_at_once_and_nothing_is_announced():
    """A store's put waits in ``flush`` for its events (``store/shelf.py``): while its
    registration goes unanswered, the batches are held, so waiting for them would stall every
    put for the whole timeout. Nor is the address announced before the node is registered."""
    namespace = IndexNamespace(identity=dataclasses.replace(BASE_IDENTITY, model_name="held"))
    index, directory = open_index("memory", namespace)
    unanswered = _Unanswered(index, num_unanswered=3)
    a = IndexClient(unanswered, directory, node_id="node-a", incarnation=new_incarnation(),
                    group_ids=(0,), ttl_s=_TTL_S)
    a.start(_HOST, _PORTS["node-a"])
    try:
        a.publish([_stored(_hashes(4), first_block_id=1)])
        started_s = time.monotonic()
        assert a.flush(timeout_s=5.0) is False
        assert time.monotonic() - started_s < 1.0  # at once, not after its 5 s
        assert directory.lookup("node-a") is None or unanswered.num_left == 0
        # The retries (every 0.25 s) get an answer at the fourth: the held batch goes as it is.
        assert _flush_once_registered(a)
        assert unanswered.num_left == 0
        assert directory.lookup("node-a") == NodeAddress(_HOST, _PORTS["node-a"], a.incarnation)
        assert index.longest_prefix(_hashes(4)).num_blocks == 4
        assert a.num_resyncs == 0
    finally:
        a.close()


def test_a_batch_lost_while_a_part_of_the_last_resync_is_parked_asks_for_a_new_resync():
    """On a cluster with one shard down, part of the node's last resync may sit parked in the
    index (``ParkedParts.oldest_seq`` within that set): the resync is reported pending. A batch
    lost after that set was taken needs a new set, so the worker asks for one at its next
    answered heartbeat. (Before, the parked part counted as a set still under way: no new set
    was asked for, and every delta was dropped until the shard came back.)"""

    class _Parking(InMemoryBlockIndex):
        parked = ParkedParts()

        def parked_parts(self, node_id: str) -> ParkedParts:
            return self.parked

    index = _Parking(_NS)
    client = IndexClient(index, InMemoryNodeDirectory(), node_id="node-a",
                         incarnation=new_incarnation(), group_ids=(0,), ttl_s=0.3)
    sets: list[int] = []
    client.set_resync_events(lambda: sets.append(1) or [])
    client.start("127.0.0.1", 5555)
    worker = client._worker

    def resync_read_within(timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        before = len(sets)
        while len(sets) == before:  # the caller reads its set at its next publish
            assert time.monotonic() < deadline_s, "no resync asked for"
            client.publish([])
            time.sleep(0.02)

    try:
        worker._lose()  # (1) a batch lost: a set is asked for, read, sent
        resync_read_within(5.0)
        assert client.flush()
        assert not client.resync_pending
        index.parked = ParkedParts(1, 0, worker._queue.whole_set_last_seq)  # (part of that set)
        assert client.resync_pending
        worker._lose()  # (2) another loss while it is parked: a new set is asked for
        resync_read_within(5.0)
    finally:
        client.close()
