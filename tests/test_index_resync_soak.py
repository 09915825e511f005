"""Seeded random interleavings of a node's publish / resync state machine (``IndexWorker``).

One ``IndexClient`` (a short publish queue: ``max_queued_ops`` 4 to 64 ops; a 30 s lease that
never lapses on its own) over ``_ChaosIndex``, an in-memory index whose calls (publish,
heartbeat; register during an outage) can, per seed and at random: fail ("unavailable", nothing
applied), run and still answer "unavailable" (a call that timed out on the client after the
server ran it), answer "unavailable" and run later, after later calls maybe (the server still
had it), take a little time, or succeed; whose ``available`` says what Redis's does (False
after a failed call, True after one that answered); and in which the driver can arm a hold (the
worker's next call, or its next heartbeat, or its next resync call, waits until the driver lets
it go: the worker thread stalls), cut an outage (every call fails for some steps) and wipe the
node (Redis restarted empty: the next call answers "fenced").

A simulated engine thread keeps a pool (block hash -> block id; chained 32-byte hashes, each with
its fixed parent) and at each step caches new chains (``BlockStored`` with the right parent;
now and then one longer than the queue), caches an evicted hash again under a new block id,
evicts blocks (``BlockRemoved``), now and then clears everything (``AllBlocksCleared``), and
calls ``client.publish(events)`` every step, also with no events, as the engine does; now and
then it idles past a resync probe (50 ms). The resync source returns the pool as it is then; a
pool passes 1,023 blocks in some seeds, so a resync's set goes out in several calls.

Invariants, per seed:

1. Settled means equal: every 40 to 120 steps, and at the end, the driver lets everything go
   (no hold, no outage, no random failure), keeps calling ``publish([])`` until
   ``resync_pending`` is False and ``flush`` returns True (a generous deadline), and the index's
   entries for the node must then be exactly the pool, also once every deferred call has run:
   a batch lost (dropped on a full queue, failed, run late, refused as a gap or fenced) and
   never repaired shows up here.
2. Bounded work (no "resync storm"): the resync source is wrapped and its reads counted.
   - While the worker is stuck in one backend call (it changes nothing meanwhile): if a set was
     waiting to go out (queued, or in that call) the source is not read at all; else at most
     once, however many steps drop their batch on the full queue (the first drop asks for the
     set, which then waits in the queue), and exactly once when a dropped batch was followed by
     a step while the backend last answered (a full queue, not a lost backend, asks at once).
   - Over the whole run it is read at most once per loss event (batches dropped on the full
     queue plus backend calls that did not answer "ok"/"replayed"): every read ends resync mode
     unless a loss happens after it (``IndexWorker._losses_at_resync``), so each read needs a
     loss of its own. And at most once per resync call the backend saw (plus one per "fenced"):
     a set is not read again before the last one went out, unless a lapsed registration asks.
3. Nothing raises: the engine side runs in the test's thread; the worker's thread logs any
   exception it catches (level ERROR), and a seed fails on any ERROR record of the index
   package; the worker thread is gone after ``close``.

The interleaving of the two threads is the OS's, but every draw is seeded: the engine's actions
per step come from one ``random.Random`` and the index's outcome per call (in call order) from
another, so a failing seed replays the same script (``run_soak(seed)``). 40 seeds of 260 steps
take about 25 s. What the soak cannot see (it settles with ``flush``) has a reproducer at the
end.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from kvbridge.connector.index import (
    IndexClient,
    IndexNamespace,
    InMemoryBlockIndex,
    InMemoryNodeDirectory,
)
from kvbridge.connector.index.jobs import count_ops
from kvbridge.connector.index.protocol import PublishResult
from kvbridge.kvmanager import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlock
from kvbridge.transport import BlockIdentity

BLOCK_SIZE = 16
NAMESPACE = IndexNamespace(identity=BlockIdentity(
    model_name="resync-soak", kv_cache_dtype="float32", block_size=BLOCK_SIZE,
    hash_fn_name="sha256",
))
KEY_BYTES = NAMESPACE.key_hash_bytes
NODE = "A"
TTL_S = 30.0  # heartbeats every 10 s: a lease never lapses during a seed
NUM_SEEDS = 40
NUM_STEPS = 260
SETTLE_TIMEOUT_S = 15.0  # generous: a settle takes a probe (50 ms) and a resync or two


# ---------------------------------------------------------------------------- the backend


class _Hold:
    """The worker's backend call after the next ``skip`` ones (of kind ``only``, when given)
    waits in it (``entered`` set; ``kind``: "heartbeat", "resync" (a set's first call) or
    "publish") until ``release``."""

    def __init__(self, skip: int, only: str | None) -> None:
        self.skip, self.only = skip, only
        self.kind = ""
        self.entered = threading.Event()
        self.release = threading.Event()


class _ChaosIndex(InMemoryBlockIndex):
    """An in-memory index whose calls fail, land late, take time or wait, on a seeded script.

    Each call draws three numbers from its own ``random.Random`` (the worker thread makes every
    call once started), so the n-th call's fate depends on the seed alone. A publish that fails
    either did nothing, or ran and lost its answer ("late"), or is ``deferred``: the server runs
    it later, whenever the driver says (``run_deferred``; a call that timed out on the client
    and still sat in the server's input), after later calls maybe. The driver (the engine
    thread) sets ``outage`` (every call fails), ``quiet`` (no random failure), arms a ``_Hold``
    for the next call, and wipes the node. Counts what the worker must treat as a possible loss
    (``losses``) and the resync calls it made (``resync_calls``)."""

    def __init__(self, seed: int, *, p_fail: float, p_late: float, p_slow: float,
                 max_delay_s: float) -> None:
        super().__init__(NAMESPACE)
        self.lock = threading.Lock()  # the in-memory state: worker calls vs. the driver's reads
        self._rng = random.Random(seed)
        self._p_fail, self._p_late = p_fail, p_late
        self._p_slow, self._max_delay_s = p_slow, max_delay_s
        self._armed: _Hold | None = None
        self._available = True
        self.outage = False
        self.quiet = False
        self.losses = 0  # calls answered other than "ok" / "replayed"
        self.calls = 0
        self.resync_calls = 0
        self.fenced = 0
        self.deferred: list[tuple[str, int, list[Any], dict[str, Any]]] = []
        self.deferred_ran: dict[str, int] = {}  # status -> count

    @property
    def available(self) -> bool:
        return self._available

    def arm_hold(self, skip: int, only: str | None) -> _Hold:
        hold = _Hold(skip, only)
        with self.lock:
            self._armed = hold
        return hold

    def let_go(self, hold: _Hold | None) -> None:
        if hold is not None:
            hold.release.set()
        with self.lock:
            self._armed = None

    def wipe(self) -> None:
        """Redis restarted empty: the node's registration and entries are gone."""
        with self.lock:
            self._nodes.pop(NODE, None)

    def run_deferred(self, rng: random.Random | None) -> None:
        """Run each deferred publish with a chance of one in thirty (all of them: ``rng``
        None), as the server would have: by the numbers it carries."""
        with self.lock:
            due = [call for call in self.deferred if rng is None or rng.random() < 1 / 30]
            self.deferred = [call for call in self.deferred if call not in due]
            for node_id, incarnation, events, kwargs in due:
                status = super().publish(node_id, incarnation, events, **kwargs).status
                self.deferred_ran[status] = self.deferred_ran.get(status, 0) + 1

    def _fate(self, kind: str) -> str:
        """"ok", "fail" (nothing applied), "late" (applied, answered "unavailable") or
        "deferred" (answered "unavailable", applied later)."""
        with self.lock:
            self.calls += 1
            hold = self._armed
            if hold is not None and hold.only not in (None, kind):
                hold = None
            elif hold is not None and hold.skip:
                hold.skip -= 1
                hold = None
            elif hold is not None:
                hold.kind, self._armed = kind, None
            fail, late, slow = self._rng.random(), self._rng.random(), self._rng.random()
        if hold is not None:
            hold.entered.set()
            hold.release.wait(30)
        if slow < self._p_slow:
            time.sleep(self._max_delay_s * (slow / self._p_slow))
        if self.outage:  # read after the wait: a call let go during a settle answers
            return "fail"
        if self.quiet or fail >= self._p_fail:
            return "ok"
        if late < self._p_late / 2:
            return "deferred"
        return "late" if late < self._p_late else "fail"

    def publish(self, node_id, incarnation, events, **kwargs):
        events = list(events)
        fate = self._fate("resync" if kwargs.get("resync") else "publish")
        if kwargs.get("resync"):
            self.resync_calls += 1
        if fate in ("fail", "deferred"):
            if fate == "deferred":
                with self.lock:
                    self.deferred.append((node_id, incarnation, events, kwargs))
            self._available = False
            self.losses += 1
            return PublishResult("unavailable", count_ops(events))
        with self.lock:
            result = super().publish(node_id, incarnation, events, **kwargs)
        if fate == "late":
            self._available = False
            self.losses += 1
            return PublishResult("unavailable", result.num_ops)
        self._available = True
        if result.status not in ("ok", "replayed"):
            self.losses += 1
            self.fenced += result.status == "fenced"
        return result

    def heartbeat(self, node_id, incarnation, *, ttl_s):
        fate = self._fate("heartbeat")
        if fate != "ok":
            if fate == "late":  # it renewed the lease; the answer was lost
                with self.lock:
                    super().heartbeat(node_id, incarnation, ttl_s=ttl_s)
            self._available = False
            self.losses += 1
            return "unavailable"
        with self.lock:
            status = super().heartbeat(node_id, incarnation, ttl_s=ttl_s)
        self._available = True
        if status != "ok":
            self.losses += 1
            self.fenced += 1
        return status

    def register_node(self, node_id, incarnation, *, ttl_s):
        if self.outage:
            return "unavailable"
        with self.lock:
            return super().register_node(node_id, incarnation, ttl_s=ttl_s)

    def node_entries(self, node_id):
        with self.lock:
            return super().node_entries(node_id)


# ---------------------------------------------------------------------------- the engine


@dataclass
class _Pool:
    """The node's prefix cache as the engine sees it, and the events each change makes."""

    seed: int
    blocks: dict[bytes, int] = field(default_factory=dict)  # cached: block hash -> block id
    parent: dict[bytes, bytes | None] = field(default_factory=dict)  # every hash made, fixed
    next_block_id: int = 1
    next_hash: int = 0
    max_size: int = 0

    def _new_hash(self) -> bytes:
        self.next_hash += 1
        return hashlib.sha256(f"soak/{self.seed}/{self.next_hash}".encode()).digest()

    def _store(self, hashes: list[bytes], parent: bytes | None) -> BlockStored:
        ids = list(range(self.next_block_id, self.next_block_id + len(hashes)))
        self.next_block_id += len(hashes)
        self.blocks.update(zip(hashes, ids, strict=True))
        self.max_size = max(self.max_size, len(self.blocks))
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[],
                           block_size=BLOCK_SIZE, lora_name=None, medium=None, group_id=0,
                           block_ids=ids)

    def cache_chain(self, rng: random.Random, length: int) -> BlockStored:
        """``length`` new blocks after a cached block (or from block 0)."""
        parent = rng.choice(list(self.blocks)) if self.blocks and rng.random() < 0.7 else None
        hashes: list[bytes] = []
        prev = parent
        for _ in range(length):
            block_hash = self._new_hash()
            self.parent[block_hash] = prev
            hashes.append(block_hash)
            prev = block_hash
        return self._store(hashes, parent)

    def cache_again(self, rng: random.Random) -> BlockStored | None:
        """An evicted hash whose parent is cached (or block 0) recomputed into a new block."""
        gone = [h for h, p in self.parent.items()
                if h not in self.blocks and (p is None or p in self.blocks)]
        if not gone:
            return None
        block_hash = rng.choice(gone)
        return self._store([block_hash], self.parent[block_hash])

    def evict(self, rng: random.Random, count: int) -> BlockRemoved | None:
        if not self.blocks:
            return None
        hashes = rng.sample(list(self.blocks), min(count, len(self.blocks)))
        ids = [self.blocks.pop(h) for h in hashes]
        return BlockRemoved(block_hashes=hashes, medium=None, group_id=0, block_ids=ids)

    def clear(self) -> AllBlocksCleared:
        self.blocks.clear()
        return AllBlocksCleared(medium=None)

    def snapshot(self) -> list[CachedBlock]:
        return [CachedBlock(h, 0, b) for h, b in self.blocks.items()]

    def entries(self) -> set[tuple[int, bytes, int]]:
        return {(0, h[:KEY_BYTES], b) for h, b in self.blocks.items()}


