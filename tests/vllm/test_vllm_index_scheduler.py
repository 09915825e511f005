"""The block index inside vLLM's real ``Scheduler`` on CPU (vLLM's unit-test style, no worker).

Two schedulers of one process, A and B, both ``kv_both`` with ``index_url: "memory"`` (the
embedded index every node of a process shares per namespace; each test uses a namespace of its
own), each with a fake worker handshake and hand-made worker answers (``_vllm_sched_builders``).
What is checked:

- publish: A's index entries are exactly the blocks vLLM's pool caches, block ids included,
  through caching, eviction and ``reset_prefix_cache``; a step's hash changes travel to the
  worker half with the step's orders; vLLM's own KV events still reach vLLM's publisher;
- lookup: B's new request asks the index asynchronously and waits (``None``) while B's other
  requests run; the answer is used a step later: a pull of A's blocks by A's block ids, counted
  as a ``P2P`` external hit; blocks that fail to land are recomputed from the first of them;
- abort and preemption while a lookup is pending and while a pull is in flight.

After every scenario both schedulers are empty and every block is free.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from _vllm_sched_builders import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_of,
    make_request,
    make_scheduler,
    model_runner_output,
    step,
    worker_report,
)
from kvbridge.connector.errors import KVTransferConfigError
from kvbridge.connector.metadata import decode_metadata
from kvbridge.connector.vllm.request_view import RequestView
from kvbridge.kvmanager import BlockStored as KVBridgeBlockStored
from kvbridge.kvmanager.block_hash import get_block_hash, get_group_id
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

_incarnations = itertools.count(time.time_ns())
_ports = itertools.count(47100)
_namespaces = itertools.count()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _namespace() -> str:
    return f"index-sched-{next(_namespaces)}-{time.time_ns()}"


def index_node(engine_id: str, namespace: str, *, extra: dict | None = None, **kwargs):
    """A ``kv_both`` vLLM scheduler with the in-process index under ``namespace`` (``extra``:
    more ``kv_connector_extra_config``). The tests step it by hand and wait for its lookups
    themselves (``wait_lookups``), so by default it never waits for one on its own
    (``idle_lookup_wait_s`` 0: an idle step, or a request alone in the engine, is answered a
    step later), and every hit is pulled over later steps (``load_mode`` "async": under
    "auto" a request alone in the engine loads inside the step computing it); the tests of
    those waits and loads set them."""
    return make_scheduler(
        "kv_both", engine_id=engine_id, policy="recompute",
        extra={"index_url": "memory", "model_name": namespace, "index_ttl_s": 60.0,
               "idle_lookup_wait_s": 0.0, "load_mode": "async", **(extra or {})},
        incarnation=str(next(_incarnations)), worker_port=next(_ports), **kwargs)


def client_of(scheduler):
    client = connector_of(scheduler)._sched().index_client
    assert client is not None
    return client


def ours(**kv):
    """A step with the worker half's (empty) report, so vLLM hands the connector its output."""
    return {"worker_meta": worker_report(), **kv}


def run(scheduler, *requests, max_steps: int = 40) -> list:
    """Add ``requests`` and step until none is left; then wait until the node's publishes have
    reached the index. Returns the steps."""
    for request in requests:
        scheduler.add_request(request)
    steps = []
    for _ in range(max_steps):
        if not scheduler.requests:
            break
        steps.append(step(scheduler, **ours()))
        wait_lookups(scheduler)
    assert not scheduler.requests, f"unfinished: {list(scheduler.requests)}"
    assert client_of(scheduler).flush()
    return steps


def wait_lookups(scheduler, timeout_s: float = 5.0) -> None:
    """Until the node's index worker has answered every lookup it was given."""
    client = client_of(scheduler)
    deadline = time.monotonic() + timeout_s
    while client.num_lookups_in_flight:
        assert time.monotonic() < deadline, "index lookups unanswered"
        time.sleep(0.002)


def index_entries(scheduler) -> set[tuple[int, bytes, int]]:
    """``(group id, block hash key, block id)`` the index lists for the node."""
    client = client_of(scheduler)
    return client.index.node_entries(client.node_id) or set()


def pool_entries(scheduler) -> set[tuple[int, bytes, int]]:
    """The same for what vLLM's pool caches: each key with the first block holding it."""
    key_len = client_of(scheduler).index.namespace.key_hash_bytes
    pool = scheduler.kv_cache_manager.block_pool
    entries = set()
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        block = blocks if not isinstance(blocks, dict) else next(iter(blocks.values()))
        entries.add((get_group_id(key), get_block_hash(key)[:key_len], block.block_id))
    return entries


def block_ids(scheduler, request) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])


class HeldLookups:
    """Holds every lookup of a namespace's in-process index until ``release()`` (the answer
    is late: the scheduler must go on without it meanwhile)."""

    def __init__(self, scheduler) -> None:
        self._index = client_of(scheduler).index
        self.arrived = threading.Event()
        self._released = threading.Event()
        # one lookup, or the lookups queued together (longest_prefixes)
        for name in ("longest_prefix", "longest_prefixes"):
            setattr(self._index, name, self._held(getattr(self._index, name)))

    def _held(self, original):
        def held(*args, **kwargs):
            self.arrived.set()
            self._released.wait(10.0)
            return original(*args, **kwargs)

        return held

    def release(self) -> None:
        self._released.set()
        del self._index.longest_prefix  # the shared index object answers at once again
        del self._index.longest_prefixes


