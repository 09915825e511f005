"""``RedisBlockIndex``: the cross-node block index on a real Redis (redis-py), one round trip.

Contract: ``BlockIndex`` in ``protocol.py`` (docs/architecture.md, "The block index"). Every
call is one ``EVALSHA`` of a server-side Lua script; a server that does not know the script
(restarted, flushed) gets the call again as ``EVAL`` with the source, which also caches it
there. A longest-prefix lookup of any number of hashes costs one round trip, and so do the lookups
of many prompts at once (``longest_prefixes``: ``redis_lookup_many.py``). Writes go through
the client's ``execute_command``; the lookups (``longest_prefix``, ``get_block_ids``) are packed
here and sent on a connection of the client's pool that the calling thread keeps
(``redis_direct.py``: redis-py's generic command path and the pool's hand-out cost a lookup
more than the script's own server time), falling back to ``execute_command`` for what only it
handles (a script the server does not know, a cluster's redirects).

Key layout, scripts and the O(log N) lookup: ``redis_scripts.py`` (reads of a holder's own
entries: ``redis_held_lookup.py``). A lookup sends the hashes cut to ``key_hash_bytes`` (5 KB
for 625 hashes, under redis-py's 6,000-byte single-buffer cut-off).

Redis trouble (unreachable, slower than ``socket_timeout_s``, erroring) never raises out of this
class: a lookup answers ``NO_HIT``, a publish ``"unavailable"`` (``worker.py`` makes it again),
both counted in ``stats``; for ``retry_interval_s`` after a failure calls are answered so
without trying, then the next call tries again (redis-py reconnects). The log says so once per
outage, and once when Redis answers again (``reachability.Reachability``). Garbage in the
namespace (entries of the wrong length or tier, records of the wrong type) is skipped and
counted in ``stats.garbage_entries``.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.connection import ConnectionPool
from redis.exceptions import NoScriptError
from redis.retry import Retry

from . import redis_held_lookup as held
from . import redis_lookup_many as many
from . import redis_scripts as scripts
from .protocol import (
    INCARNATION_DIGITS,
    NO_HIT,
    IndexNamespace,
    IndexStats,
    IndexStatus,
    ParkedParts,
    PrefixHit,
    PublishResult,
    Tier,
    check_incarnation,
    check_lookup_args,
    check_node_id,
    check_seq,
    check_ttl,
    iter_event_ops,
    join_keys,
)
from .reachability import Reachability
from .redis_direct import LEFT_TO_GENERIC_PATH, HeldConnections, PackedArgs, ScriptHead
from .redis_entries import read_node_entries
from .redis_publish import ARGS_PER_OP, PUBLISH_LUA, count_publish, pack_ops

if TYPE_CHECKING:
    from kvbridge.kvmanager import PrefixHitRule

_TROUBLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ResponseError,
    OSError,
    redis.exceptions.RedisClusterException,  # a cluster without a slot's owner, or no node at all
    redis.exceptions.ClusterError,
)
# What redis-py raises from a call whose socket ``interrupt()`` closed under it on another thread
# (``'NoneType' object has no attribute 'sendall'``; a closed socket handed to ``select``):
# Redis trouble when an interrupt came during the call, a bug otherwise.
_TORN_BY_INTERRUPT = (AttributeError, TypeError)


class _Script(NamedTuple):
    """A Lua script and its SHA1 (the name ``EVALSHA`` calls it by)."""

    source: str
    sha: str


def _script(source: str) -> _Script:
    return _Script(source, hashlib.sha1(source.encode()).hexdigest())


_REGISTER = _script(scripts.REGISTER_LUA)
_HEARTBEAT = _script(scripts.HEARTBEAT_LUA)
_PUBLISH = _script(PUBLISH_LUA)
_LOOKUP = _script(scripts.LOOKUP_LUA)
_GET_BLOCK_IDS = _script(held.GET_BLOCK_IDS_LUA)
_LOOKUP_HELD = _script(held.LOOKUP_HELD_LUA)
_LOOKUP_MANY = _script(many.LOOKUP_MANY_LUA)


class RedisBlockIndex:
    """``BlockIndex`` on Redis. ``url``: ``redis://host:port/db``. Timeouts are seconds.

    ``client``: an existing ``redis.Redis`` (bytes responses) to use instead of one built from
    ``url``. ``clock``: monotonic seconds, for the retry back-off. ``reachability``: the
    backend's up/down state and log lines, shared with the node directory on the same server
    (default: one of its own for ``url``).
    """

    def __init__(
        self,
        namespace: IndexNamespace,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        client: redis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        reachability: Reachability | None = None,
    ) -> None:
        self.namespace = namespace
        self.reachability = reachability or Reachability(
            url, retry_interval_s=retry_interval_s, clock=clock)
        self.stats = IndexStats()
        self._prefix = namespace.key_prefix
        self._key_hash_bytes = namespace.key_hash_bytes
        self._client = client or redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast; the back-off below decides when to retry
        )
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        # key prefix -> back-off deadline, while the server holding that prefix is considered
        # down (one prefix on one server; a cluster backs off per hash-tag bucket).
        self._down_until: dict[str, float] = {}
        self._available = True
        self._num_route_keys = 0  # scripts name no key (one server); a cluster routes by one
        self._execute = self._client.execute_command
        self._heads: dict[tuple[str, str], ScriptHead] = {}  # (script sha, prefix) -> its head
        self._lookup_conns = HeldConnections()  # per thread and pool, kept
        self._num_interrupts = 0  # interrupt() calls so far

    # -- Redis trouble -------------------------------------------------------------------------

    def _on_success(self, prefix: str) -> None:
        if self._down_until.pop(prefix, None) is not None:
            self.stats.reconnects += 1
            self.reachability.answered(prefix)

    def _on_trouble(
        self, what: str, exc: Exception, prefix: str | None = None, started: int | None = None
    ) -> None:
        """Count, log and back off after ``exc``. ``started``: ``_num_interrupts`` when the call
        began; an ``exc`` of ``_TORN_BY_INTERRUPT`` with no interrupt since is raised again."""
        if isinstance(exc, _TORN_BY_INTERRUPT) and started == self._num_interrupts:
            raise exc
        prefix = prefix or self._prefix
        kind = type(exc).__name__
        self.stats.errors_by_kind[kind] = self.stats.errors_by_kind.get(kind, 0) + 1
        self._available = False
        self.reachability.failed(prefix, exc)  # (logged once per outage, not per call)
        self._down_until[prefix] = self._clock() + self._retry_interval_s

    def _call(self, what: str, script: _Script, *args: Any, known: bool = True) -> Any:
        """Run one script (``EVALSHA sha 0 *args``; on a cluster ``EVALSHA sha 1 prefix *args``,
        routed by the key prefix ``args[0]``); None on Redis trouble (counted by the caller,
        logged here) or while that prefix's server is backed off after trouble. ``known``:
        False when the server has just answered that it does not know the script (``EVAL``
        straight away)."""
        prefix = args[0]
        down_until = self._down_until.get(prefix)
        if down_until is not None and self._clock() < down_until:
            self._available = False
            return None
        route = (prefix,) if self._num_route_keys else ()
        started = self._num_interrupts
        try:
            try:
                if not known:
                    raise NoScriptError
                reply = self._execute("EVALSHA", script.sha, self._num_route_keys, *route, *args)
            except NoScriptError:  # EVAL runs and caches it on the server that owns the key
                reply = self._execute("EVAL", script.source, self._num_route_keys, *route, *args)
        except (*_TROUBLE, *_TORN_BY_INTERRUPT) as exc:
            self._on_trouble(what, exc, prefix, started)
            return None
        self._available = True
        if down_until is not None:
            self._on_success(prefix)
        return reply

    def _call_direct(self, what: str, script: _Script, *args: Any,
                     packed: PackedArgs | None = None) -> Any:
        """``_call`` for the lookups (a few small arguments and the keys' blob) and the publishes
        (their ops' arguments in ``packed``, written in one pass: ``redis_publish``)
        through ``redis_direct``: one pre-packed ``EVALSHA`` on the calling thread's held
        connection to the server that owns the key prefix ``args[0]`` (``_pool_of``). What that
        path leaves to the generic one (``LEFT_TO_GENERIC_PATH``) goes through ``_call``, as
        does every call for a prefix that met trouble until one succeeds (the generic path
        reconnects, and on a cluster refreshes the slot map after a broken connection); the
        rest as ``_call``."""
        prefix = args[0]
        if prefix in self._down_until:
            return self._call(what, script, *_plain(args, packed))  # backed off, or first try
        started = self._num_interrupts
        try:
            pool = self._pool_of(prefix)
            if pool is None:
                return self._call(what, script, *_plain(args, packed))
            head = self._heads.get((script.sha, prefix))
            if head is None:
                route = prefix if self._num_route_keys else None
                head = self._heads[(script.sha, prefix)] = ScriptHead(script.sha, route)
            reply = self._lookup_conns.send(pool, head.pack(args, packed))
        except NoScriptError:
            return self._call(what, script, *_plain(args, packed), known=False)
        except LEFT_TO_GENERIC_PATH:
            return self._call(what, script, *_plain(args, packed))
        except (*_TROUBLE, *_TORN_BY_INTERRUPT) as exc:
            self._on_trouble(what, exc, prefix, started)
            return None
        self._available = True
        return reply

    def _pool_of(self, prefix: str) -> ConnectionPool | None:
        """The connection pool of the server that owns key prefix ``prefix``; None: go the
        generic way (a client pinned to one connection, which the pool does not hand out)."""
        if self._client.connection is not None:
            return None
        return self._client.connection_pool

    def _prompt_prefix(self, first_key: bytes) -> str:
        """The key prefix of a prompt whose block 0 has lookup key ``first_key`` (one server:
        the namespace's; a cluster: its bucket's hash tag)."""
        return self._prefix

    # -- BlockIndex ----------------------------------------------------------------------------

    @staticmethod
    def _inc_str(incarnation: int) -> str:
        check_incarnation(incarnation)
        return str(incarnation).zfill(INCARNATION_DIGITS)

    def register_node(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        check_node_id(node_id)
        args = (self._prefix, node_id, self._inc_str(incarnation), _ttl_ms(ttl_s))
        reply = self._call("register", _REGISTER, *args)
        if reply is None:
            return "unavailable"
        return "ok" if reply == 1 else "fenced"

    def heartbeat(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        check_node_id(node_id)
        args = (self._prefix, node_id, self._inc_str(incarnation), _ttl_ms(ttl_s))
        reply = self._call("heartbeat", _HEARTBEAT, *args)
        if reply == 1:
            return "ok"
        self.stats.heartbeats_failed += 1
        return "unavailable" if reply is None else "fenced"

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
        ops = pack_ops(iter_event_ops(events, default_tier), self._key_hash_bytes)
        reply = self._publish_at(
            self._prefix, node_id, self._inc_str(incarnation), ops, seq or (0, 0), resync
        )
        return self._count_publish(reply, ops.count // ARGS_PER_OP, resync)

    def _publish_at(
        self, prefix: str, node_id: str, inc: str, ops: PackedArgs,
        seq: tuple[int, int], resync: bool,
    ) -> Any:
        """One PUBLISH script call under ``prefix`` of ``ops`` (``pack_ops``); its reply (None:
        Redis trouble)."""
        return self._call_direct("publish", _PUBLISH, prefix, node_id, inc, seq[0], seq[1],
                                 b"1" if resync else b"0", packed=ops)

    def _count_publish(self, reply: Any, num_ops: int, resync: bool) -> PublishResult:
        return count_publish(self.stats, reply, num_ops, resync, self._clock())

    def longest_prefix(
        self,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        *,
        exclude_node_ids: Iterable[str] = (),
        all_holders: bool = False,
        hit_rule: PrefixHitRule | None = None,
    ) -> PrefixHit:
        # Hot path (benchmarks/bench_index.py): one join and one strided copy for the keys, one
        # EVALSHA, a flat reply read without a second pass over it.
        if not group_ids:
            raise ValueError("group_ids must name at least one KV cache group")
        self.stats.lookups += 1
        if not block_hashes:
            return NO_HIT
        keys, key_len = join_keys(block_hashes, self._key_hash_bytes)
        if hit_rule is not None and not hit_rule.only_full_attention:
            return self._lookup_held(
                block_hashes, keys, key_len, group_ids, hit_rule, tuple(exclude_node_ids),
                all_holders,
            )
        reply = self._call_direct(
            "lookup", _LOOKUP, self._prompt_prefix(keys[:key_len]), key_len, keys,
            b"1" if all_holders else b"0", len(group_ids), *group_ids, *exclude_node_ids,
        )
        if reply is None:
            self.stats.lookups_failed += 1
            return NO_HIT
        return many.hit_of_reply(reply, self.stats, self._clock())

    def longest_prefixes(
        self, prompts: Sequence[Sequence[bytes]], group_ids: Sequence[int] = (0,), *,
        exclude_node_ids: Iterable[str] = (), hit_rule: PrefixHitRule | None = None,
    ) -> list[PrefixHit]:
        # One EVALSHA per server (a cluster: per bucket) for them all (redis_lookup_many.py).
        excluded = tuple(exclude_node_ids)
        if not group_ids or (hit_rule is not None and not hit_rule.only_full_attention):
            return [self.longest_prefix(hashes, group_ids, exclude_node_ids=excluded,
                                        hit_rule=hit_rule) for hashes in prompts]
        hits = [NO_HIT] * len(prompts)
        self.stats.lookups += len(prompts)
        for prefix, call in many.calls_of(prompts, self._key_hash_bytes, self._prompt_prefix):
            reply = self._call_direct(
                "lookup", _LOOKUP_MANY, *many.lookup_many_args(prefix, call, group_ids, excluded))
            if reply is None:
                self.stats.lookups_failed += len(call)
                continue
            now_s = self._clock()
            for i, one in many.replies_of(call, reply):
                hits[i] = many.hit_of_reply(one, self.stats, now_s)
        return hits

    def _lookup_held(
        self, block_hashes: Sequence[bytes], keys: bytes, key_len: int, group_ids: Sequence[int],
        hit_rule: PrefixHitRule, exclude_node_ids: Sequence[str], all_holders: bool,
    ) -> PrefixHit:
        """``longest_prefix`` under a hit rule with a group that is not full attention."""
        prefix = self._prompt_prefix(keys[:key_len])
        args = held.held_lookup_args(prefix, key_len, keys, group_ids, hit_rule, exclude_node_ids)
        reply = self._call_direct("lookup", _LOOKUP_HELD, *args)
        try:
            garbage, holders = (0, []) if reply is None else held.holders_of_held_reply(
                reply, block_hashes, group_ids, hit_rule, key_len, self.namespace.block_size
            )
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self._on_trouble("lookup", exc, prefix)
            reply = None
        if reply is None:
            self.stats.lookups_failed += 1
            return NO_HIT
        self.stats.count_garbage(garbage, self._clock())
        hit = held.hit_of_holders(holders, all_holders)
        if hit.num_blocks:
            self.stats.lookup_hits += 1
        return hit

    def parked_parts(self, node_id: str) -> ParkedParts:  # (a call lands whole or not)
        return ParkedParts()

    def send_parked(self, node_id: str, incarnation: int) -> IndexStatus:
        return "ok"

    def node_entries(self, node_id: str) -> set[tuple[int, bytes, int]] | None:
        """The node's live entries, read with plain commands (not atomic; tests and tools)."""
        check_node_id(node_id)
        return self._node_entries_at(self._prefix, node_id)

    def _node_entries_at(self, prefix: str, node_id: str) -> set[tuple[int, bytes, int]] | None:
        try:
            return read_node_entries(self._client, prefix, node_id)
        except _TROUBLE as exc:
            self._on_trouble("node_entries", exc, prefix)
            return None

    def get_block_ids(
        self,
        node_id: str,
        incarnation: int,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
    ) -> list[list[int]] | None:
        check_lookup_args(block_hashes, group_ids)
        check_node_id(node_id)
        if not block_hashes:
            return [[] for _ in group_ids]
        keys, key_len = join_keys(block_hashes, self.namespace.key_hash_bytes)
        reply = self._call_direct(
            "get_block_ids", _GET_BLOCK_IDS,
            self._prompt_prefix(keys[:key_len]), node_id, self._inc_str(incarnation), key_len,
            keys, *group_ids,
        )
        if not reply:
            return None
        count = len(block_hashes)
        return [list(struct.unpack(f">{count}I", packed)) for packed in reply]

    @property
    def available(self) -> bool:
        """False from a call that met Redis trouble until a later call succeeds."""
        return self._available

    def interrupt(self) -> None:
        """Close every connection of the client, those in use by other threads included: their
        calls fail at once as Redis trouble (counted, back-off started); later calls reconnect."""
        self._num_interrupts += 1  # first: a call it tears knows of it
        self._disconnect_all()

    def _disconnect_all(self) -> None:
        self._client.connection_pool.disconnect()

    def close(self) -> None:
        self._client.close()


def _plain(args: tuple[Any, ...], packed: PackedArgs | None) -> tuple[Any, ...]:
    """``args`` then ``packed``'s arguments, for the generic path."""
    return args if packed is None else (*args, *packed.unpacked())


def _ttl_ms(ttl_s: float) -> int:
    check_ttl(ttl_s)
    return max(1, round(ttl_s * 1000))