class _CountedSource:
    """The resync source, counting its reads (each is a read of the node's whole set)."""

    def __init__(self, read: Callable[[], list[CachedBlock]]) -> None:
        self._read = read
        self.reads = 0

    def __call__(self) -> list[CachedBlock]:
        self.reads += 1
        return self._read()


def _make_client(index: _ChaosIndex, pool: _Pool, max_queued_ops: int
                 ) -> tuple[IndexClient, _CountedSource]:
    client = IndexClient(index, InMemoryNodeDirectory(), node_id=NODE, incarnation=1,
                         group_ids=(0,), ttl_s=TTL_S, max_queued_ops=max_queued_ops)
    source = _CountedSource(pool.snapshot)
    client.set_resync_source(source)
    client.start("127.0.0.1", 1)
    return client, source


def _state(client: IndexClient, index: _ChaosIndex, source: _CountedSource) -> str:
    worker = client._worker
    return (f"needs_resync={worker._needs_resync} wanted={worker._resync_wanted} "
            f"whole_set_ops={worker._queue.num_whole_set_ops} "
            f"in_call={worker._whole_set_in_call} batches={len(worker._queue.batches)} "
            f"losses(worker)={worker._num_losses} at_resync={worker._losses_at_resync} "
            f"reads={source.reads} resyncs={client.num_resyncs} calls={index.calls}")