def held_lookup(a, b, seed: int, tail: int):
    """A caches a 10-block prefix; B gets it with ``tail`` more tokens (one output token) and
    steps once: B's lookup is out and held (``HeldLookups``). Returns (held, request, the
    step)."""
    shared = _prompt(seed, 320)
    _cached_on_a(a, shared)
    held = HeldLookups(b)
    request = make_request(shared + _prompt(seed + 1, tail), max_tokens=1)
    b.add_request(request)
    first = step(b, **ours())
    assert held.arrived.wait(5.0)
    return held, request, first


@pytest.fixture
def pair():
    namespace = _namespace()
    a, b = index_node("a", namespace), index_node("b", namespace)
    yield a, b
    for scheduler in (a, b):
        assert_scheduler_empty(scheduler)
        connector_of(scheduler).shutdown()


# ------------------------------------------------------------------ publish
def test_the_index_lists_exactly_what_vllm_caches_through_eviction_and_reset(pair):
    a, _ = pair
    steps = run(a, make_request(_prompt(1, 300), max_tokens=2))
    # 300 prompt + 2 tokens: 9 full blocks, each published with the block id vLLM gave it; the
    # hash changes went to the worker half with the orders of the step that cached them.
    stored = [bid for s in steps for bid in s.meta.block_hashes.stored_block_ids]
    assert sorted(stored) == sorted(bid for _, _, bid in pool_entries(a))
    assert len(stored) == 9
    assert index_entries(a) == pool_entries(a)

    p1_blocks = set(stored)

    # Two 990-token prompts of 31 blocks each (30 full, cached): the second finds 63 - 9 - 30
    # = 24 blocks that hold no hash and takes the other 7 from the cold end of vLLM's free
    # queue, p1's cached blocks; the index drops exactly those.
    run(a, make_request(_prompt(2, 990), max_tokens=1))
    steps = run(a, make_request(_prompt(3, 990), max_tokens=1))
    removed = [bid for s in steps for bid in s.meta.block_hashes.removed_block_ids]
    assert len(removed) == 7 and set(removed) <= p1_blocks
    assert index_entries(a) == pool_entries(a)

    # reset_prefix_cache: the next step tells the worker half and the index to drop them all.
    assert a.reset_prefix_cache()
    reset = step(a, **ours())
    assert reset.meta.block_hashes.cleared
    assert client_of(a).flush()
    assert index_entries(a) == pool_entries(a) == set()


