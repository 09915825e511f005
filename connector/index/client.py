"""A node's link to the cross-node block index (docs/architecture.md, "Life of an index hit"; a
scheduling step never waits on the network: docs/architecture.md, "The two connector halves").

``IndexClient`` is the engine thread's non-blocking face of the index: ``publish`` queues the
node's ``BlockPool`` events, ``start_lookup`` / ``poll_lookup`` / ``cancel_lookup`` ask "which
node holds the longest prefix of these block hashes, and where do I pull it?" without waiting.
Its ``IndexWorker`` thread (``worker.py``) makes every backend call: heartbeats, publishes in
order, lookups (``lookup.py``). ``open_index`` builds the backends behind a URL.

Everything it learns is advisory: the holder re-checks each block's hash when it serves it, so a
stale entry costs a recompute, never wrong output. Backend trouble never raises out of here: the
lookup answers "unavailable" or "timed_out" (counted) and the request falls back to local APC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .in_memory import InMemoryBlockIndex
from .jobs import LookupJob
from .lookup import LOOKUP_PENDING, LookupResult, RemotePrefix, resolve_remote_prefix
from .node_directory import (
    InMemoryNodeDirectory,
    NodeAddress,
    NodeDirectory,
    RedisNodeDirectory,
)
from .protocol import BlockIndex, Holder, IndexNamespace, IndexStats, Tier, check_lookup_args
from .reachability import NODE_MEANWHILE, Reachability
from .redis_cluster import RedisClusterBlockIndex, cluster_client
from .redis_cluster_directory import RedisClusterNodeDirectory
from .redis_index import RedisBlockIndex
from .resync import ParentMirror
from .url import CLUSTER_SCHEME, REDIS_SCHEMES, check_index_url
from .worker import IndexWorker

if TYPE_CHECKING:
    from kvbridge.kvmanager import CachedBlock, PrefixHitRule

__all__ = [
    "INDEX_SOCKET_TIMEOUT_S", "IndexClient", "LookupResult", "RemotePrefix", "block_index_for_url",
    "open_index",
]

logger = logging.getLogger(__name__)

INDEX_SOCKET_TIMEOUT_S = 0.25  # seconds; ``open_index``'s default (engines: config key)
_TIMED_OUT = LookupResult("timed_out")
_OVERLOADED = LookupResult("overloaded")
_NO_HIT = LookupResult("no_hit")


class _Locked:
    """Serialises every method call of a shared in-process backend (several nodes' threads)."""

    def __init__(self, target: Any, lock: threading.Lock) -> None:
        self._target = target
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return locked


_memory_backends: dict[str, tuple[Any, Any]] = {}
_memory_lock = threading.Lock()


def open_index(
    url: str, namespace: IndexNamespace, *, socket_timeout_s: float = INDEX_SOCKET_TIMEOUT_S
) -> tuple[BlockIndex, NodeDirectory]:
    """The index and node directory behind ``url``; a Redis call not answered within
    ``socket_timeout_s`` (also the connect timeout; config key ``index_socket_timeout_s``)
    counts as an outage: the backend is backed off for a second.

    ``"memory"``: the embedded in-process backend, shared by every node of this process in the
    same namespace. ``"redis://host:port/db"``: a Redis server; ``redis://:PASSWORD@host...``
    (or ``USER:PASSWORD@``) for one started with ``requirepass`` / ACLs, ``rediss://`` for TLS
    (redis-py's URL options, e.g. ``?ssl_ca_certs=/path/ca.crt&ssl_cert_reqs=required``).
    ``"redis-cluster://HOST:PORT[,HOST:PORT...]"``: a Redis or Valkey cluster from its seed
    nodes (``redis_cluster.py``). An IPv6 server or seed is in brackets (``redis://[::1]:6379/0``).
    Raises ValueError for another scheme or a malformed URL (``url.check_index_url``; the message
    never repeats a password).
    """
    check_index_url(url)
    if url == "memory":
        with _memory_lock:
            key = namespace.key_prefix
            if key not in _memory_backends:
                lock = threading.Lock()
                _memory_backends[key] = (
                    _Locked(InMemoryBlockIndex(namespace), lock),
                    InMemoryNodeDirectory(),
                )
            return _memory_backends[key]
    if url.startswith((*REDIS_SCHEMES, "unix://")):
        client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast: a lookup has a deadline of its own
        )
        index = RedisBlockIndex(namespace, url, socket_timeout_s=socket_timeout_s,
                                connect_timeout_s=socket_timeout_s)  # (one outage log for both)
        return index, RedisNodeDirectory(client, namespace.key_prefix, index.reachability)
    cluster = RedisClusterBlockIndex(  # redis-cluster://, the last form
        namespace, url, socket_timeout_s=socket_timeout_s, connect_timeout_s=socket_timeout_s)
    directory_client = cluster_client(
        url, socket_timeout_s=socket_timeout_s, connect_timeout_s=socket_timeout_s
    )
    return cluster, RedisClusterNodeDirectory(directory_client, cluster.bucket_prefixes)