def _settle(client: IndexClient, index: _ChaosIndex, pool: _Pool, source: _CountedSource,
            where: str) -> None:
    """Let everything go, step with no events until no resync is pending and every batch is
    out, then the index must say exactly what the pool holds (invariant 1), also once every
    deferred publish has run (each is older than what landed since: replayed, no change)."""
    index.quiet, index.outage = True, False
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        client.publish([])  # an engine step: the resync's set is read here when asked
        # (flush too: resync_pending is the worker's state, read without its lock)
        if not client.resync_pending and client.flush(1.0) and not client.resync_pending:
            break
        assert time.monotonic() < deadline, (
            f"{where}: never settled: {_state(client, index, source)}")
        time.sleep(0.002)
    expected = pool.entries()
    for late in ("", " and every deferred publish ran"):
        if late:
            index.run_deferred(None)
        entries = index.node_entries(NODE)
        assert entries == expected, (
            f"{where}: the index differs from the pool once settled{late}: "
            f"{len((entries or set()) - expected)} extra, "
            f"{len(expected - (entries or set()))} missing; {_state(client, index, source)}")
    index.quiet = False


@dataclass(frozen=True)
class _Knobs:
    max_queued_ops: int
    p_fail: float
    p_late: float
    p_slow: float
    max_delay_s: float
    p_hold: float
    p_outage: float
    p_wipe: float
    p_clear: float
    p_idle: float
    max_chain: int
    settle_every: tuple[int, int]

    @staticmethod
    def draw(rng: random.Random) -> _Knobs:
        max_queued_ops = rng.choice([4, 8, 16, 64])
        return _Knobs(
            max_queued_ops=max_queued_ops,
            p_fail=rng.choice([0.0, 0.02, 0.1]),
            p_late=rng.choice([0.0, 0.5]),
            p_slow=rng.choice([0.0, 0.1, 0.5]),
            max_delay_s=rng.choice([0.0005, 0.002]),
            p_hold=rng.choice([0.0, 0.03, 0.1]),
            p_outage=rng.choice([0.0, 0.01]),
            p_wipe=rng.choice([0.0, 0.0, 0.01]),
            p_clear=rng.choice([0.0, 0.01]),
            p_idle=rng.choice([0.0, 0.02, 0.05]),
            max_chain=rng.choice([2, max_queued_ops, 2 * max_queued_ops]),
            settle_every=(40, 120),
        )


