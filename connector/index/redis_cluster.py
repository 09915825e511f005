"""The block index on Redis Cluster (or Valkey cluster): ``redis-cluster://HOST:PORT[,...]``.

Key layout. A cluster script may only touch keys of one hash slot, and a lookup must stay one
round trip, so the namespace is cut into ``num_buckets`` buckets, each a complete single-server
layout (``redis_scripts.py``) under its own hash tag, ``{<namespace prefix>:b<i>.<j>}`` (``j``
spreads the buckets evenly over the slot space, ``bucket_prefixes``): every key a
script touches (entries, node records, hole records, sequence numbers) carries its bucket's tag
and lives in one slot. A chain of blocks lives in the bucket of its root, the prompt's block 0
(``bucket_of``): prompts that share a first block share a bucket, so a lookup, and the holder's
block ids after it, read one bucket on one shard. The buckets' slots spread over the shards.

Trade-off (measured by ``benchmarks/bench_index.py --cluster``): the unit of spreading is a root,
not a block. A hot system prompt puts every conversation that starts with it, all their blocks
and all their lookups, on one bucket's shard (a hot slot): with a trace whose prompts share few
roots the busiest shard holds far more than a third of the keys. More buckets never split one
root; they only even out many roots.

A node is registered and heart-beats in every bucket (``num_buckets`` small calls every
``ttl / 3``) and announces its address in three buckets on different shards; a publish sends
one call per bucket its ops touch, each with that bucket's own batch number (a bucket sees
only the batches that touch it, so its numbers have no holes). A bucket whose shard is down is
backed off on its own (``RedisBlockIndex``, per key prefix): its lookups answer "unavailable"
and fall back to local APC, the other buckets keep answering. A node registers in the buckets
that answer (one shard down at start costs only its buckets; once back, the node's first call
there is fenced and it registers again and resyncs).

A bucket that leaves its part of a publish unanswered (its shard down or slow; the part may have
run) holds only its own part: the part is parked with its number, the node's later parts for
that bucket queue behind it, and every other bucket applies its parts at once (before, the
node's whole stream waited on the one shard, then stopped until every shard answered: what it
cached meanwhile was listed nowhere). The node's index worker sends parked parts again, in
order, every 50 ms (``send_parked``; nothing while the bucket is backed off); a part that ran
answers "replayed". A bucket the registration did not reach is registered before its parts go
and by the next heartbeat, which says "unavailable" only when no bucket answers. A shard back
with its data takes the parts in order; one back empty refuses them (fenced, a gap) and the node
resyncs. Past ``MAX_PARKED_OPS`` parked ops, the parked buckets are ``lost``: their parts are
dropped from then on, and the node resyncs once one answers (the live buckets keep their entries
and deltas).

Servers: ``cluster-require-full-coverage no`` keeps the live shards serving while one is down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import ConnectionPool
from redis.crc import key_slot
from redis.retry import Retry

from . import redis_scripts as scripts
from .cluster_parts import (
    MAX_PARKED_OPS,
    PARKED_CALLS_PER_TURN,
    NodeSeqs,
    ParkedPart,
    next_call,
    packed_call,
)
from .protocol import (
    IndexNamespace,
    IndexOp,
    IndexStatus,
    ParkedParts,
    PublishResult,
    Tier,
    check_node_id,
    check_seq,
    events_to_ops,
)
from .reachability import Reachability
from .redis_index import RedisBlockIndex, _script, _ttl_ms
from .redis_publish import pack_ops
from .url import CLUSTER_SCHEME, parse_cluster_url, redact_url

__all__ = [
    "CLUSTER_SCHEME",
    "ClusterUnreachableError",
    "RedisClusterBlockIndex",
    "bucket_of",
    "bucket_prefixes",
    "cluster_client",
    "parse_cluster_url",
]

_NUM_SLOTS = 16384
_REGISTER = _script(scripts.REGISTER_LUA)
_HEARTBEAT = _script(scripts.HEARTBEAT_LUA)


class ClusterUnreachableError(ValueError):
    """No seed of a ``redis-cluster://`` index answered at start: the client cannot learn which
    shard owns which slot, so the node is refused (one line: the URL, the error, what to change).
    A plain ``redis://`` index is served without its server instead and reconnects
    (``reachability.py``)."""


def cluster_client(url: str, *, socket_timeout_s: float, connect_timeout_s: float) -> RedisCluster:
    """A ``RedisCluster`` for ``url``'s seed nodes that fails fast (no retries, no full-coverage
    requirement: the index backs off per bucket). Raises ``ClusterUnreachableError`` when no
    seed answers."""
    seeds, _ = parse_cluster_url(url)
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in seeds],
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            require_full_coverage=False,
        )
    except redis.exceptions.RedisClusterException as exc:
        raise ClusterUnreachableError(
            f"cannot reach the Redis Cluster at {redact_url(url)} ({exc}); start it, or set "
            "index_url (--index-url) to a cluster whose seeds answer, or leave it unset for no "
            "index") from None


def bucket_prefixes(key_prefix: str, num_buckets: int) -> list[str]:
    """Each bucket's hash-tagged key prefix, ``{<key_prefix>:b<i>.<j>}``, with the smallest
    ``j`` whose slot falls in the bucket's even share of the 16,384 slots: the buckets spread
    over the slot space as evenly as they can (so over shards that own even slot ranges),
    whatever the cluster, and every client computes the same prefixes."""
    out = []
    for b in range(num_buckets):
        low, high = b * _NUM_SLOTS // num_buckets, (b + 1) * _NUM_SLOTS // num_buckets
        j = 0
        while not low <= key_slot(f"{key_prefix}:b{b}.{j}".encode()) < high:
            j += 1
        out.append(f"{{{key_prefix}:b{b}.{j}}}")
    return out


def bucket_of(first_key: bytes, num_buckets: int) -> int:
    """The bucket of a chain whose block 0 has lookup key ``first_key`` (a hash prefix, so its
    first bytes are uniform)."""
    return int.from_bytes(first_key[:4], "big") % num_buckets


class RedisClusterBlockIndex(RedisBlockIndex):
    """``BlockIndex`` on a Redis or Valkey cluster (module docstring: layout and trade-off).

    ``url``: ``redis-cluster://HOST:PORT[,HOST:PORT...][?buckets=N]`` (seed nodes; default 32
    buckets). ``client``: an existing ``RedisCluster`` to use; ``reachability`` as
    ``RedisBlockIndex``'s (down while any bucket's shard is). Thread safety as
    ``RedisBlockIndex``; the chain roots and batch numbers publishing keeps are under a lock.
    """

    def __init__(
        self,
        namespace: IndexNamespace,
        url: str,
        *,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        client: RedisCluster | None = None,
        clock: Callable[[], float] = time.monotonic,
        reachability: Reachability | None = None,
    ) -> None:
        _, self.num_buckets = parse_cluster_url(url)
        client = client or cluster_client(
            url, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s
        )
        super().__init__(
            namespace, url, client=client, retry_interval_s=retry_interval_s, clock=clock,  # type: ignore[arg-type]
            reachability=reachability,
        )
        self._num_route_keys = 1
        self.bucket_prefixes = bucket_prefixes(namespace.key_prefix, self.num_buckets)
        self._slot_of_prefix = {p: key_slot(p.encode()) for p in self.bucket_prefixes}
        self._publish_lock = threading.Lock()
        # node -> lookup key -> (root key, the groups holding it): the bucket of every held
        # block (a repeated store or remove of a group changes nothing)
        self._roots: dict[str, dict[bytes, tuple[bytes, set[int]]]] = {}
        self._seqs: dict[str, NodeSeqs] = {}

    @property
    def client(self) -> RedisCluster:
        """The ``RedisCluster`` client (for tools: shard of a bucket, key counts)."""
        return self._client  # type: ignore[return-value]

    def _prompt_prefix(self, first_key: bytes) -> str:
        return self.bucket_prefixes[bucket_of(first_key, self.num_buckets)]

    def _pool_of(self, prefix: str) -> ConnectionPool | None:
        """The pool of the primary that owns the bucket ``prefix``'s slot, from the client's slot
        map (no round trip; the map is redis-py's, refreshed by its generic path on a redirect or
        a broken connection). Raises SlotNotCoveredError for a slot without a known owner."""
        client = self.client
        node = client.nodes_manager.get_node_from_slot(self._slot_of_prefix[prefix])
        return client.get_redis_connection(node).connection_pool

    def shard_of_prompt(self, first_key: bytes) -> str:
        """``host:port`` of the primary that holds the bucket of a prompt whose block 0 has
        lookup key ``first_key`` (from the client's slot map; no round trip)."""
        slot = self.client.keyslot(self._prompt_prefix(first_key))
        return self.client.nodes_manager.get_node_from_slot(slot).name

    # -- life ------------------------------------------------------------------------------------
    def _every_bucket(self, what: str, script: Any, node_id: str, incarnation: int,
                      ttl_s: float, *, some: bool = False,
                      registering: Collection[int] = ()) -> tuple[IndexStatus, list[Any]]:
        """Run ``script`` in every bucket (``REGISTER`` in those of ``registering``): "fenced"
        if any refused, "unavailable" if any did not answer (with ``some``: if none answered),
        else "ok"; and each bucket's reply (None: unanswered)."""
        check_node_id(node_id)
        args = (node_id, self._inc_str(incarnation), _ttl_ms(ttl_s))
        replies = [self._call(*(("register", _REGISTER) if b in registering else (what, script)),
                              prefix, *args) for b, prefix in enumerate(self.bucket_prefixes)]
        if any(reply == 0 for reply in replies):
            return "fenced", replies
        unanswered = [reply is None for reply in replies]
        return "unavailable" if (all if some else any)(unanswered) else "ok", replies

    def register_node(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        """As ``RedisBlockIndex.register_node``, in every bucket: "ok" once any bucket answered
        and none refused. A bucket that did not answer is registered by the node's next
        heartbeat, or before its next parked part is sent (module docstring)."""
        status, replies = self._every_bucket("register", _REGISTER, node_id, incarnation, ttl_s,
                                             some=True)
        with self._publish_lock:
            seqs = self._seqs.get(node_id)
            if seqs is None or seqs.incarnation != incarnation:
                seqs = self._seqs[node_id] = NodeSeqs(incarnation, self.num_buckets)
                self._roots[node_id] = {}
            else:  # registered again (fenced): its resync covers what is parked or lost
                self.stats.publish_ops_dropped += seqs.drop_parked()
                seqs.lost.clear()
            seqs.unregistered = {b for b, reply in enumerate(replies) if reply is None}
            seqs.ttl_s = ttl_s
        return status

    def heartbeat(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        """As ``RedisBlockIndex.heartbeat``, in every bucket, but "unavailable" only when none
        answered (the live buckets take a resync while one shard is down). A bucket the
        registration missed is registered instead; a ``lost`` one answering says "fenced"."""
        with self._publish_lock:
            seqs = self._seqs.get(node_id)
            known = seqs is not None and seqs.incarnation == incarnation
            registering = set(seqs.unregistered) if known else set()  # type: ignore[union-attr]
            lost = set(seqs.lost) if known else set()  # type: ignore[union-attr]
        status, replies = self._every_bucket("heartbeat", _HEARTBEAT, node_id, incarnation,
                                             ttl_s, some=True, registering=registering)
        if None in replies:
            self.stats.heartbeats_failed += 1
        if registering:
            with self._publish_lock:
                seqs.unregistered -= {b for b in registering if replies[b] == 1}  # type: ignore[union-attr]
        return "fenced" if any(replies[b] is not None for b in lost) else status

    def parked_parts(self, node_id: str) -> ParkedParts:
        """``node_id``'s parked parts (module docstring; ``IndexWorker.flush`` and
        ``needs_resync`` read them)."""
        with self._publish_lock:
            seqs = self._seqs.get(node_id)
            if seqs is None:
                return ParkedParts()
            heads = [parts[0] for parts in seqs.parked.values() if parts]
            return ParkedParts(seqs.num_parked_parts, sum(part.tries < 2 for part in heads),
                               min((part.node_seq for part in heads), default=0))

    def send_parked(self, node_id: str, incarnation: int) -> IndexStatus:
        """Send ``node_id``'s parked parts again, oldest first in each bucket (a backed-off
        bucket waits for its back-off to end): "ok" when none is left, "unavailable" when some
        are, "fenced" when one was refused (the node registers again and resyncs)."""
        seqs = self._seqs.get(node_id)
        if seqs is None or seqs.incarnation != incarnation:
            return "ok"
        if self._send_parked(node_id, self._inc_str(incarnation), seqs) & {0, 2}:
            return "fenced"
        return "unavailable" if seqs.num_parked_parts else "ok"

    # -- publish ---------------------------------------------------------------------------------
    def publish(
        self,
        node_id: str,
        incarnation: int,
        events: Iterable[Any],
        *,
        default_tier: Tier = "device",
        seq: tuple[int, int] | None = None,
        resync: bool = False,
    ) -> PublishResult:
        check_node_id(node_id)
        check_seq(seq)
        ops = events_to_ops(events, default_tier)
        inc = self._inc_str(incarnation)
        with self._publish_lock:
            seqs = self._seqs.get(node_id)
            if seqs is None or seqs.incarnation != incarnation:
                seqs = self._seqs[node_id] = NodeSeqs(incarnation, self.num_buckets)
            if seq is not None and seq[1] <= seqs.last_batch:
                self.stats.publishes_replayed += 1
                return PublishResult("replayed", len(ops))
            if seq is not None and not resync and seq[0] != seqs.last_batch + 1:
                self.stats.publishes_gap += 1  # a batch between was never handed to us
                return PublishResult("gap", len(ops))
            bucket_to_ops = self._split(node_id, ops, resync)
            packed = {b: pack_ops(bucket_ops, self._key_hash_bytes)  # (raises before parking)
                      for b, bucket_ops in bucket_to_ops.items()}
            if resync:  # the set's clear covers every part parked or lost before it
                self.stats.publish_ops_dropped += seqs.drop_parked()
                seqs.lost.clear()
            numbers = self._numbers(seqs, seq, bucket_to_ops)
            for b, bucket_ops in bucket_to_ops.items():  # each bucket's part, behind its own
                if b in seqs.lost:
                    self.stats.publish_ops_dropped += len(bucket_ops)
                elif seq is not None:
                    seqs.park(b, ParkedPart(numbers[b], packed[b], len(bucket_ops), resync,
                                            seq[1]))
        if seq is None:  # unnumbered: never sent again (a late first try could apply twice)
            replies = {self._publish_at(self.bucket_prefixes[b], node_id, inc, packed[b], (0, 0),
                                        resync) for b in bucket_to_ops}
            if None in replies:
                return self._count_publish(None, len(ops), resync)
        else:
            replies = self._send_parked(node_id, inc, seqs)
        with self._publish_lock:
            if seqs.num_parked_ops > MAX_PARKED_OPS:  # those buckets resync once they answer
                self.stats.publish_ops_dropped += seqs.drop_parked(lose=True)
        # The worst answer speaks for the batch: refused, out of order, else applied (a part
        # left unanswered is parked: it lands later, or the node resyncs).
        for worst in (0, 2):
            if worst in replies:
                return self._count_publish(worst, len(ops), resync)
        reply = 3 if replies == {3} else 4 if 4 in replies else 1
        return self._count_publish(reply, len(ops), resync)

    def _send_parked(self, node_id: str, inc: str, seqs: NodeSeqs) -> set[Any]:
        """Send each bucket's parked parts, oldest first (``cluster_parts.next_call``), up to
        the first call left unanswered, ``PARKED_CALLS_PER_TURN`` calls a bucket at most;
        returns the answers (``PUBLISH_LUA``'s). A refusal (0, 2) drops every parked part: the
        node resyncs. The node's one publishing thread; parts read under the publish lock."""
        replies: set[Any] = set()
        with self._publish_lock:
            buckets = list(seqs.parked)
        for b in buckets:
            prefix = self.bucket_prefixes[b]
            for _ in range(PARKED_CALLS_PER_TURN):
                with self._publish_lock:
                    batch = next_call(seqs.parked.get(b))
                    registering = b in seqs.unregistered
                if not batch or self._backed_off(prefix):
                    break  # (none left, or tried once the back-off ends)
                if registering:  # its registration first (module docstring)
                    reply = self._call("register", _REGISTER, prefix, node_id, inc,
                                       _ttl_ms(seqs.ttl_s))
                    if reply is None:
                        break
                    with self._publish_lock:
                        if reply == 0:  # a newer incarnation: the node is fenced
                            self.stats.publish_ops_dropped += seqs.drop_parked()
                            return {0}
                        seqs.unregistered.discard(b)
                for part in batch:
                    part.tries += 1
                reply = self._publish_at(prefix, node_id, inc, packed_call(batch),
                                         (batch[0].number, batch[-1].number), batch[0].resync)
                if reply is None:
                    self.stats.publishes_dropped += 1  # (each unanswered try counts)
                    break
                replies.add(reply)
                with self._publish_lock:
                    if reply in (0, 2):  # refused: the node resyncs, which covers them all
                        self.stats.publish_ops_dropped += seqs.drop_parked()
                        return replies
                    seqs.unpark(b, batch)
        return replies

    def _backed_off(self, prefix: str) -> bool:
        """Calls to the bucket ``prefix`` are backed off now (after trouble: ``_call``)."""
        down_until = self._down_until.get(prefix)
        return down_until is not None and self._clock() < down_until

    def _split(
        self, node_id: str, ops: Sequence[IndexOp], resync: bool
    ) -> dict[int, list[IndexOp]]:
        """Each op in the bucket of its chain's root (a clear, or a resync: every bucket), in
        order; follows the node's roots. Called under the publish lock."""
        roots = self._roots.setdefault(node_id, {})
        key_len = self._key_hash_bytes
        every = range(self.num_buckets)
        out: dict[int, list[IndexOp]] = {b: [] for b in every} if resync else {}
        for op in ops:
            if op.kind == "C":
                roots.clear()
                for b in every:
                    out.setdefault(b, []).append(op)
                continue
            key = op.block_hash[:key_len]
            known = roots.get(key)
            if op.kind == "S":
                if known is None:
                    parent = roots.get(op.parent_hash[:key_len]) if op.parent_hash else None
                    # Block 0 is its own root; a child of an unknown parent falls back to its
                    # own bucket (a lookup then misses it: a recompute, never a wrong hit).
                    known = roots[key] = (key if parent is None else parent[0], set())
                known[1].add(op.group_id)
                root = known[0]
            else:
                root = key if known is None else known[0]
                if known is not None:
                    known[1].discard(op.group_id)
                    if not known[1]:
                        del roots[key]
            out.setdefault(bucket_of(root, self.num_buckets), []).append(op)
        return out

    def _numbers(
        self, seqs: NodeSeqs, seq: tuple[int, int] | None, bucket_to_ops: dict[int, list[IndexOp]]
    ) -> dict[int, int]:
        """Each touched bucket's batch number for this call ({}: unnumbered). Called under the
        publish lock."""
        if seq is None:
            return {}
        numbers = {}
        for b in bucket_to_ops:
            numbers[b] = seqs.next[b]
            seqs.next[b] += 1
        seqs.last_batch = seq[1]
        return numbers

    # -- reads -------------------------------------------------------------------------------------
    def node_entries(self, node_id: str) -> set[tuple[int, bytes, int]] | None:
        check_node_id(node_id)
        found = [self._node_entries_at(prefix, node_id) for prefix in self.bucket_prefixes]
        if all(entries is None for entries in found):
            return None
        return set().union(*(entries for entries in found if entries is not None))

    def keys_per_shard(self) -> dict[str, int]:
        """Keys of this namespace on each primary (``host:port``): ``CLUSTER COUNTKEYSINSLOT`` of
        each bucket's slot. For benchmarks and tools."""
        out: dict[str, int] = {}
        client: RedisCluster = self._client  # type: ignore[assignment]
        for prefix in self.bucket_prefixes:
            slot = client.keyslot(prefix)
            node = client.nodes_manager.get_node_from_slot(slot)
            count = client.execute_command("CLUSTER COUNTKEYSINSLOT", slot, target_nodes=node)
            out[node.name] = out.get(node.name, 0) + int(count)
        return out

    def _disconnect_all(self) -> None:
        self._client.disconnect_connection_pools()  # type: ignore[attr-defined]
