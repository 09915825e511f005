"""Randomized interleavings of the block index inside vLLM's real ``Scheduler`` (CPU, no worker).

Two index schedulers A and B on one in-memory index namespace (``test_vllm_index_scheduler``'s
``index_node``), a small KV cache (``SMALL_NUM_BLOCKS``), and a seeded driver
(``random.Random(seed)``) that interleaves: adding requests whose prompts share prefixes of random
lengths with earlier prompts (either engine's; now and then under the id of a request that left);
stepping either engine with a fake worker half that settles each planned pull after a random
delay (landed, failed whole, failed from some block on, failed in random blocks, and failed
wherever the holder no longer caches the block's hash: the holder's re-check); aborting requests
at random moments (lookup pending, pull in flight, running, preempted); ``reset_prefix_cache``
(with and without preempting the running requests); holding the index's lookups late
(``HeldLookups``; in a few seeds past ``index_lookup_timeout_s``). Per seed: ``min_remote_hit_
tokens`` 32, 64 or 256; ``load_mode`` "async" or "auto" (a lone request loads inside its step);
each engine vLLM's ``Scheduler`` or its ``AsyncScheduler`` (the next step scheduled before the
last one is answered); in a quarter of the seeds the hybrid Llama (a sliding-window group and a
full one, the whole 64-block cache: failed pulls reported by request); in a fifth a publish
queue short enough for held lookups to make it drop batches (the node then resyncs).

Invariants, after every operation and at the end:

- the connector never raises (any exception fails the seed);
- after a step and a flush, the index lists for a node exactly what its vLLM pool caches (under
  async scheduling: what it cached at its last ``schedule()``, once every step is answered);
- every pull is of the other engine's blocks, into the request's own blocks for the pulled
  positions (each group's), by the block ids the index answered for the request's hashes (not
  checked for hybrid seeds, whose answers come with the lookup itself); an answer given while
  the holder's entries were in step with its pool names blocks its pool maps to those hashes; a
  request is pulled for at most once;
- a request in WAITING_FOR_REMOTE_KVS always has a pull in flight (or landed, resumed at the
  next ``schedule()``);
- counters: hits <= lookups, hits and hit tokens equal the pulls planned, loads and failed
  loads equal the pulls reported;
- at the end every request finishes, both schedulers are empty, every block is free, and the
  connector's per-request state (matcher, matches, hit tiers, index client lookups) is gone.

Known gaps the soak steps around have reproducers of their own (strict xfail, at the end).
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

import _vllm_sched_builders as builders
from _vllm_sched_builders import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_scheduler_empty,
    connector_of,
    make_request,
    model_runner_output,
    step,
    worker_report,
)
from kvbridge.connector.metadata import PullReport, decode_metadata
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from test_vllm_index_scheduler import (
    HeldLookups,
    _namespace,
    _prompt,
    client_of,
    index_entries,
    index_node,
    ours,
    pool_entries,
    run,
    wait_lookups,
)
from vllm.v1.request import RequestStatus

NUM_SEEDS = 50
NUM_OPS = 150
SMALL_NUM_BLOCKS = 48  # 47 usable: two long prompts fill it (eviction, preemption)


@dataclasses.dataclass
class InFlight:
    """A pull the fake worker half is running: settled at ``due`` (the engine's step count)."""

    request_id: str
    local: list[int]
    remote: list[int]
    keys: list[bytes]  # the request's block hash keys the remote blocks should hold
    holder: str
    due: int
    outcome: str
    planned_in: int  # the step whose orders carry it


class Engine:
    def __init__(self, name: str, scheduler, async_: bool) -> None:
        self.name = name
        self.s = scheduler
        self.async_ = async_
        self.outstanding = None  # (AsyncScheduler) the step scheduled and not answered yet
        self.scheduled_pool: set = set()  # pool_entries as the last schedule() left them
        self.steps = 0
        self.inflight: dict[str, InFlight] = {}
        self.pulled: set[str] = set()  # requests with a pull planned
        self.num_pulls = 0
        self.hit_tokens = 0
        self.num_loads = 0
        self.num_failed_loads = 0
        self.synced = True  # the index's entries for this node equal its pool (checked)
        # the pool changed after the step's batch was taken (a reset): the index hears of it
        # with the next step
        self.dirty = False


class Soak:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        namespace = _namespace()
        self.min_hit = rng.choice([32, 64, 256])
        self.hybrid = rng.random() < 0.25  # a sliding-window group and a full one
        self.load_mode = "async" if self.hybrid else rng.choice(["async", "auto"])
        # a few seeds let held lookups time out (wall-clock: those are not reproducible)
        self.timeout_s = 0.05 if rng.random() < 0.15 else 60.0
        extra = {"min_remote_hit_tokens": self.min_hit, "index_lookup_timeout_s": self.timeout_s,
                 "load_mode": self.load_mode}
        async_ = {name: rng.random() < 0.4 for name in ("a", "b")}
        # a few seeds: a publish queue so short that held lookups make it drop batches
        self.short_queue = rng.random() < 0.2
        # (hybrid: the whole cache, where vLLM's kv_holding_waiting deadlock needs three failed
        # pulls at once: test_two_failed_hybrid_pulls_under_a_small_cache_do_not_deadlock)
        small = builders.NUM_BLOCKS
        builders.NUM_BLOCKS = NUM_BLOCKS if self.hybrid else small
        try:
            self.e = {name: Engine(name, index_node(name, namespace, extra=extra,
                                                    async_scheduling=async_[name],
                                                    hybrid=self.hybrid), async_[name])
                      for name in ("a", "b")}
        finally:
            builders.NUM_BLOCKS = small
        self.prompts: list[list[int]] = []
        if self.short_queue:
            for engine in self.e.values():
                client_of(engine.s)._worker.max_queued_ops = 8
        self.hold: HeldLookups | None = None
        self.hold_until = 0
        self.violations: list[str] = []
        self.num_checked_answers = 0  # answers checked against the holder's pool
        self.answers: dict[tuple[bytes, ...], list[tuple[str, list[int]]]] = {}
        self.log: list[str] = []
        self.preemptions: dict[str, int] = {}
        self.used_ids: dict[str, list[str]] = {"a": [], "b": []}
        self._watch_block_ids()

    # ---------------------------------------------------------------- the index's answers
    def _watch_block_ids(self) -> None:
        """Record every block-id answer of the shared index (its worker threads), and check it
        against the holder's vLLM pool when the holder's entries are in step with it."""
        index = client_of(self.e["a"].s).index
        original = index.get_block_ids
        by_node = {client_of(e.s).node_id: e for e in self.e.values()}

        def get_block_ids(node_id, incarnation, block_hashes, group_ids=(0,)):
            ids = original(node_id, incarnation, block_hashes, group_ids)
            holder = by_node.get(node_id)
            if ids is None or holder is None:
                return ids
            synced = holder.synced
            hashes = tuple(bytes(h) for h in block_hashes)
            self.answers.setdefault(hashes, []).append((node_id, list(ids[0])))
            if synced:
                self.num_checked_answers += 1
                cache = holder.s.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
                for h, block_id in zip(hashes, ids[0], strict=True):
                    blocks = cache.get(make_block_hash_with_group_id(h, 0))
                    held = {} if blocks is None else (
                        blocks if isinstance(blocks, dict) else {blocks.block_id: blocks})
                    if block_id not in held:
                        self.violations.append(
                            f"index answered block {block_id} of {node_id} for a hash its pool "
                            f"maps to {sorted(held)}")
            return ids

        index.get_block_ids = get_block_ids

    # ---------------------------------------------------------------- operations
    def other(self, engine: Engine) -> Engine:
        return self.e["b" if engine.name == "a" else "a"]

    def new_prompt(self) -> list[int]:
        rng = self.rng
        total = rng.choice([rng.randint(40, 300), rng.randint(300, 700), rng.randint(600, 950)])
        if self.hybrid:  # a prompt takes blocks in both groups: two must fit the cache
            total = min(total, 500)
        shared: list[int] = []
        if self.prompts and rng.random() < 0.8:
            base = rng.choice(self.prompts)
            cut = rng.choice([len(base), rng.randint(0, len(base))])
            if rng.random() < 0.5:
                cut -= cut % BLOCK_SIZE
            shared = base[:min(cut, total)]
        tail = [rng.randint(3, 500) for _ in range(max(total - len(shared), 1))]
        prompt = shared + tail
        self.prompts.append(prompt)
        return prompt

    def add(self, engine: Engine) -> None:
        # now and then the id of a request that has left the engine (a client's own ids)
        gone = [rid for rid in self.used_ids[engine.name] if rid not in engine.s.requests]
        # (not while a step is outstanding: its output may name the old one)
        reused = self.rng.choice(gone) if gone and self.rng.random() < 0.15 and \
            engine.outstanding is None else None
        request = make_request(self.new_prompt(), max_tokens=self.rng.randint(1, 6),
                               request_id=reused)
        self.used_ids[engine.name].append(request.request_id)
        if reused is not None:  # its last pull (if any) is history
            engine.pulled.discard(reused)
        self.log.append(f"add {engine.name} {request.request_id} len={request.num_prompt_tokens}")
        engine.s.add_request(request)

    def abort(self, engine: Engine) -> None:
        s = engine.s
        live = [r for r in s.requests.values() if not r.is_finished()]
        if not live:
            return
        pending = connector_of(s)._sched()._index_matcher.pending_request_ids
        pick = self.rng.random()
        preferred = [r for r in live if r.request_id in pending] if pick < 0.3 else \
            [r for r in live if r.request_id in engine.inflight] if pick < 0.6 else live
        request = self.rng.choice(preferred or live)
        self.log.append(f"abort {engine.name} {request.request_id} {request.status.name}")
        s.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)

    def reset(self, engine: Engine) -> None:
        # (vLLM raises when a request it does not preempt holds blocks: one whose remote KV
        # is in flight or landed)
        holding = set(engine.s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks)
        preempt = self.rng.random() < 0.3 and holding <= {
            r.request_id for r in engine.s.running} and engine.outstanding is None
        self.log.append(f"reset {engine.name} preempt={preempt}")
        if engine.s.reset_prefix_cache(reset_running_requests=preempt):
            engine.dirty = True
            engine.synced = False

    def step(self, engine: Engine, *, schedule: bool = True) -> None:
        """One engine step: ``schedule()`` and, at once (vLLM's ``Scheduler``) or after the
        next ``schedule()`` (its ``AsyncScheduler``: one step ahead), ``update_from_output``
        with the fake worker's answer. ``schedule`` False: only the step outstanding is
        answered (the async pipeline drains)."""
        scheduled = None
        if schedule:
            engine.synced = False
            engine.steps += 1
            output = engine.s.schedule()
            engine.scheduled_pool = pool_entries(engine.s)
            meta = decode_metadata(output.kv_connector_metadata.payload)
            for pull in meta.pulls:
                self.planned(engine, pull)
            # a chunk of a prompt samples no token (the async scheduler counts placeholders)
            samples = {rid for rid in output.num_scheduled_tokens
                       if not engine.s.requests[rid].is_prefill_chunk}
            scheduled = (output, meta, engine.steps, samples)
        if not engine.async_:
            self.answer(engine, scheduled)
            return
        if engine.outstanding is not None:
            self.answer(engine, engine.outstanding)
        engine.outstanding = scheduled

    def answer(self, engine: Engine, scheduled) -> None:
        """``update_from_output`` of a scheduled step, with the pulls the fake worker settled
        by then (only those whose orders came with this step or an earlier one)."""
        s = engine.s
        output, meta, number, samples = scheduled
        finished, invalid, failed_requests, reports = [], [], [], []
        for pull in meta.pulls:
            if pull.sync:  # loaded inside this step: its failures come with its output
                flight = engine.inflight.pop(pull.request_id)
                failed = self.settle(flight)
                invalid += failed
                reports.append(PullReport(pull.request_id, len(flight.local), len(failed), 0.0,
                                          0.0))
                engine.num_failed_loads += bool(failed)
                engine.num_loads += not failed
                # The adapter uncaches them; the step's publish ends with their removal
                # (test_a_failed_sync_pull_s_blocks_leave_the_index).
        for rid, flight in list(engine.inflight.items()):
            if flight.due > engine.steps or flight.planned_in > number:
                continue
            del engine.inflight[rid]
            failed = self.settle(flight)
            finished.append(rid)
            if self.hybrid:  # several groups: a failed pull is reported by request
                failed_requests += [rid] if failed else []
            else:
                invalid += failed
            reports.append(PullReport(rid, len(flight.local), len(failed), 0.001, 0.0))
            if failed:
                engine.num_failed_loads += 1
            else:
                engine.num_loads += 1
        self.log.append(f"step {engine.name} #{number} (now {engine.steps}) scheduled="
                        f"{dict(output.num_scheduled_tokens)} pulls="
                        f"{[(p.request_id, p.num_external_tokens) for p in meta.pulls]} "
                        f"settled={finished} invalid={len(invalid)} failed={failed_requests}")
        runner_output = model_runner_output(
            output, finished_recving=finished, invalid_block_ids=invalid,
            failed_recving=failed_requests,
            worker_meta=worker_report(pulls=reports, step_id=meta.step_id))
        runner_output.sampled_token_ids = [[7] if rid in samples else []
                                           for rid in runner_output.req_ids]
        s.update_from_output(output, runner_output)
        for request in s.requests.values():
            self.preemptions[request.request_id] = request.num_preemptions
        engine.dirty = False

    def planned(self, engine: Engine, pull) -> None:
        s, rid = engine.s, pull.request_id
        holder = self.other(engine)
        request = s.requests.get(rid)
        where = f"pull of {rid} on {engine.name}"
        assert request is not None, where
        assert rid not in engine.pulled, f"{where}: a second index pull of one request"
        engine.pulled.add(rid)
        engine.num_pulls += 1
        assert pull.lease is None and not pull.refused, where
        assert not pull.sync or self.load_mode == "auto", where
        assert pull.holder.engine_id == holder.name, where
        assert pull.holder.incarnation == str(client_of(holder.s).incarnation), where
        assert request.status == (RequestStatus.RUNNING if pull.sync else
                                  RequestStatus.WAITING_FOR_REMOTE_KVS), where
        groups = list(pull.groups)
        assert len(groups) == (2 if self.hybrid else 1), where
        # the full-attention group (the last one) holds every pulled position
        local, remote = list(groups[-1].local_block_ids), list(groups[-1].remote_block_ids)
        assert len(local) == len(remote) > 0, where
        assert pull.num_external_tokens == len(local) * BLOCK_SIZE, where
        assert pull.num_external_tokens >= self.min_hit, where
        own = s.kv_cache_manager.get_block_ids(rid)
        start = next(i for i in range(len(own[-1])) if own[-1][i:i + len(local)] == local)
        end = start + len(local)
        assert end <= (request.num_tokens - 1) // BLOCK_SIZE, f"{where}: the last token pulled"
        if not self.hybrid:  # (a hybrid engine's answers come with the lookup: not recorded)
            hashes = tuple(bytes(h) for h in request.block_hashes[:end])
            answers = [ids for node, ids in self.answers.get(hashes, ()) if node == holder.name]
            assert any(ids[start:end] == remote for ids in answers), \
                f"{where}: remote ids {remote} not in the index's answers {answers}"
        engine.hit_tokens += pull.num_external_tokens
        outcome = self.rng.choices(["ok", "all", "suffix", "some"], [0.55, 0.15, 0.15, 0.15])[0]
        due = engine.steps + self.rng.choice([0, 0, 1, 1, 2, 3, 6])
        all_local, all_remote, keys = [], [], []
        for g, group in enumerate(groups):  # a window group: the blocks its window reaches
            g_local, g_remote = list(group.local_block_ids), list(group.remote_block_ids)
            assert len(g_local) == len(g_remote), where
            assert g_local == list(own[g][end - len(g_local):end]), where
            all_local += g_local
            all_remote += g_remote
            keys += [make_block_hash_with_group_id(bytes(h), g)
                     for h in request.block_hashes[end - len(g_local):end]]
        engine.inflight[rid] = InFlight(rid, all_local, all_remote, keys, holder.name, due,
                                        outcome, engine.steps)

    def settle(self, flight: InFlight) -> list[int]:
        """The local blocks of ``flight`` that did not land."""
        rng, n = self.rng, len(flight.local)
        blocks = self.e[flight.holder].s.kv_cache_manager.block_pool.blocks
        failed = {i for i in range(n) if blocks[flight.remote[i]].block_hash != flight.keys[i]}
        if flight.outcome == "all":
            failed = set(range(n))
        elif flight.outcome == "suffix":
            failed |= set(range(rng.randrange(n), n))
        elif flight.outcome == "some":
            failed |= set(rng.sample(range(n), rng.randint(1, n)))
        return [flight.local[i] for i in sorted(failed)]

    def start_hold(self, at: int) -> None:
        self.log.append("hold")
        self.hold = HeldLookups(self.e["a"].s)
        self.hold_until = at + self.rng.randint(1, 6)

    def release(self) -> None:
        if self.hold is not None:
            self.log.append("release")
            self.hold.release()
            self.hold = None

    # ---------------------------------------------------------------- invariants
    def check(self) -> None:
        assert not self.violations, self.violations
        for engine in self.e.values():
            s = engine.s
            for request in s.requests.values():
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    # (a landed pull's request resumes at the next schedule())
                    assert request.request_id in engine.inflight or \
                        request.request_id in s.finished_recving_kv_req_ids, \
                        f"{request.request_id} on {engine.name} waits for KV no pull brings"
            stats = connector_of(s).stats.snapshot()
            assert stats["num_index_hits"] <= stats["num_index_lookups"]
            assert stats["num_index_hits"] == engine.num_pulls, engine.name
            assert stats["remote_hit_tokens"] == engine.hit_tokens, engine.name
            assert (stats["num_loads"], stats["num_failed_loads"]) == (
                engine.num_loads, engine.num_failed_loads), engine.name
        if self.hold is not None:
            return  # the index's worker threads are held: nothing is answered or published
        for engine in self.e.values():
            wait_lookups(engine.s)
            assert client_of(engine.s).flush()
        for engine in self.e.values():
            client = client_of(engine.s)
            if client.resync_pending:  # a dropped batch: the next step's publish resyncs
                engine.synced = False
                continue
            if engine.dirty or engine.outstanding is not None:
                continue
            listed, cached = index_entries(engine.s), pool_entries(engine.s)
            if engine.async_:
                # What vLLM cached in update_from_output since the last schedule() is published
                # after the next one (test_under_async_scheduling_the_blocks_a_request_s_...).
                assert listed == engine.scheduled_pool, engine.name
            else:
                assert listed == cached, engine.name
            engine.synced = listed == cached

    # ---------------------------------------------------------------- driver
    def run(self, num_ops: int) -> None:
        rng = self.rng
        ops = ["add", "step", "abort", "reset", "hold"]
        weights = [0.3, 0.5, 0.08, 0.03, 0.03]
        for i in range(num_ops):
            engine = self.e[rng.choice("ab")]
            op = rng.choices(ops, weights)[0]
            if self.hold is not None and i >= self.hold_until:
                self.release()
            if op == "add":
                self.add(engine)
            elif op == "step":
                if self.hold is not None and self.timeout_s < 1:
                    time.sleep(self.timeout_s)  # the held lookups run past their deadline
                self.step(engine, schedule=not engine.async_ or rng.random() < 0.8)
            elif op == "abort":
                self.abort(engine)
            elif op == "reset":
                self.reset(engine)
            elif self.hold is None:
                self.start_hold(i)
            self.check()
        self.drain()

    def drain(self, max_steps: int = 200) -> None:
        self.release()
        self.check()
        for _ in range(max_steps):
            if not any(e.s.requests for e in self.e.values()):
                break
            for engine in self.e.values():
                if engine.s.requests:
                    self.step(engine)
                    self.check()
        for engine in self.e.values():
            if engine.outstanding is not None:
                self.step(engine, schedule=False)
                self.check()
        for engine in self.e.values():
            assert not engine.s.requests, f"unfinished on {engine.name}: {engine.s.requests}"
            assert not engine.inflight
        self.check()
        for engine in self.e.values():
            assert_scheduler_empty(engine.s)
            half = connector_of(engine.s)._sched()
            matcher = half._index_matcher
            assert not (matcher._live or matcher._lookups or matcher._pulled
                        or matcher._answered), engine.name
            assert not (half._matches or half._waiting), engine.name
            assert not connector_of(engine.s)._hit_tiers, engine.name
            assert not client_of(engine.s)._key_to_lookup, engine.name

    def close(self) -> None:
        self.release()
        for engine in self.e.values():
            connector_of(engine.s).shutdown()