class _Stall:
    """A hold the driver armed, from arming to step ``until``: checks the resync source's reads
    while the worker is inside the held call (invariant 2). From the first step that sees it
    there (``observe``), the worker changes nothing, so:

    - if a set was waiting to go out then (queued, or the held call is one of its calls) and the
      worker was not already asking for one, the set must not be read again;
    - else it may be read once, and must be once a dropped batch was followed by a step while
      the backend was last seen answering: a full queue, not a lost backend, asks at once (the
      worker's heartbeat probe cannot run while it is stuck)."""

    def __init__(self, hold: _Hold, until: int) -> None:
        self.hold, self.until = hold, until
        self.seen = False
        self.reads_at = self.drops_at = self.drops_followed = 0
        self.set_waiting = self.wanted = self.available = False

    def observe(self, client: IndexClient, index: _ChaosIndex, source: _CountedSource) -> None:
        """Before a step's publish, while the hold is still on."""
        drops = client.stats.publish_batches_dropped_full
        if not self.seen and self.hold.entered.is_set():
            worker = client._worker
            self.seen = True
            self.reads_at, self.drops_at = source.reads, drops
            self.set_waiting = worker._queue.num_whole_set_ops > 0 or worker._whole_set_in_call
            self.wanted, self.available = worker._resync_wanted, index.available
        if self.seen:
            self.drops_followed = drops - self.drops_at  # a publish follows them, held still

    def check(self, source: _CountedSource, where: str) -> int:
        """At release (before that step's publish); returns the reads while held."""
        if not self.seen:
            return 0
        reads = source.reads - self.reads_at
        most = 0 if self.set_waiting and not self.wanted else 1
        assert reads <= most, (
            f"{where}: the set was read {reads} times while the worker was stuck in one call "
            f"({self.hold.kind}; a set waiting to go out: {self.set_waiting}; "
            f"{self.drops_followed} batches dropped and followed by a step meanwhile)")
        if self.drops_followed and self.available and not self.set_waiting:
            assert reads == 1, (
                f"{where}: {self.drops_followed} batches dropped on the full queue while the "
                f"worker was stuck in one call ({self.hold.kind}) and the backend answered, "
                "and the next step did not read the set")
        return reads


