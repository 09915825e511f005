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

import itertools
import threading
import time

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from _vllm_sched_builders import (
    assert_scheduler_empty,
    connector_of,
    make_request,
    make_scheduler,
    step,
    worker_report,
)
from kvbridge.kvmanager.block_hash import get_block_hash, get_group_id
from vllm.distributed.kv_events import BlockStored as VllmBlockStored

_incarnations = itertools.count(time.time_ns())
_ports = itertools.count(47100)
_namespaces = itertools.count()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _namespace() -> str:
    return f"index-sched-{next(_namespaces)}-{time.time_ns()}"


def index_node(engine_id: str, namespace: str, **kwargs):
    """A ``kv_both`` vLLM scheduler with the in-process index under ``namespace``."""
    return make_scheduler(
        "kv_both", engine_id=engine_id, policy="recompute",
        extra={"index_url": "memory", "model_name": namespace, "index_ttl_s": 60.0},
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
        self._original = self._index.longest_prefix
        self.arrived = threading.Event()
        self._released = threading.Event()

        def held(*args, **kwargs):
            self.arrived.set()
            self._released.wait(10.0)
            return self._original(*args, **kwargs)

        self._index.longest_prefix = held

    def release(self) -> None:
        self._released.set()
        del self._index.longest_prefix  # the shared index object answers at once again


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