@pytest.fixture
def small_cache(monkeypatch):
    monkeypatch.setattr(builders, "NUM_BLOCKS", SMALL_NUM_BLOCKS)


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_random_interleavings_keep_the_index_and_the_schedulers_sound(seed, small_cache):
    soak = Soak(seed)
    try:
        soak.run(NUM_OPS)
    except BaseException:
        print("\n".join(soak.log[-60:]))
        raise
    finally:
        soak.close()


# ------------------------------------------------------------------ reproducers
def test_a_failed_sync_pull_s_blocks_leave_the_index():
    # vLLM caches a sync load's blocks when it allocates them, so the step's batch (taken
    # before the forward) lists them; the step's publish, made with the load's outcome, ends
    # with the unwritten ones' removal (before, the index listed them until the engine's next
    # step: forever once it went idle)
    namespace = _namespace()
    a = index_node("a", namespace)
    b = index_node("b", namespace, extra={"load_mode": "sync"})
    try:
        shared = _prompt(81, 320)
        run(a, make_request(shared, max_tokens=1))  # A caches 10 blocks
        request = make_request(shared + _prompt(82, 20), max_tokens=2)
        b.add_request(request)
        step(b, **ours())
        wait_lookups(b)
        output = b.schedule()  # the pull of A's 10 blocks, loaded inside this step
        (pull,) = decode_metadata(output.kv_connector_metadata.payload).pulls
        assert pull.sync
        unwritten = list(pull.groups[0].local_block_ids)[6:]  # 4 blocks do not land
        b.update_from_output(output, model_runner_output(
            output, invalid_block_ids=unwritten, worker_meta=worker_report()))
        b.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)  # B goes idle
        assert client_of(b).flush()
        pool = {block_id for _, _, block_id in pool_entries(b)}
        assert not pool & set(unwritten)  # vLLM's pool no longer caches them
        listed = {block_id for _, _, block_id in index_entries(b)}
        assert not listed & set(unwritten), "the index lists blocks whose KV was never written"
    finally:
        for scheduler in (a, b):
            assert_scheduler_empty(scheduler)
            connector_of(scheduler).shutdown()