def run_soak(seed: int, *, num_steps: int = NUM_STEPS) -> dict[str, int]:
    """One seed of the soak (module docstring); returns its counters."""
    rng = random.Random(seed)
    knobs = _Knobs.draw(rng)
    index = _ChaosIndex(seed * 7919 + 1, p_fail=knobs.p_fail, p_late=knobs.p_late,
                        p_slow=knobs.p_slow, max_delay_s=knobs.max_delay_s)
    pool = _Pool(seed)
    client, source = _make_client(index, pool, knobs.max_queued_ops)
    stall: _Stall | None = None
    outage_until = -1
    next_settle = rng.randint(*knobs.settle_every)
    counts = dict.fromkeys(("settles", "stalls", "stall_reads", "held_heartbeat",
                            "held_resync", "held_publish"), 0)
    where = f"seed {seed} {knobs}"

    def release(step: int) -> None:
        nonlocal stall
        if stall is not None:
            reads = stall.check(source, f"{where}: step {step}")
            if stall.seen:
                counts["stalls"] += 1
                counts["stall_reads"] += reads
                counts[f"held_{stall.hold.kind}"] += 1
            index.let_go(stall.hold)
            stall = None

    try:
        for step in range(num_steps):
            last = step == num_steps - 1
            settle_now = last or step == next_settle
            # -- the backend's weather
            if stall is not None and (step >= stall.until or settle_now):
                release(step)
            elif stall is not None:
                stall.observe(client, index, source)
            elif not settle_now and rng.random() < knobs.p_hold * (
                    3 if client.resync_pending else 1):  # (holds the probes too)
                only = rng.choice([None, None, None, "heartbeat", "resync"])
                stall = _Stall(index.arm_hold(rng.choice([0, 0, 1, 2]), only),
                               step + rng.randint(3, 40))
            if step == outage_until:
                index.outage = False
            if rng.random() < knobs.p_outage and not settle_now:
                index.outage, outage_until = True, step + rng.randint(3, 30)
            if rng.random() < knobs.p_wipe and not settle_now:
                index.wipe()
            # -- the engine's step
            events: list[Any] = []
            if rng.random() < knobs.p_clear and not settle_now:
                events.append(pool.clear())
            if rng.random() < 0.3:
                event = pool.evict(rng, rng.randint(1, 3))
                if event is not None:
                    events.append(event)
            if rng.random() < 0.15:
                event = pool.cache_again(rng)
                if event is not None:
                    events.append(event)
            if settle_now or rng.random() < 0.6:  # (a settle follows a store: after a wipe,
                # some call must meet the missing registration)
                events.append(pool.cache_chain(rng, rng.randint(1, knobs.max_chain)))
            if rng.random() < 0.1 and not any(isinstance(e, AllBlocksCleared) for e in events):
                rng.shuffle(events)  # evictions before or after the stores of the step
            if index.deferred:
                index.run_deferred(rng)
            client.publish(events)
            # A step's pace; now and then the engine idles past a resync probe (50 ms), which
            # the worker then makes (and a hold may catch).
            time.sleep(rng.uniform(0.01, 0.08) if rng.random() < knobs.p_idle
                       else rng.choice([0.0, 0.0, 0.0002, 0.001]))
            if settle_now:
                index.let_go(None)
                outage_until = -1
                _settle(client, index, pool, source, f"{where}: step {step}")
                counts["settles"] += 1
                next_settle = step + rng.randint(*knobs.settle_every)
        drops = client.stats.publish_batches_dropped_full
        losses = drops + index.losses
        # Invariant 2: each read of the set needs a loss of its own, and the set read before
        # it gone out (its first call made), unless a lapsed registration asked again
        # (module docstring).
        assert source.reads <= losses, (
            f"{where}: the set was read {source.reads} times for {losses} losses "
            f"({drops} dropped on the full queue, {index.losses} calls not answered ok)")
        assert source.reads <= index.resync_calls + index.fenced, (
            f"{where}: the set was read {source.reads} times; {index.resync_calls} resync "
            f"calls were made, {index.fenced} calls answered fenced")
        assert client.resync_pending is False
        counts.update(reads=source.reads, drops=drops, losses=losses,
                      resyncs=client.num_resyncs, calls=index.calls, fenced=index.fenced,
                      **{f"deferred_{k}": v for k, v in index.deferred_ran.items()},
                      max_pool=pool.max_size)
        return counts
    finally:
        index.let_go(stall.hold if stall is not None else None)
        index.outage = False
        client.close(2.0)
        thread = client._worker._thread
        assert thread is not None and not thread.is_alive(), f"{where}: worker left running"