def test_other_weights_under_one_served_model_name_never_share_blocks(tmp_path):
    """Engines that name their model alike (``model_name``: vLLM's served model name) but load
    other weights from a local path (a fine-tune: other bytes over a run of its weights file)
    are told apart by the revision made of their bytes: B finds none of A's blocks. A copy of
    A's checkpoint at another path is the same weights: C pulls A's blocks. (Before, every
    local path had revision "", and B pulled A's KV: wrong tokens, no error.)"""
    import shutil

    from kvbridge.connector.serve.demo import tiny_checkpoint

    base = tiny_checkpoint.tiny_llama()
    copy, tuned = (shutil.copytree(base, tmp_path / name) for name in ("copy", "tuned"))
    (weights,) = Path(tuned).glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    run_len = len(data) // 500
    data[len(data) // 2:len(data) // 2 + run_len] = bytes(run_len)
    weights.write_bytes(bytes(data))
    namespace = _namespace()
    a = index_node("a", namespace)
    b = index_node("b", namespace, model=str(tuned))
    c = index_node("c", namespace, model=str(copy))
    revisions = [connector_of(s).config.model_revision for s in (a, b, c)]
    assert revisions[0] == revisions[2] != revisions[1] and revisions[1].startswith("local-")
    try:
        shared = _prompt(41, 10 * BLOCK_SIZE)  # (past min_remote_hit_tokens)
        run(a, make_request(shared, max_tokens=1))
        pulled = {}
        for name, scheduler in (("b", b), ("c", c)):
            request = make_request([*shared, *_prompt(42, 20)], max_tokens=1)
            scheduler.add_request(request)
            step(scheduler, **ours())
            wait_lookups(scheduler)
            answered = step(scheduler, **ours())
            pulled[name] = [(p.holder.engine_id, p.num_external_tokens)
                            for p in answered.meta.pulls]
            if pulled[name]:  # (the fake worker says the pull landed)
                step(scheduler, **ours(finished_recving=[request.request_id]))
            run(scheduler)
        assert pulled == {"b": [], "c": [("a", 10 * BLOCK_SIZE)]}, pulled
    finally:
        for scheduler in (a, b, c):
            assert_scheduler_empty(scheduler)
            connector_of(scheduler).shutdown()


def test_the_block_events_are_built_after_the_step_not_inside_schedule(pair, monkeypatch):
    # Inside vLLM's schedule() the connector only takes the pool's changes and the holder's
    # hash delta; the BlockStored events the index reads are built after the forward (in
    # update_from_output), where they are published.
    a, _ = pair
    built: list[bool] = []  # for each BlockStored built: was it inside schedule()?
    inside = [False]
    init = KVBridgeBlockStored.__init__

    def counted_init(self, *args, **kwargs):
        built.append(inside[0])
        init(self, *args, **kwargs)

    monkeypatch.setattr(KVBridgeBlockStored, "__init__", counted_init)
    schedule = a.schedule

    def marked_schedule(*args, **kwargs):
        inside[0] = True
        try:
            return schedule(*args, **kwargs)
        finally:
            inside[0] = False

    a.schedule = marked_schedule
    steps = run(a, make_request(_prompt(5, 300), max_tokens=2))
    assert built and not any(built)
    assert sum(len(s.meta.block_hashes.stored_block_ids) for s in steps) == 9
    assert index_entries(a) == pool_entries(a)


def _reported(scheduler, output):
    """``update_from_output`` with the report a worker half sends at the end of ``output``'s
    step: it names the step its orders came from (``step_id``)."""
    meta = decode_metadata(output.kv_connector_metadata.payload)
    scheduler.update_from_output(
        output, model_runner_output(output, worker_meta=worker_report(step_id=meta.step_id)))


def test_under_async_scheduling_a_step_s_blocks_are_published_after_its_own_forward():
    # vLLM's AsyncScheduler (its default on a GPU) schedules step N + 1 before step N's output
    # comes back, and allocate_slots hashes N + 1's new full blocks as it schedules them:
    # published with step N's output, they would be listed while N + 1's forward has not yet
    # computed their KV (a peer's pull of them would fail the holder's re-check and recompute).
    # Each step's orders are numbered; a step is published once a report names it.
    a = index_node("a-async", _namespace(), async_scheduling=True)
    try:
        first, second = (make_request(_prompt(seed, 300), max_tokens=2) for seed in (61, 62))
        a.add_request(first)
        _reported(a, a.schedule())  # (first's index lookup: a miss)
        wait_lookups(a)
        a.add_request(second)
        step_n = a.schedule()  # first's prefill; second's lookup
        wait_lookups(a)
        step_n1 = a.schedule()  # second's prefill, before step N's output (the batch queue)
        meta_n, meta_n1 = (decode_metadata(out.kv_connector_metadata.payload)
                           for out in (step_n, step_n1))
        assert meta_n1.step_id == meta_n.step_id + 1
        blocks_n = set(meta_n.block_hashes.stored_block_ids)
        blocks_n1 = set(meta_n1.block_hashes.stored_block_ids)
        assert len(blocks_n) == len(blocks_n1) == 9 and not blocks_n & blocks_n1
        _reported(a, step_n)
        assert client_of(a).flush()
        assert {block_id for _, _, block_id in index_entries(a)} == blocks_n
        _reported(a, step_n1)
        assert client_of(a).flush()
        assert index_entries(a) == pool_entries(a)
        for _ in range(8):  # to the end, each step reported as its worker would
            if a.requests:
                _reported(a, a.schedule())
        assert client_of(a).flush()
        assert index_entries(a) == pool_entries(a)
    finally:
        assert_scheduler_empty(a)
        connector_of(a).shutdown()


def test_under_async_scheduling_a_lone_request_s_failed_hit_is_pulled_over_steps_and_recomputed():
    # Under async scheduling vLLM cannot take a failed in-step load back: it skips the failed
    # request's output but keeps the placeholder of the step scheduled meanwhile, and the
    # request never finishes (load_modes.py). So "auto" pulls even a lone request's hit over
    # later steps there; the failure is then a recompute, and the engine ends empty.
    namespace = _namespace()
    a = index_node("a", namespace)
    b = index_node("b", namespace, extra={"idle_lookup_wait_s": 0.3, "load_mode": "auto"},
                   async_scheduling=True)
    try:
        shared = _prompt(56, 320)
        _cached_on_a(a, shared)
        lone = make_request(shared + _prompt(57, 45), max_tokens=3)
        b.add_request(lone)
        step_n = b.schedule()  # (the arrival step waits for the answer: it is alone)
        meta = decode_metadata(step_n.kv_connector_metadata.payload)
        (pull,) = meta.pulls
        assert (pull.request_id, pull.sync, pull.num_external_tokens) == (
            lone.request_id, False, 320)
        assert step_n.num_scheduled_tokens == {}
        other = make_request(_prompt(58, 100), max_tokens=2)
        b.add_request(other)
        step_n1 = b.schedule()  # before step N's output comes back
        # Every block the pull was to write is refused by the holder.
        b.update_from_output(step_n, model_runner_output(
            step_n, worker_meta=worker_report(step_id=meta.step_id),
            finished_recving=[lone.request_id],
            invalid_block_ids=pull.groups[0].local_block_ids))
        assert lone.request_id not in step_n1.num_scheduled_tokens
        _reported(b, step_n1)
        resumed = []
        for _ in range(12):
            if b.requests:
                out = b.schedule()
                resumed.append(out.num_scheduled_tokens.get(lone.request_id))
                _reported(b, out)
                wait_lookups(b)
        assert not b.requests and not connector_of(b)._sched()._index_matcher._live
        assert next(filter(None, resumed)) == 365  # recomputed from its first token
        assert client_of(b).flush()
        assert index_entries(b) == pool_entries(b)
    finally:
        for scheduler in (a, b):
            assert_scheduler_empty(scheduler)
            connector_of(scheduler).shutdown()


def test_under_async_scheduling_load_mode_sync_is_refused_at_start():
    with pytest.raises(KVTransferConfigError, match="--no-async-scheduling"):
        index_node("b", _namespace(), extra={"load_mode": "sync"}, async_scheduling=True)


def test_requests_without_params_are_read_as_they_are(pair, monkeypatch):
    # vLLM asks about every waiting request at every step: one without kv_transfer_params is
    # looked up, allocated and finished on vLLM's own Request (no RequestView built per call)
    # when the index has nothing for it; a hit still gets its view (the pull tests below).
    a, _ = pair
    viewed: list[str] = []
    view_of = RequestView.of
    monkeypatch.setattr(RequestView, "of",
                        staticmethod(lambda request: viewed.append(request.request_id)
                                     or view_of(request)))
    run(a, *(make_request(_prompt(20 + i, 100), max_tokens=2) for i in range(3)))
    assert connector_of(a).stats.snapshot()["num_index_lookups"] == 3
    assert viewed == []


def test_vllm_s_own_kv_events_still_reach_its_publisher():
    scheduler = index_node("a", _namespace(), kv_events=True)
    batches = []
    scheduler.kv_event_publisher.publish = batches.append  # vLLM's publisher for KV events
    try:
        run(scheduler, make_request(_prompt(4, 300), max_tokens=2))
        published = [h for batch in batches for e in batch.events
                     if isinstance(e, VllmBlockStored) for h in e.block_hashes]
        assert len(published) == 9  # every block vLLM cached, in vLLM's own events
        assert index_entries(scheduler) == pool_entries(scheduler)
        assert connector_of(scheduler).take_events() == ()  # none of kvbridge's added to them
        assert_scheduler_empty(scheduler)
    finally:
        connector_of(scheduler).shutdown()


@pytest.mark.parametrize(("algo", "seed", "refused"), [
    ("xxhash", None, True), ("xxhash_cbor", None, True), ("xxhash", "0", False),
    ("sha256", None, False),
])
def test_an_engine_whose_hashes_no_other_can_match_refuses_the_index_at_start(
        monkeypatch, algo, seed, refused):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    if refused:
        with pytest.raises(KVTransferConfigError, match="set PYTHONHASHSEED"):
            index_node("a", _namespace(), hash_algo=algo)
        return
    scheduler = index_node("a", _namespace(), hash_algo=algo)
    connector_of(scheduler).shutdown()


# ------------------------------------------------------------------ lookups
def _cached_on_a(a, prompt_tokens: list[int]) -> list[int]:
    """A serves the prompt; returns the ids of the blocks A caches its full blocks in."""
    request = make_request(prompt_tokens, max_tokens=1)
    run(a, request)
    pool = a.kv_cache_manager.block_pool
    full = request.block_hashes[: len(prompt_tokens) // BLOCK_SIZE]
    return [pool.get_cached_block(h, [0])[0].block_id for h in full]


def test_a_pending_lookup_waits_without_holding_up_others_and_pulls_a_step_later(pair):
    a, b = pair
    shared = _prompt(5, 320)  # 10 full blocks on A
    a_ids = _cached_on_a(a, shared)
    running = make_request(_prompt(6, 40), max_tokens=6)  # B's other work
    b.add_request(running)
    # Too short for any hit to reach min_remote_hit_tokens: never waits for the index.
    assert step(b, **ours()).scheduled == {running.request_id: 40}

    held = HeldLookups(b)
    request = make_request(shared + _prompt(7, 45), max_tokens=2)  # 365 tokens, 11 full blocks
    b.add_request(request)
    waiting = step(b, **ours())
    # The lookup is out: the request waits (vLLM asks again next step), the other one runs.
    assert held.arrived.wait(5.0)
    assert waiting.scheduled == {running.request_id: 1}
    assert request.status == RequestStatus.WAITING and not waiting.meta.pulls
    again = step(b, **ours())
    assert again.scheduled == {running.request_id: 1} and not again.meta.pulls
    held.release()
    wait_lookups(b)

    answered = step(b, **ours())
    # A holds the first 10 blocks: B pulls them into its own blocks, A's ids paired by position
    # (the last prompt token is never planned: B computes the 45-token tail itself).
    (pull,) = answered.meta.pulls
    assert (pull.request_id, pull.holder.engine_id, pull.lease) == (request.request_id, "a", None)
    assert pull.num_external_tokens == 320
    (group,) = pull.groups
    assert list(group.remote_block_ids) == a_ids
    assert list(group.local_block_ids) == block_ids(b, request)[:10]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # vLLM's metrics of the step: the external hit is another engine's (P2P).
    (outputs,) = answered.engine_outputs.values()
    assert outputs.scheduler_stats.connector_prefix_cache_stats.hits_by_source == {
        CacheHitSource.P2P: 320}

    landed = step(b, **ours(finished_recving=[request.request_id]))
    assert request.request_id not in landed.scheduled
    resumed = step(b, **ours())
    assert resumed.scheduled[request.request_id] == 365 - 320  # only the tail is computed
    stats = connector_of(b).stats
    # One lookup per new request (the 40-token one's answered at once), one hit.
    assert (stats.num_index_lookups, stats.num_index_hits, stats.remote_hit_tokens) == (2, 1, 320)
    run(b)


def test_a_pending_lookup_is_asked_again_in_o1_without_reading_the_request(pair, monkeypatch):
    # vLLM asks about every waiting request at every step while the answer is out (a burst of
    # new requests: each of them, each step); those re-asks must not rebuild the request's view
    # (a dozen attribute reads and a tuple per request per step inside schedule()).
    from kvbridge.connector.vllm import adapter

    a, b = pair
    held, request, _ = held_lookup(a, b, 8, 45)
    connector = connector_of(b)
    asked, views = [], []
    ask = connector.get_num_new_matched_tokens
    view_of = adapter.RequestView.of
    monkeypatch.setattr(connector, "get_num_new_matched_tokens",
                        lambda *args: asked.append(ask(*args)) or asked[-1])
    monkeypatch.setattr(adapter.RequestView, "of", lambda r: views.append(r) or view_of(r))
    for _ in range(3):
        assert step(b, **ours()).scheduled == {}
    assert asked == [(None, False)] * 3 and views == []
    held.release()
    wait_lookups(b)
    answered = step(b, **ours())  # the answer is read with the request: one view
    assert len(views) >= 1 and answered.meta.pulls
    step(b, **ours(finished_recving=[request.request_id]))
    run(b)


def test_an_idle_step_waits_for_the_lookup_and_pulls_in_the_next_step():
    # A step that computes nothing while a lookup is out waits for its answer (up to
    # idle_lookup_wait_s), so the request is pulled in the very next step instead of after
    # however many idle steps the index thread needs behind an engine thread that keeps
    # the GIL; a step that computes something never waits.
    namespace = _namespace()
    a = index_node("a", namespace)
    b = index_node("b", namespace,
                   extra={"idle_lookup_wait_s": 1.0, "index_lookup_timeout_s": 9.0})
    try:
        shared = _prompt(40, 320)
        _cached_on_a(a, shared)
        running = make_request(_prompt(41, 40), max_tokens=4)
        b.add_request(running)
        step(b, **ours())  # too short to look up; it keeps B computing in the next steps
        held = HeldLookups(b)
        request = make_request(shared + _prompt(42, 45), max_tokens=1)
        b.add_request(request)
        started = time.monotonic()
        busy = step(b, **ours())
        assert busy.scheduled == {running.request_id: 1}  # B computed: no wait
        assert held.arrived.wait(5.0) and time.monotonic() - started < 0.9  # not the 1 s cap
        run_out = [step(b, **ours()) for _ in range(3)]  # `running` finishes
        assert not any(s.meta.pulls for s in run_out) and running.request_id not in b.requests
        threading.Timer(0.1, held.release).start()
        started = time.monotonic()
        idle = step(b, **ours())  # nothing to compute: waits for the answer
        waited = time.monotonic() - started
        assert idle.scheduled == {} and waited >= 0.05, waited
        answered = step(b, **ours())
        assert [p.request_id for p in answered.meta.pulls] == [request.request_id]
        step(b, **ours(finished_recving=[request.request_id]))
        run(b)
    finally:
        for scheduler in (a, b):
            assert_scheduler_empty(scheduler)
            connector_of(scheduler).shutdown()


def test_a_request_alone_in_the_engine_is_answered_and_computed_in_its_arrival_step():
    # Alone (nothing else admitted), the arrival step waits for the lookup's answer (up to
    # idle_lookup_wait_s: the engine has nothing else to run) and, under load_mode "auto",
    # loads the hit inside that step, which computes the rest of the prompt: two engine steps
    # sooner. With another request in the engine the lookup is only started there and the hits
    # are pulled over later steps (a load inside the step would stall the other's forward). A
    # late answer is waited for no longer than the bound, and still loads inside the step it
    # is handed out in while the request is alone.
    namespace = _namespace()
    a = index_node("a", namespace)
    b = index_node("b", namespace, extra={"idle_lookup_wait_s": 0.3, "load_mode": "auto"})
    try:
        shared = _prompt(50, 320)
        _cached_on_a(a, shared)
        alone = make_request(shared + _prompt(51, 45), max_tokens=1)
        b.add_request(alone)
        first = step(b, **ours())
        (pull,) = first.meta.pulls
        assert pull.request_id == alone.request_id and pull.sync
        assert pull.num_external_tokens == 320
        assert first.scheduled == {alone.request_id: 45}  # computed beyond the hit, same step
        assert alone.request_id in first.finished()
        run(b)
        shared = _prompt(60, 320)  # (B holds the first prefix now)
        _cached_on_a(a, shared)
        held = HeldLookups(b)  # two at once: neither is alone
        pair_of = [make_request(shared + _prompt(62 + i, 45), max_tokens=1) for i in range(2)]
        for request in pair_of:
            b.add_request(request)
        threading.Timer(0.1, held.release).start()
        first = step(b, **ours())  # (the idle step's own wait ends with the release)
        assert not first.meta.pulls and first.scheduled == {}
        wait_lookups(b)
        answered = step(b, **ours())
        assert sorted(p.request_id for p in answered.meta.pulls) == sorted(
            r.request_id for r in pair_of)
        assert not any(p.sync for p in answered.meta.pulls) and answered.scheduled == {}
        step(b, **ours(finished_recving=[r.request_id for r in pair_of]))
        run(b)
        shared = _prompt(70, 320)
        _cached_on_a(a, shared)
        held = HeldLookups(b)  # alone, but the answer is late: the bound holds
        late = make_request(shared + _prompt(71, 45), max_tokens=1)
        b.add_request(late)
        started = time.monotonic()
        first = step(b, **ours())
        waited = time.monotonic() - started
        assert not first.meta.pulls and 0.3 <= waited < 2.0, waited
        held.release()
        wait_lookups(b)
        answered = step(b, **ours())
        assert [(p.request_id, p.sync) for p in answered.meta.pulls] == [(late.request_id, True)]
        assert answered.scheduled == {late.request_id: 45}
        run(b)
    finally:
        for scheduler in (a, b):
            assert_scheduler_empty(scheduler)
            connector_of(scheduler).shutdown()


def test_every_request_vllm_queues_is_live_until_it_finishes():
    # What counts as "in the engine" for the lone-request rules above: a request is live from
    # vLLM's on_new_request to request_finished, aborted before any step, refused for a
    # malformed ticket (vLLM keeps it and finishes it), or held for a decode node (P side).
    b = index_node("b", _namespace())
    live = connector_of(b)._sched()._index_matcher._live
    try:
        aborted = make_request(_prompt(1, 100), max_tokens=1)
        b.add_request(aborted)
        assert live == {aborted.request_id}
        b.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
        assert live == set()
        bad = make_request(_prompt(2, 100), max_tokens=1,
                           kv_transfer_params={"do_remote_prefill": True})  # malformed ticket
        run(b, bad)
        assert live == set()
        held = make_request(_prompt(3, 100), max_tokens=1,
                            kv_transfer_params={"do_remote_decode": True})
        b.add_request(held)
        assert live == {held.request_id}
        for _ in range(3):
            step(b, **ours())
        assert held.request_id not in live
    finally:
        connector_of(b).shutdown()


@pytest.mark.parametrize(("num_shared_blocks", "pulled"), [
    (7, False),  # 224 tokens: under vLLM's default min_remote_hit_tokens (256), recomputed
    (8, True),   # 256 tokens: pulled
])
def test_a_hit_is_pulled_only_from_min_remote_hit_tokens_on(pair, num_shared_blocks, pulled):
    a, b = pair
    shared = _prompt(20 + num_shared_blocks, num_shared_blocks * BLOCK_SIZE)
    _cached_on_a(a, shared)
    request = make_request(shared + _prompt(30, 100), max_tokens=1)  # asked: >= 8 blocks
    b.add_request(request)
    step(b, **ours())
    wait_lookups(b)
    answered = step(b, **ours())
    assert bool(answered.meta.pulls) == pulled
    if pulled:
        step(b, **ours(finished_recving=[request.request_id]))
    else:
        assert answered.scheduled[request.request_id] == len(shared) + 100  # all computed here
    run(b)


def test_a_hit_is_judged_again_against_the_local_hit_when_the_answer_comes(pair):
    # B's lookup starts with nothing local; while it is out, B computes 9 of the 10 blocks for
    # another request. The answer (10 blocks on A) then adds one block (32 tokens) to the local
    # hit, under min_remote_hit_tokens (256): computed here, never pulled.
    a, b = pair
    held, request, _ = held_lookup(a, b, seed=40, tail=40)
    shared = list(request.prompt_token_ids[:320])
    other = make_request(shared[:288] + _prompt(43, 40), max_tokens=1)
    other.skip_reading_prefix_cache = True  # computed at once, no lookup
    b.add_request(other)
    assert step(b, **ours()).scheduled == {other.request_id: 328}
    held.release()
    wait_lookups(b)
    answered = step(b, **ours())
    assert not answered.meta.pulls
    assert answered.scheduled[request.request_id] == 360 - 288  # after the 9 local blocks
    assert connector_of(b)._sched().stats.snapshot()["num_index_hits"] == 0
    run(b)


@pytest.mark.parametrize("answer", ["short", "two_groups", "empty_group", "negative", "too_long"])
def test_an_answer_that_cannot_be_planned_is_a_miss_counted_and_said(pair, answer, caplog):
    # A corrupt or foreign index entry: the scheduler computes the request, never crashes.
    a, b = pair
    shared = _prompt(45, 320)
    _cached_on_a(a, shared)
    index = client_of(b).index
    real_ids, real_prefix = index.get_block_ids, index.longest_prefix

    def bad_ids(node_id, incarnation, hashes, group_ids=(0,)):
        ids = real_ids(node_id, incarnation, hashes, group_ids)
        if ids is None or answer == "too_long":
            return ids if answer != "too_long" else [list(range(1, len(hashes) + 1))]
        return {"short": [ids[0][:3]], "two_groups": [ids[0], ids[0]], "empty_group": [[]],
                "negative": [[-5] * len(ids[0])]}[answer]

    def longer(hashes, group_ids=(0,), **kwargs):  # claims more blocks than were asked for
        hit = real_prefix(hashes, group_ids, **kwargs)
        holders = tuple(dataclasses.replace(h, num_blocks=h.num_blocks + 5, block_ids=None)
                        for h in hit.holders)
        return hit._replace(num_blocks=hit.num_blocks + 5, holders=holders)

    index.get_block_ids = bad_ids
    if answer == "too_long":
        index.longest_prefix = longer
    try:
        request = make_request(shared + _prompt(46, 10), max_tokens=1)
        b.add_request(request)
        step(b, **ours())
        wait_lookups(b)
        answered = step(b, **ours())
    finally:
        del index.get_block_ids
        index.__dict__.pop("longest_prefix", None)
    assert not answered.meta.pulls
    assert answered.scheduled[request.request_id] == 330  # computed here
    stats = connector_of(b)._sched().stats.snapshot()
    assert stats["num_index_lookup_failures"] == 1 and stats["num_index_hits"] == 0
    assert "cannot be planned" in caplog.text
    run(b)


@pytest.mark.parametrize("aborted", [True, False])
def test_blocks_a_sync_pull_did_not_write_leave_the_prefix_cache_at_once(aborted):
    # vLLM caches a sync load's blocks when it allocates them and, under recompute, keeps
    # them cached for the request to rewrite. Aborted first, they would stay cached unwritten:
    # the same prompt again would take them as a local hit (and offload would copy them).
    namespace = _namespace()
    a, b = index_node("a", namespace), index_node("b", namespace, extra={"load_mode": "sync"})
    shared, tail = _prompt(47, 320), _prompt(48, 20)
    _cached_on_a(a, shared)
    request = make_request(shared + tail, max_tokens=2)
    b.add_request(request)
    step(b, **ours())
    wait_lookups(b)
    output = b.schedule()  # the pull and the step computing the rest, planned together
    (pull,) = decode_metadata(output.kv_connector_metadata.payload).pulls
    assert pull.sync
    unwritten = list(pull.groups[0].local_block_ids)[6:]
    blocks = b.kv_cache_manager.block_pool.blocks
    assert all(blocks[i].block_hash is not None for i in unwritten)  # cached at allocation
    b.update_from_output(output, model_runner_output(
        output, invalid_block_ids=unwritten, worker_meta=worker_report()))
    assert all(blocks[i].block_hash is None for i in unwritten)
    if aborted:
        b.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    else:  # recomputed from the first block that did not land, then finished
        assert step(b, **ours()).scheduled == {request.request_id: 340 - 6 * BLOCK_SIZE}
    run(b)
    again = make_request(shared + tail, max_tokens=1)
    steps = run(b, again)
    # only the 6 blocks that landed are a local hit (the 4 more on A are under the minimum)
    assert [s.scheduled[again.request_id] for s in steps
            if again.request_id in s.scheduled] == [340 - 6 * BLOCK_SIZE]
    for scheduler in (a, b):
        assert_scheduler_empty(scheduler)
        connector_of(scheduler).shutdown()


def test_a_hit_vllm_cannot_allocate_yet_is_handed_out_again_not_looked_up_again(pair):
    # B's cache is full when the answer comes; vLLM asks again at every step until blocks free
    # up: the answer is reused (one lookup), and the pull, once allocated, is the whole prefix.
    a, b = pair
    shared = _prompt(49, 320)
    _cached_on_a(a, shared)
    big = make_request(_prompt(50, 1000), max_tokens=14)
    big2 = make_request(_prompt(51, 800), max_tokens=14)
    for request in (big, big2):
        b.add_request(request)
    for _ in range(10):
        step(b, **ours())
        wait_lookups(b)
        if big.num_computed_tokens >= 1000 and big2.num_computed_tokens >= 800:
            break
    stats = connector_of(b)._sched().stats
    lookups = stats.snapshot()["num_index_lookups"]
    request = make_request(shared + _prompt(52, 10), max_tokens=1)
    b.add_request(request)
    landed, pulled, waited = [], [], 0
    for _ in range(40):
        if not b.requests:
            break
        done = step(b, **ours(finished_recving=landed))
        landed = [pull.request_id for pull in done.meta.pulls]
        pulled += done.meta.pulls
        waited += not pulled and request.request_id not in done.scheduled
        wait_lookups(b)
    assert not b.requests
    assert waited > 2  # the cache was full for several steps after the answer
    assert [pull.num_external_tokens for pull in pulled] == [320]
    assert stats.snapshot()["num_index_lookups"] - lookups == 1


def test_a_lookup_past_its_deadline_goes_on_with_the_local_hit_and_is_counted():
    namespace = _namespace()
    a = index_node("a", namespace)
    b = index_node("b", namespace, extra={"index_lookup_timeout_s": 0.05})
    try:
        held, request, first = held_lookup(a, b, 31, 10)
        assert not first.scheduled
        time.sleep(0.06)  # the index (held) has not answered within index_lookup_timeout_s
        late = step(b, **ours())
        assert late.scheduled == {request.request_id: 330} and not late.meta.pulls
        held.release()
        run(b)
        assert connector_of(b).stats.num_index_lookup_failures == 1
        for scheduler in (a, b):
            assert_scheduler_empty(scheduler)
    finally:
        for scheduler in (a, b):
            connector_of(scheduler).shutdown()


def test_a_hybrid_engine_pulls_only_the_blocks_its_sliding_window_needs():
    # vLLM's hybrid allocator: group 0 sliding-window (WINDOW = 64 tokens, two blocks), group 1
    # full attention. B's hit of 10 blocks needs all of them in the full group, and in the
    # window group only the two the next token's window reaches (vLLM's hit rule).
    namespace = _namespace()
    a, b = (index_node(name, namespace, hybrid=True) for name in ("a", "b"))
    try:
        shared = _prompt(33, 320)
        probe = make_request(shared, max_tokens=1)
        run(a, probe)
        pool = a.kv_cache_manager.block_pool
        a_ids = [[pool.get_cached_block(h, [g])[0].block_id for h in probe.block_hashes[:10]]
                 for g in (0, 1)]
        request = make_request(shared + _prompt(34, 45), max_tokens=1)
        b.add_request(request)
        step(b, **ours())
        wait_lookups(b)
        (pull,) = step(b, **ours()).meta.pulls
        assert pull.num_external_tokens == 320
        window, full = pull.groups
        assert list(window.remote_block_ids) == a_ids[0][8:]
        assert list(full.remote_block_ids) == a_ids[1]
        b_ids = b.kv_cache_manager.get_block_ids(request.request_id)
        assert list(window.local_block_ids) == list(b_ids[0][8:10])
        assert list(full.local_block_ids) == list(b_ids[1][:10])
        step(b, **ours(finished_recving=[request.request_id]))
        run(b)
        for scheduler in (a, b):
            assert index_entries(scheduler) == pool_entries(scheduler)
            assert_scheduler_empty(scheduler)
    finally:
        for scheduler in (a, b):
            connector_of(scheduler).shutdown()


def test_blocks_that_do_not_land_are_recomputed_from_the_first_of_them(pair):
    a, b = pair
    shared = _prompt(8, 320)
    _cached_on_a(a, shared)
    request = make_request(shared + _prompt(9, 20), max_tokens=1)
    b.add_request(request)
    step(b, **ours())
    wait_lookups(b)
    (pull,) = step(b, **ours()).meta.pulls
    local = list(pull.groups[0].local_block_ids)
    # A evicted its blocks 6..9 between the lookup and the pull: the holder refused them.
    step(b, **ours(finished_recving=[request.request_id], invalid_block_ids=local[6:]))
    resumed = step(b, **ours())
    assert resumed.scheduled[request.request_id] == 340 - 6 * BLOCK_SIZE
    run(b)


def test_a_pull_that_fails_whole_is_recomputed_and_never_looked_up_again(pair):
    a, b = pair
    shared = _prompt(18, 320)
    _cached_on_a(a, shared)
    request = make_request(shared + _prompt(19, 20), max_tokens=1)
    b.add_request(request)
    step(b, **ours())
    wait_lookups(b)
    (pull,) = step(b, **ours()).meta.pulls
    # A's entries are stale (it evicted every block): nothing lands. vLLM frees the blocks and
    # asks the connector again from token 0; the index would name the same refused blocks.
    local = list(pull.groups[0].local_block_ids)
    step(b, **ours(finished_recving=[request.request_id], invalid_block_ids=local))
    again = step(b, **ours())
    wait_lookups(b)
    assert again.scheduled == {request.request_id: 340} and not again.meta.pulls
    stats = connector_of(b).stats
    assert (stats.num_index_lookups, stats.num_index_hits) == (1, 1)
    run(b)


def test_an_abort_while_the_lookup_is_pending_leaves_nothing_behind(pair):
    a, b = pair
    held, request, _ = held_lookup(a, b, 10, 10)
    b.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    held.release()
    wait_lookups(b)
    quiet = step(b, **ours())
    assert not quiet.meta.pulls  # the answer came for nobody
    assert not connector_of(b)._sched()._index_matcher.pending_request_ids


def test_an_abort_while_the_pull_is_in_flight_frees_the_blocks_once_it_settles(pair):
    a, b = pair
    shared = _prompt(12, 320)
    _cached_on_a(a, shared)
    request = make_request(shared + _prompt(13, 10), max_tokens=1)
    b.add_request(request)
    step(b, **ours())
    wait_lookups(b)
    assert step(b, **ours()).meta.pulls
    b.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    # vLLM keeps the blocks the pull writes into until the worker half reports it settled.
    assert block_ids(b, request)
    step(b, **ours(finished_recving=[request.request_id]))


def test_preemption_while_a_lookup_is_pending_and_while_a_pull_is_in_flight(pair):
    a, b = pair
    shared = _prompt(14, 320)
    _cached_on_a(a, shared)
    # Two prompts of 991 and 990 tokens hold 62 of B's 63 usable blocks (31 each, the last
    # one with one or two free slots); as they decode, each needs a 32nd block: the first takes
    # the last free one, the second (a step later) is preempted.
    first = make_request(_prompt(15, 991), max_tokens=6)
    second = make_request(_prompt(16, 990), max_tokens=6)
    b.add_request(first)
    b.add_request(second)
    for _ in range(6):  # until both prompts are computed (their decodes fit for one step)
        step(b, **ours())
        wait_lookups(b)
        if second.num_computed_tokens >= 990:
            break
    assert {first.status, second.status} == {RequestStatus.RUNNING}
    assert not second.num_preemptions
    held = HeldLookups(b)
    late = make_request(shared + _prompt(17, 10), max_tokens=1)
    b.add_request(late)
    step(b, **ours())
    assert held.arrived.wait(5.0) and not second.num_preemptions  # late's lookup is out
    for _ in range(5):  # (1) the preemption comes while late's lookup is unanswered
        step(b, **ours())
        if second.num_preemptions:
            break
    assert second.num_preemptions == 1 and second.status == RequestStatus.PREEMPTED
    assert late.status == RequestStatus.WAITING
    held.release()
    wait_lookups(b)
    pulled = None
    for _ in range(10):  # (2) late's pull is planned once there is room, and is in flight
        out = step(b, **ours())
        wait_lookups(b)
        if out.meta.pulls:
            (pulled,) = out.meta.pulls
            break
    assert pulled is not None and pulled.request_id == late.request_id
    assert late.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # (3) the others keep running (and preempting) while the pull is in flight; it lands later.
    for _ in range(3):
        step(b, **ours())
    step(b, **ours(finished_recving=[late.request_id]))
    run(b)
    assert second.num_preemptions >= 1 and late.is_finished()
    # Preemptions free blocks without uncaching them: the index still says what B caches.
    assert index_entries(b) == pool_entries(b)