def test_under_async_scheduling_the_blocks_a_request_s_last_tokens_fill_reach_the_index():
    # vLLM caches the blocks a step's sampled tokens fill in update_from_output, after the
    # step's batch was taken. vLLM's engine loop steps while has_requests(), which stays true
    # for one step after a request finishes (has_finished_requests): that step's batch takes
    # them to the worker half and, with its report, to the index. (This test once stopped
    # stepping when no request was left, which vLLM does not, and was an xfail for it.)
    a = index_node("a", _namespace(), async_scheduling=True)

    def answer(output) -> None:
        meta = decode_metadata(output.kv_connector_metadata.payload)
        runner_output = model_runner_output(
            output, worker_meta=worker_report(step_id=meta.step_id))
        runner_output.sampled_token_ids = [[7] for _ in runner_output.req_ids]
        a.update_from_output(output, runner_output)

    try:
        # 59 + 6 tokens: the KV of 64 is computed, the second block is filled by the last step
        a.add_request(make_request(_prompt(83, 59), max_tokens=6))
        outstanding = None
        for _ in range(12):  # as vLLM's batch queue: step N + 1 scheduled before N's answer
            if not a.has_requests() and outstanding is None:
                break
            scheduled = a.schedule() if a.has_requests() else None
            if outstanding is not None:
                answer(outstanding)
            outstanding = scheduled
        assert not a.requests and not a.has_requests()
        assert client_of(a).flush()
        assert len(pool_entries(a)) == 2  # vLLM caches both full blocks
        assert index_entries(a) == pool_entries(a), "the second block is never published"
    finally:
        assert_scheduler_empty(a)
        connector_of(a).shutdown()


