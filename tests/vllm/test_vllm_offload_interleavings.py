"""Offload on eviction (``offload: "evict"``) in vLLM's real ``Scheduler`` (and
``AsyncScheduler``) on CPU under random interleavings (vLLM's unit-test style, no worker:
``_vllm_sched_builders``).

A seeded driver (``random.Random(seed)``) over a node with a small KV cache (63 usable blocks
of 32 tokens, so requests evict one another's blocks and get preempted) mixes: new requests
whose prompts share prefixes of random lengths (several prompt families, some prompts
repeated); aborts at random moments; ``reset_prefix_cache`` (with or without preempting the
running requests); a fake worker whose store settles each offload item held, failed, or late
(1-6 steps later, often after the block was reused or the prefix cache reset), names blocks
as missing (one it held and dropped, one whose write is still queued, any block of a chain),
and sometimes restarts (a new ``store_incarnation``: what it held is gone, its unanswered
writes fail). Each seed also draws ``offload_blocks_per_step``, ``offload_scan_blocks`` and
``offload_remember_blocks``. Under async scheduling one step stays in flight while requests
run. Checked after every step:

- each item a step's orders carry names a block that, as the orders go out (the worker
  snapshots it at that step's start, before its forward), still holds the item's hash, a hash
  the block got in an earlier step (its KV computed by an earlier forward), with the item's
  parent the block's true parent in its chain;
- at most ``offload_blocks_per_step`` items a step; no key sent again while an earlier write of
  it is unanswered, nor while the node was told the store holds it (and must remember it:
  the last ``offload_remember_blocks`` held writes, none from before a store restart);
- what the planner learnt from the pool's events is what the pool caches (the same hashes);
- the store tier's KV events (what vLLM publishes from ``take_events``, medium
  ``KVBRIDGE_STORE``): one ``BlockStored`` per held outcome the step settled, with the block's
  true parent, one ``BlockRemoved`` per missing one, nothing for failed writes.

At the end (every outcome answered, idle steps until the planner has nothing left): the
scheduler is empty, every block free, nothing in flight or due in the planner or pending in
the rank reports, and (with a scan window over the whole pool) every block the pool still
caches is held by the store.

Defects this soak found (fixed), each with a minimal reproducer below:

- a held outcome settled after the pool dropped the block (evicted, or a reset) gave a
  ``BlockStored`` with no parent (the planner had forgotten it; the item carried it);
- an item planned before ``reset_prefix_cache`` went out when the next schedule gave its
  block the same hash again, so the pre-reset KV would have been written;
- two ``update_from_output`` calls in a row (async scheduling) put up to twice
  ``offload_blocks_per_step`` items in the next step's orders.
"""

from __future__ import annotations

import random
from collections import OrderedDict, defaultdict, deque

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from _vllm_sched_builders import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_of,
    make_request,
    model_runner_output,
    worker_report,
)
from kvbridge.connector.metadata import decode_metadata
from kvbridge.connector.vllm.store_events import STORE_MEDIUM
from kvbridge.kvmanager.block_hash import get_block_hash, make_block_hash_with_group_id
from test_vllm_index_scheduler import _namespace, index_node, wait_lookups
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

SEEDS = range(40)
ext = maybe_convert_block_hash