@pytest.fixture
def index_errors(caplog: pytest.LogCaptureFixture):
    """Fails the test on any ERROR record of the index package (the worker thread logs every
    exception it catches at that level: invariant 3)."""
    caplog.set_level(logging.WARNING, logger="kvbridge.connector.index")
    yield
    errors = [record for record in caplog.get_records("call") if record.levelno >= logging.ERROR]
    assert not errors, [record.getMessage() for record in errors]


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_random_interleavings_of_publishes_losses_and_resyncs_settle_to_the_pool(
    seed, index_errors
):
    counts = run_soak(seed)
    assert counts["settles"] >= 2


# ---------------------------------------------------------------------------- reproducers


def test_resync_pending_stays_true_until_the_last_call_of_a_resync_is_sent():
    # ``resync_pending`` reads the worker's state without its lock. ``_take_batches`` once
    # popped a resync's later batch (the queue's whole-set ops down to 0) before it marked the
    # set as in a call: in between, a resync with a batch neither sent nor applied was not
    # "pending". The mark now comes before the pop.
    index = _ChaosIndex(0, p_fail=0.0, p_late=0.0, p_slow=0.0, max_delay_s=0.0)
    pool = _Pool(0)
    client, _ = _make_client(index, pool, max_queued_ops=65536)
    worker = client._worker
    taken, go = threading.Event(), threading.Event()
    take = worker._queue.take

    def take_and_pause(max_ops: int, *, skip_deltas: bool):  # the worker thread, its lock held
        batches, num_dropped = take(max_ops, skip_deltas=skip_deltas)
        if batches and batches[0].of_whole_set and not batches[0].resync and not taken.is_set():
            taken.set()  # the set's second (last) call is out of the queue, not yet sent
            go.wait(10)  # (a thread switch here does the same, for a moment)
        return batches, num_dropped

    worker._queue.take = take_and_pause
    try:
        index.outage = True  # (1) 1,500 blocks cached; the batch is lost: resync mode
        client.publish([pool.cache_chain(random.Random(0), 1500)])
        assert client.flush(5) and client.resync_pending
        index.outage = False
        deadline = time.monotonic() + 10
        while not taken.is_set() and time.monotonic() < deadline:
            client.publish([])  # (2) steps: the set is read, cut in calls of 1,024 + 477 ops
            time.sleep(0.005)
        assert taken.is_set()
        # (3) Its first call landed (the clear and 1,023 blocks); the second is taken from the
        # queue, not sent: 477 cached blocks are not listed, and no resync is "pending".
        assert len(index.node_entries(NODE)) == 1023
        assert client.resync_pending, "resync_pending is False; 477 blocks are not listed yet"
    finally:
        go.set()
        client.close()