def test_a_dropped_publish_batch_is_repaired_while_the_engine_is_idle():
    # A batch dropped because the publish queue was full (the index's thread busy, the backend
    # answering) makes the index want the node's cached set at once, so the next step's
    # publish reads it: here the step vLLM's loop takes after the last request finished
    # (has_requests: has_finished_requests). Before, the set was wanted only after the index
    # thread's next probe of the backend, by when the engine had gone idle.
    namespace = _namespace()
    a = index_node("a", namespace)
    try:
        client_of(a)._worker.max_queued_ops = 8  # (65536 by default)
        held = HeldLookups(a)
        asking = make_request(_prompt(85, 400), max_tokens=1)
        a.add_request(asking)
        step(a, **ours())
        assert held.arrived.wait(5.0)  # A's index thread is busy with the held lookup
        for seed in (86, 87):  # 9 blocks each: the second batch finds the queue full
            computed = make_request(_prompt(seed, 300), max_tokens=1)
            computed.skip_reading_prefix_cache = True
            a.add_request(computed)
            step(a, **ours())
        assert client_of(a).stats.publish_batches_dropped_full == 1
        a.finish_requests(asking.request_id, RequestStatus.FINISHED_ABORTED)  # no request left
        for _ in range(4):  # vLLM's engine loop
            if not a.has_requests():
                break
            step(a, **ours())
        assert not a.has_requests()  # idle
        held.release()
        assert client_of(a).flush()
        assert not client_of(a).resync_pending
        assert len(pool_entries(a)) == 18
        assert index_entries(a) == pool_entries(a), "the dropped blocks are never published"
    finally:
        assert_scheduler_empty(a)
        connector_of(a).shutdown()