class Soak:
    """One seeded run: the scheduler, the fake worker and store, and the checks."""

    def __init__(self, seed: int, *, blocks_per_step: int | None = None,
                 scan_blocks: int | None = None, async_scheduling: bool = False,
                 remember: int | None = None) -> None:
        self.rng = rng = random.Random(seed)
        self.seed = seed
        self.async_scheduling = async_scheduling
        self.blocks_per_step = blocks_per_step or rng.choice([1, 2, 3, 4, 8])
        self.scan_blocks = scan_blocks or rng.choice([8, 24, 64, 64])
        self.remember = remember or rng.choice([None, None, 2, 8])  # offload_remember_blocks
        self.scheduler = index_node(f"offload-soak-{seed}", _namespace(), extra={
            "store_url": "127.0.0.1:9", "offload": "evict",
            "offload_blocks_per_step": self.blocks_per_step,
            "offload_scan_blocks": self.scan_blocks,
            **({"offload_remember_blocks": self.remember} if self.remember else {})},
            async_scheduling=async_scheduling)
        self.connector = connector_of(self.scheduler)
        self.planner = self.connector._sched().offload_planner
        self.rank_reports = self.connector._sched().rank_reports
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.blocks = self.pool.blocks
        self.published: list = []  # events vLLM publishes this step
        self.scheduler.kv_event_publisher.publish = lambda batch: self.published.extend(
            batch.events)
        # Prompt families: a prompt takes a random number of a family's leading tokens.
        self.families = [[rng.randrange(3, 500) for _ in range(12 * BLOCK_SIZE)]
                         for _ in range(4)]
        self.prompts: list[list[int]] = []  # earlier prompts, to repeat some
        self.parent_of: dict[bytes, bytes] = {}  # true chain: block hash -> parent (b"": root)
        self.last_hash: list = [b.block_hash for b in self.blocks]
        self.hashed_at: dict[int, int] = {}  # block id -> step its current hash was given in
        self.k = 0
        self.live: dict = {}  # request -> how many of its block hashes were learnt
        # the fake store and worker
        self.incarnation = 1
        self.store: set[bytes] = set()  # bare hashes the store holds (group 0 only)
        self.pending: list[tuple[int, int, bytes, bool]] = []  # unanswered writes
        self.in_flight: deque = deque()  # (step, scheduler output, metadata) not reported
        # held outcomes the scheduler was given (this store), the latest last; with
        # ``remember``, the last that many (the planner must remember at least those)
        self.told_held: OrderedDict[bytes, None] = OrderedDict()
        self.restart_due = False
        self.policy = None  # a reproducer's worker: block hash -> (delay in steps, held)
        self.counts: dict[str, int] = defaultdict(int)

    # ------------------------------------------------------------------ workload
    def new_prompt(self) -> list[int]:
        rng = self.rng
        if self.prompts and rng.random() < 0.15:
            return list(rng.choice(self.prompts))
        family = rng.choice(self.families)
        shared = rng.randrange(0, len(family) + 1)
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 5 * BLOCK_SIZE))]
        prompt = (family[:shared] + tail)[:14 * BLOCK_SIZE]
        self.prompts.append(prompt)
        return prompt

    def add_request(self) -> None:
        request = make_request(self.new_prompt(), max_tokens=self.rng.randrange(1, 24))
        self.live[request] = 0
        self.learn_parents()
        self.scheduler.add_request(request)
        self.counts["requests"] += 1

    def learn_parents(self) -> None:
        """The true chain of every block hash the requests have (decoded tokens fill blocks)."""
        for request, seen in list(self.live.items()):
            hashes = request.block_hashes
            for i in range(seen, len(hashes)):
                prev = bytes(hashes[i - 1]) if i else b""
                assert self.parent_of.setdefault(bytes(hashes[i]), prev) == prev
            self.live[request] = len(hashes)
            if request.is_finished():
                del self.live[request]

    def abort_one(self) -> None:
        live = list(self.scheduler.requests)
        if live:
            self.scheduler.finish_requests(self.rng.choice(live), RequestStatus.FINISHED_ABORTED)
            self.counts["aborts"] += 1

    def reset_prefix_cache(self) -> None:
        preempt = self.rng.random() < 0.5
        if self.scheduler.reset_prefix_cache(reset_running_requests=preempt):
            self.counts["resets"] += 1
        self.scan_hashes()

    # ------------------------------------------------------------------ one step
    def step(self, *, finishing: bool = False) -> list:
        """One ``schedule()`` and the reports of the steps then due (under async scheduling
        one step stays in flight while requests run). Returns the step's offload items."""
        items = self.schedule(finishing=finishing)
        keep = 1 if self.async_scheduling and self.scheduler.requests else 0
        while len(self.in_flight) > keep:
            self.report(finishing=finishing)
        return items

    def scan_hashes(self) -> None:
        """Note the step each block got its hash in. (A block vLLM evicts and gives the same
        hash again in one schedule, for a request that did not find it cached past a missing
        ancestor, keeps the KV of that hash: only a reset in between makes it stale.)"""
        for block in self.blocks:
            if block.block_hash != self.last_hash[block.block_id]:
                self.last_hash[block.block_id] = block.block_hash
                if block.block_hash is not None:
                    self.hashed_at[block.block_id] = self.k

    def schedule(self, *, finishing: bool) -> list:
        """schedule() and the checks on its orders; the fake worker takes the items."""
        self.k += 1
        k = self.k
        output = self.scheduler.schedule()
        self.learn_parents()
        self.scan_hashes()
        meta = decode_metadata(output.kv_connector_metadata.payload)
        items = [tuple(item) for item in meta.offload_items]
        self.check_items(items)
        self.check_planner_follows_the_pool()
        self.take_items(items, finishing=finishing)
        # requests whose prompt is still partly uncomputed sample nothing (vLLM's runner)
        requests = self.scheduler.requests
        partial = [rid for rid in output.num_scheduled_tokens if rid in requests
                   and requests[rid].num_computed_tokens < requests[rid].num_tokens]
        self.in_flight.append((k, output, meta, partial))
        return items

    def report(self, *, finishing: bool) -> None:
        """The oldest step in flight comes back: its worker report, update_from_output, the
        checks on the events vLLM published."""
        j, output, meta, partial = self.in_flight.popleft()
        new_store = self.restart_due
        outcomes = self.worker_report(j, finishing=finishing)
        self.published.clear()
        runner_output = model_runner_output(output, worker_meta=worker_report(
            step_id=meta.step_id, store_incarnation=self.incarnation, offload_outcomes=outcomes))
        for rid in partial:
            runner_output.sampled_token_ids[runner_output.req_id_to_index[rid]] = []
        self.scheduler.update_from_output(output, runner_output)
        self.check_events(outcomes)
        self.scan_hashes()  # (vLLM's AsyncScheduler caches blocks its forward computed here)
        for _, block_hash, held, missing in outcomes:
            if missing:
                self.told_held.pop(block_hash, None)
            elif held:
                self.told_held[block_hash] = None
                self.told_held.move_to_end(block_hash)
                while self.remember and len(self.told_held) > self.remember:
                    self.told_held.popitem(last=False)  # as the planner's bounded memory
        if new_store:  # the first report of a new store: every write is forgotten (by design:
            self.told_held.clear()  # those the new store holds are written again, "present")
        wait_lookups(self.scheduler)

    def check_items(self, items: list[tuple]) -> None:
        k = self.k
        where = f"seed {self.seed} step {k}"
        assert len(items) <= self.blocks_per_step, (where, items)
        unanswered = {p[2] for p in self.pending}

        keys = [(g, h) for _, g, h, _ in items]
        assert len(set(keys)) == len(keys), (where, "one key twice in a step", items)
        for block_id, group_id, block_hash, parent_hash in items:
            self.counts["items"] += 1
            key = make_block_hash_with_group_id(block_hash, group_id)
            assert group_id == 0
            # the fence: at the snapshot the block holds the hash, computed by an earlier step
            assert self.blocks[block_id].block_hash == key, (where, "reused", block_id)
            assert self.hashed_at[block_id] < k, (where, "not computed yet", block_id)
            assert self.parent_of[block_hash] == parent_hash, (where, "wrong parent", block_id)
            assert block_hash not in unanswered, (where, "sent again while in flight", block_id)
            assert block_hash not in self.told_held, (where, "sent again while held", block_id)

    def check_planner_follows_the_pool(self) -> None:
        """What the planner learnt from the pool's events (as the orders go out) is what the
        pool caches: the same hashes. (Not the number of blocks holding each: the pool
        follower reports one block per hash, as the index lists them.)"""
        cached = {block.block_hash for block in self.blocks if block.block_hash is not None}
        where = f"seed {self.seed} step {self.k}"
        assert self.planner._num_copies.keys() == cached, (where, "planner vs pool")
        assert self.planner._parent_of.keys() == cached, (where, "planner vs pool")

    def take_items(self, items: list[tuple], *, finishing: bool) -> None:
        """The worker snapshots step ``k``'s items and decides what becomes of each: held or
        failed in the step's own report, or later (``pending``: due step, step, hash, held)."""
        rng, k = self.rng, self.k
        for _, _, block_hash, _ in items:
            r = rng.random()
            if self.policy is not None:  # a reproducer's own answers: (delay, held)
                delay, held = self.policy(block_hash)
                self.pending.append((k + delay, k, block_hash, held))
            elif finishing or r < 0.55:
                self.pending.append((k, k, block_hash, True))
            elif r < 0.7:
                self.pending.append((k, k, block_hash, False))
            else:
                self.pending.append((k + rng.randrange(1, 7), k, block_hash, rng.random() < 0.8))

    def worker_report(self, j: int, *, finishing: bool) -> list[tuple]:
        """Step ``j``'s report: the outcomes due by then of items of steps up to ``j``, a
        missing name now and then; the first after a store restart fails what the old store
        left unanswered."""
        rng = self.rng
        outcomes: list[tuple] = []
        if self.restart_due:  # the report after a restart: the old store's writes are lost
            self.restart_due = False
            for _, origin, block_hash, _ in self.pending:
                if origin <= j:
                    outcomes.append((0, block_hash, False, False))
            self.pending = [p for p in self.pending if p[1] > j]
        due = [p for p in self.pending if p[1] <= j and (p[0] <= j or finishing)]
        self.pending = [p for p in self.pending if p not in due]
        for _, _, block_hash, held in due:
            if held:
                self.store.add(block_hash)
            outcomes.append((0, block_hash, held, False))
            self.counts["held" if held else "failed"] += 1
        in_flight = {p[2] for p in self.pending} | {o[1] for o in outcomes}
        droppable = sorted(self.told_held.keys() & self.store - in_flight)
        if self.policy is not None or finishing:
            return outcomes
        if droppable and rng.random() < 0.08:  # the store dropped a block this node wrote
            block_hash = rng.choice(droppable)
            self.store.discard(block_hash)
            outcomes.append((0, block_hash, False, True))
            self.counts["missing"] += 1
        if self.pending and rng.random() < 0.03:  # it names one whose write is still queued
            block_hash = rng.choice(self.pending)[2]
            self.store.discard(block_hash)
            outcomes.append((0, block_hash, False, True))
            self.counts["missing in flight"] += 1
        if self.parent_of and rng.random() < 0.03:  # any block of a chain (another writer's)
            block_hash = rng.choice(sorted(self.parent_of))
            if block_hash not in in_flight and (0, block_hash, False, True) not in outcomes:
                self.store.discard(block_hash)
                outcomes.append((0, block_hash, False, True))
                self.counts["missing other"] += 1
        return outcomes

    def restart_store(self) -> None:
        """The store restarts empty: the next report carries the new incarnation."""
        self.incarnation += 1
        self.store.clear()
        self.restart_due = True
        self.counts["restarts"] += 1

    def check_events(self, outcomes: list[tuple]) -> None:
        where = f"seed {self.seed} step {self.k}"
        store_events = [e for e in self.published if getattr(e, "medium", None) == STORE_MEDIUM]
        stored = [(e.block_hashes, e.parent_block_hash) for e in store_events
                  if isinstance(e, BlockStored)]
        removed = [e.block_hashes for e in store_events if isinstance(e, BlockRemoved)]
        assert len(stored) + len(removed) == len(store_events), (where, store_events)
        want_stored, want_removed = [], []
        for _, block_hash, held, missing in outcomes:
            if missing:
                want_removed.append([ext(block_hash)])
            elif held:
                parent = self.parent_of[block_hash]
                want_stored.append(([ext(block_hash)], ext(parent) if parent else None))
        assert sorted(map(repr, removed)) == sorted(map(repr, want_removed)), (where, "removed")
        assert sorted(map(repr, stored)) == sorted(map(repr, want_stored)), (
            where, stored, want_stored)

    # ------------------------------------------------------------------ the run
    def run(self, num_steps: int = 200) -> None:
        rng = self.rng
        try:
            for _ in range(num_steps):
                if rng.random() < 0.45:
                    for _ in range(rng.randrange(1, 4)):
                        self.add_request()
                if rng.random() < 0.06:
                    self.abort_one()
                if rng.random() < 0.03 and not self.in_flight:
                    self.reset_prefix_cache()
                if rng.random() < 0.02:
                    self.restart_store()
                self.step()
            self.finish()
        finally:
            self.connector.shutdown()

    def finish(self) -> None:
        for _ in range(400):
            items = self.step(finishing=True)
            if not (self.scheduler.requests or items or self.pending or self.in_flight
                    or self.planner.num_in_flight):
                break
        else:
            raise AssertionError(f"seed {self.seed}: no quiescence")
        assert_scheduler_empty(self.scheduler)
        assert self.planner.num_in_flight == 0
        assert not self.rank_reports._offloads
        assert not self.planner._due and not self.planner._write_through, f"seed {self.seed}"
        if self.scan_blocks >= self.pool.num_gpu_blocks:
            cached = {get_block_hash(b.block_hash) for b in self.blocks if b.block_hash is not None}
            assert cached <= self.store, (f"seed {self.seed}: cached, never offloaded",
                                          len(cached - self.store))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_interleavings_keep_offload_sound(seed, async_scheduling):
    soak = Soak(seed, async_scheduling=async_scheduling)
    soak.run()
    assert soak.counts["items"] > 0, soak.counts