def block_index_for_url(
    url: str, namespace: IndexNamespace, *, meanwhile: str = NODE_MEANWHILE
) -> BlockIndex:
    """A Redis or Redis Cluster ``BlockIndex`` of its own for ``url`` (tools such as the proxy
    that only look up). ``meanwhile``: what the tool does while Redis does not answer, for the
    one log line that says so (``reachability.Reachability``). Raises ValueError for another
    scheme or a malformed URL."""
    check_index_url(url)
    reachability = Reachability(url, meanwhile=meanwhile)
    if url.startswith(CLUSTER_SCHEME):
        return RedisClusterBlockIndex(namespace, url, reachability=reachability)
    if url.startswith((*REDIS_SCHEMES, "unix://")):
        return RedisBlockIndex(namespace, url, reachability=reachability)
    raise ValueError(f"index_url must be a redis:// or redis-cluster:// URL, got {url!r}")


class IndexClient:
    """One node's use of the index, non-blocking for the engine thread.

    Args:
        index, directory: from ``open_index``.
        node_id: the node's engine id (no ``:`` or whitespace).
        incarnation: this start's incarnation (the transport advertises the same number).
        group_ids: the KV cache groups a prefix must be held in.
        ttl_s: the node's entries and address expire this long after the last heartbeat
            (heartbeats every ``ttl_s / 3``).
        tier: the tier this node's blocks are published as (``"store"`` for a store node).
        lookup_timeout_s: a lookup not answered this long after ``start_lookup`` resolves to
            ``"timed_out"`` (config key ``index_lookup_timeout_s``).
        max_lookups_in_flight: lookups queued or running at once; ``start_lookup`` beyond it
            resolves to ``"overloaded"``.
        max_queued_ops: publish ops (one per block hash of an event) waiting for the worker;
            a batch offered while the queue holds this many is dropped (counted in ``stats``,
            logged; with a resync source the node then resyncs).
        hit_rule: the node's ``kvmanager.PrefixHitRule`` (needed when a group is not full
            attention: lookups then find what that rule restores from a holder).

    Threads:

    - The caller thread (the engine thread; any single thread at a time) calls ``start_lookup``,
      ``poll_lookup``, ``cancel_lookup``, ``publish`` and ``close``; none of them makes a
      network call or waits on a lock held across one. It owns ``_key_to_lookup`` and the
      client counters of ``stats`` (``lookups_timed_out``, ``lookups_refused``,
      ``publish_*_dropped_full``).
    - The worker thread (``IndexWorker``, started by ``start``) makes every backend call:
      heartbeats, publishes in order, lookups including the node-directory address resolution.
      It owns the backend's counters and writes each ``LookupJob.result`` once.
    - ``start`` (registration), ``flush`` and ``find_remote_prefix`` block: startup, tests and
      tools, never a scheduling step.
    """

    def __init__(
        self,
        index: BlockIndex,
        directory: NodeDirectory,
        *,
        node_id: str,
        incarnation: int,
        group_ids: Sequence[int],
        ttl_s: float,
        tier: Tier = "device",
        lookup_timeout_s: float = 0.5,
        max_lookups_in_flight: int = 64,
        max_queued_ops: int = 65536,
        clock: Callable[[], float] = time.monotonic,
        hit_rule: PrefixHitRule | None = None,
    ) -> None:
        if not lookup_timeout_s > 0:
            raise ValueError(f"lookup_timeout_s must be positive, got {lookup_timeout_s}")
        check_lookup_args((), group_ids)
        self.index = index
        self.directory = directory
        self.node_id = node_id
        self.incarnation = incarnation
        self.group_ids = tuple(group_ids)
        self.ttl_s = ttl_s
        self.tier: Tier = tier
        self.lookup_timeout_s = lookup_timeout_s
        self._clock = clock
        self._worker = IndexWorker(
            index,
            directory,
            node_id=node_id,
            incarnation=incarnation,
            group_ids=self.group_ids,
            ttl_s=ttl_s,
            tier=tier,
            max_lookups_in_flight=max_lookups_in_flight,
            max_queued_ops=max_queued_ops,
            clock=clock,
            hit_rule=hit_rule,
        )
        self.hit_rule = hit_rule
        self._key_to_lookup: dict[str, LookupJob] = {}
        self._snapshot: Callable[[], Sequence[CachedBlock]] | None = None
        self._parents = ParentMirror()
        self._make_resync_events: Callable[[], list[Any]] | None = None
        self._block_size = index.namespace.block_size

    @property
    def stats(self) -> IndexStats:
        return self.index.stats

    @property
    def num_reregistrations(self) -> int:
        return self._worker.num_reregistrations

    @property
    def num_lookups_in_flight(self) -> int:
        return self._worker.lookups.num_in_flight

    # ------------------------------------------------------------------ life
    def start(self, host: str, port: int) -> None:
        """Register the node and announce its address (blocking, bounded by the backend's
        socket timeouts), then start the worker thread (heartbeats, publishes, lookups)."""
        self._worker.start(NodeAddress(host, port, self.incarnation))

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the worker and withdraw the address (entries expire with the TTL). Returns
        within about ``timeout_s`` even if the backend does not answer (its call is then
        interrupted; a worker stuck past that is left behind as a daemon and logged)."""
        self._worker.stop(timeout_s)
        self._key_to_lookup.clear()

    # ------------------------------------------------------------------ publish
    def set_resync_source(self, snapshot: Callable[[], Sequence[CachedBlock]]) -> None:
        """Give the client the node's cached set (``BlockPool.snapshot_cached_blocks``), called
        on the caller thread when a resync is due; from then on batches are numbered and a
        possibly lost one is repaired by re-publishing the whole set. Call before ``start``
        and before the first ``publish``."""
        self._snapshot = snapshot
        self._worker.enable_resync()

    def set_resync_events(self, make_events: Callable[[], list[Any]]) -> None:
        """As ``set_resync_source``, for a node that knows each block's parent itself (a store
        node, whose cache keeps what its writers sent): ``make_events()`` returns the whole
        set as events, ``AllBlocksCleared`` first, then one ``BlockStored`` per block, parents
        before children."""
        self._make_resync_events = make_events
        self._worker.enable_resync()

    def resync_from(self, pool: Any) -> None:
        """``set_resync_events(pool.resync_events)`` when the pool builds its own resync batch
        (vLLM's, whose mirror files every block's parent), else
        ``set_resync_source(pool.snapshot_cached_blocks)``."""
        make_events = getattr(pool, "resync_events", None)
        if make_events is not None:
            self.set_resync_events(make_events)
        else:
            self.set_resync_source(pool.snapshot_cached_blocks)

    def publish(self, events: Iterable[Any]) -> None:
        """Queue a batch of ``BlockPool`` events for the index and return at once; the worker
        applies batches in the order they were queued. A batch offered while the queue is full
        is dropped (counted in ``stats.publish_*_dropped_full``, logged). ``events`` must not
        change afterwards. Call it every step, also with no events: when the worker asks for a
        resync, the node's cached set is read here (the moment after a forward, when every
        hashed block has its KV) and queued in place of the batch; a caller that does not call
        within a second (an idle engine) leaves it to the worker (``IndexWorker``: the set it
        listed)."""
        events = list(events)
        if self._snapshot is not None:
            self._parents.observe(events)
        if self._worker.resync_wanted:
            if self._make_resync_events is not None:
                self._worker.enqueue_resync(self._make_resync_events())
                return
            if self._snapshot is not None:
                cached = self._snapshot()
                self._worker.enqueue_resync(self._parents.resync_events(cached, self._block_size))
                return
        if events:
            self._worker.enqueue_publish(events)

    @property
    def resync_pending(self) -> bool:
        """True while a batch may be lost and no resync has been applied since."""
        return self._worker.needs_resync

    @property
    def num_resyncs(self) -> int:
        """Resyncs this node's worker has had applied."""
        return self._worker.num_resyncs_sent

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch queued so far has been handed to the backend (and any part a
        cluster bucket left unanswered has been sent again once); False on timeout. Blocking:
        for tests and shutdown paths, never for a scheduling step."""
        return self._worker.flush(timeout_s)

    # ------------------------------------------------------------------ lookups
    def start_lookup(
        self,
        key: str,
        block_hashes: Sequence[bytes],
        *,
        num_local_blocks: int,
        min_gain_blocks: int,
    ) -> None:
        """Start looking up the longest prefix of ``block_hashes`` held on another node that
        beats ``num_local_blocks`` by at least ``min_gain_blocks``; returns at once.

        ``key`` names the lookup (a request id). While a lookup of ``key`` is known (not yet
        answered by ``poll_lookup``, nor cancelled) another ``start_lookup(key, ...)`` does
        nothing. The hashes are copied. Raises ValueError for hashes of different lengths.
        """
        if key in self._key_to_lookup:
            return
        hashes = tuple(block_hashes)
        # One join, not a length per hash (this runs in the scheduling step); mixed lengths that
        # happen to add up pass here and cost a miss, as in ``protocol.join_keys``.
        if hashes and (not hashes[0] or len(b"".join(hashes)) != len(hashes[0]) * len(hashes)):
            raise ValueError("block hashes must share one non-zero length")
        job = LookupJob(
            key, hashes, num_local_blocks, min_gain_blocks, self._clock() + self.lookup_timeout_s
        )
        if len(hashes) < num_local_blocks + min_gain_blocks:
            job.result = _NO_HIT  # cannot beat the local hit: no need to ask
        elif not self._worker.lookups.submit(job):
            job.result = _OVERLOADED
            self.index.stats.lookups_refused += 1
        self._key_to_lookup[key] = job

    def poll_lookup(self, key: str) -> LookupResult:
        """The lookup's state: ``LOOKUP_PENDING`` (that very object: ask again), or its final
        answer, which is handed out once (the key is forgotten). A lookup past
        ``lookup_timeout_s`` without an answer answers ``"timed_out"`` (counted in
        ``stats.lookups_timed_out``). Raises ValueError for a key with no lookup (never started,
        already answered, or cancelled)."""
        job = self._key_to_lookup.get(key)
        if job is None:
            raise ValueError(
                f"no index lookup for key {key!r} (not started, answered or cancelled)"
            )
        result = job.result
        if result is None:
            if self._clock() < job.deadline_s:
                return LOOKUP_PENDING
            self._worker.lookups.withdraw(job)
            result = _TIMED_OUT
        if result.status == "timed_out":
            self.index.stats.lookups_timed_out += 1
        del self._key_to_lookup[key]
        return result

    def lookup_pending(self, key: str) -> bool:
        """True while the lookup of ``key`` is neither answered nor past ``lookup_timeout_s``
        (``poll_lookup`` would answer ``"pending"``); False for any other key. One dict read and
        a clock read, nothing allocated, nothing changed: for an engine that asks about every
        waiting request each step."""
        job = self._key_to_lookup.get(key)
        return job is not None and job.result is None and self._clock() < job.deadline_s

    def wait_for_answer(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a lookup started here (and not yet handed out by
        ``poll_lookup``) has its answer; True once one has (at once if one had already), False
        on timeout or when no lookup is out. For an engine step that computes nothing while
        lookups are out (``KVBridgeScheduler.build_connector_meta``): the engine thread then
        leaves the GIL and the core to the index worker instead of stepping idly, and the
        request is scheduled a step after its answer instead of steps later. The caller thread
        only."""
        jobs = list(self._key_to_lookup.values())
        return bool(jobs) and self._worker.lookups.wait_for_answer(jobs, timeout_s)

    def cancel_lookup(self, key: str) -> None:
        """Forget the lookup of ``key`` (request aborted or finished); unknown keys are fine.
        A queued lookup leaves the queue; a running one finishes and its answer is ignored."""
        job = self._key_to_lookup.pop(key, None)
        if job is not None and job.result is None:
            self._worker.lookups.withdraw(job)

    def find_remote_prefix(
        self,
        block_hashes: Sequence[bytes],
        *,
        num_local_blocks: int,
        min_gain_blocks: int,
        choose: Callable[[Sequence[Holder]], Sequence[Holder]] = lambda holders: holders,
    ) -> RemotePrefix | None:
        """Blocking twin of ``start_lookup``/``poll_lookup`` on the caller's thread (one to
        three round trips): for tools and tests, and for the connector until it moves to the
        non-blocking calls (its backend calls then share the backend counters with the worker's).
        Never call it from a scheduling step."""
        result = resolve_remote_prefix(
            self.index,
            self.directory,
            node_id=self.node_id,
            group_ids=self.group_ids,
            block_hashes=block_hashes,
            num_local_blocks=num_local_blocks,
            min_gain_blocks=min_gain_blocks,
            choose=choose,
            hit_rule=self.hit_rule,
        )
        return result.prefix