@pytest.mark.xfail(strict=True, reason="vLLM's scheduler: a request whose async load failed "
                   "whole gives its blocks back but stays at the head of kv_holding_waiting; "
                   "too big for the free blocks, it blocks the queue (FCFS break), and the "
                   "failed load behind it never gives back the blocks it waits for")
def test_two_failed_hybrid_pulls_under_a_small_cache_do_not_deadlock(small_cache):
    namespace = _namespace()
    a, b = (index_node(name, namespace, hybrid=True) for name in ("a", "b"))
    try:
        prefixes = [_prompt(90 + i, 320) for i in range(2)]
        for prefix in prefixes:  # A caches both 10-block prefixes
            run(a, make_request(prefix, max_tokens=1))
        pulled = [make_request(prefix + _prompt(92 + i, 260), max_tokens=1)  # 580 tokens
                  for i, prefix in enumerate(prefixes)]
        for request in pulled:
            b.add_request(request)
        step(b, **ours())
        wait_lookups(b)
        answered = step(b, **ours())
        assert sorted(p.request_id for p in answered.meta.pulls) == sorted(
            r.request_id for r in pulled)
        ids = [r.request_id for r in pulled]  # both pulls fail whole (the holder refused)
        step(b, **ours(finished_recving=ids, failed_recving=ids))
        for _ in range(20):
            if not b.requests:
                break
            step(b, **ours())
        assert not b.requests, {r: b.requests[r].status.name for r in b.requests}
    finally:
        for scheduler in (a, b):
            connector_of(scheduler).shutdown()