# ---------------------------------------------------------------------- minimal reproducers
def _hashes(request) -> list[bytes]:
    return [bytes(h) for h in request.block_hashes]


def _add(soak: Soak, prompt: list[int], max_tokens: int = 1, *, skip_reading: bool = False):
    """A request of ``prompt``; ``skip_reading``: it never reads the prefix cache (vLLM's
    ``SamplingParams.skip_reading_prefix_cache``, as a prompt-logprobs request), so it is
    scheduled without an index lookup (none is asked for) at the next step."""
    request = make_request(prompt, max_tokens=max_tokens)
    if skip_reading:
        request.sampling_params.skip_reading_prefix_cache = True
        request.skip_reading_prefix_cache = request.get_skip_reading_prefix_cache()
    soak.live[request] = 0
    soak.learn_parents()
    soak.scheduler.add_request(request)
    return request


def _drain(soak: Soak, max_steps: int = 20) -> None:
    for _ in range(max_steps):
        if not soak.scheduler.requests:
            return
        soak.step()
    raise AssertionError("requests left")


def test_late_held_outcome_after_eviction_names_the_block_s_parent():
    """A 2-block prompt finishes; both blocks are planned; the store answers the root at once
    and the child late. Three 31-block prompts evict the child from the pool, then its held
    outcome arrives: the store's ``BlockStored`` must still name the root as its parent."""
    soak = Soak(0, blocks_per_step=2, scan_blocks=64)
    rng = random.Random(1)
    first = _add(soak, [rng.randrange(3, 500) for _ in range(2 * BLOCK_SIZE)])
    root, child = _hashes(first)
    soak.policy = lambda h: (0, True) if h != child else (1000, True)
    try:
        _drain(soak)
        for _ in range(3):
            soak.step()
        assert [p[2] for p in soak.pending] == [child]  # its write is unanswered
        for _ in range(3):
            _add(soak, [rng.randrange(3, 500) for _ in range(31 * BLOCK_SIZE)])
        _drain(soak)
        assert soak.planner.parent_of(0, child) is None  # evicted: the pool forgot it
        soak.pending = [(soak.k + 1, soak.k, child, True)]  # now the store answers: held
        soak.step()
        stored = [e for e in soak.published
                  if isinstance(e, BlockStored) and e.block_hashes == [ext(child)]]
        assert len(stored) == 1 and stored[0].medium == STORE_MEDIUM
        assert stored[0].parent_block_hash == ext(root)  # was None: a chain root
    finally:
        soak.connector.shutdown()


def test_item_planned_before_reset_prefix_cache_is_withdrawn_when_its_block_is_rehashed():
    """F (31 blocks, block ids 1..31) finishes, then two 16-block prompts take the 32 blocks
    never used, so the free queue is F's blocks, last first. F's block 15 is answered failed
    every time, so it is planned again at the end of each step. Then the prefix cache is reset
    (all blocks free) and F's prompt comes again: its 31 blocks are popped from the head, last
    first, so its block 15 lands in the block that held it and gets its hash again in this
    step's schedule, before the forward that computes it: the pending item must not go out."""
    soak = Soak(0, blocks_per_step=4, scan_blocks=64)
    rng = random.Random(2)
    prompt = [rng.randrange(3, 500) for _ in range(31 * BLOCK_SIZE)]
    f = _add(soak, prompt)
    target = _hashes(f)[15]
    soak.policy = lambda h: (0, h != target)
    try:
        _drain(soak)
        for _ in range(2):
            _add(soak, [rng.randrange(3, 500) for _ in range(16 * BLOCK_SIZE)])
        _drain(soak)
        sched = connector_of(soak.scheduler)._sched()
        for _ in range(30):  # idle steps until the rest is held: only the target is planned
            soak.step()
            if [(item[0], item[2]) for item in sched._meta.offload_items] == [(16, target)]:
                break
        else:
            raise AssertionError(sched._meta.offload_items)
        assert soak.scheduler.reset_prefix_cache()  # e.g. new weights: old KV is stale
        soak.scan_hashes()
        _add(soak, prompt, skip_reading=True)
        items = soak.step()  # check_items: the item's block got its hash in this very step
        assert items == []
    finally:
        soak.connector.shutdown()


def test_two_reports_in_a_row_never_put_more_than_blocks_per_step_in_one_step():
    """Async scheduling, ``offload_blocks_per_step`` 1. Two requests of 4 full blocks run and
    finish; as the last one finishes, vLLM's engine core gives back the two steps in flight
    one after the other with no schedule between (``step_with_batch_queue``: nothing left to
    schedule). Each ``update_connector_output`` plans a block, and the next step's orders must
    still carry at most one."""
    soak = Soak(0, blocks_per_step=1, scan_blocks=64, async_scheduling=True)
    rng = random.Random(3)
    soak.policy = lambda h: (0, True)
    try:
        for _ in range(2):
            _add(soak, [rng.randrange(3, 500) for _ in range(4 * BLOCK_SIZE)], max_tokens=2,
                 skip_reading=True)
        for _ in range(12):
            soak.step()  # check_items: at most blocks_per_step items
    finally:
        soak.connector.shutdown()
