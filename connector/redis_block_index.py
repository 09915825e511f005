"""``RedisBlockIndex``: the cross-node block index on a real Redis (redis-py), one round trip.

Contract: ``BlockIndex`` in ``block_index.py`` (DESIGN.md, "Block index"). Every call is one
``EVALSHA`` of a server-side Lua script (redis-py ``register_script`` caches it and reloads it after
a Redis restart), so a longest-prefix lookup of any number of hashes costs one round trip.

Keys, ``P`` = ``IndexNamespace.key_prefix`` (model, block size, hash function):

- ``P:nodes``               set of node ids ever registered (dead ones are dropped by lookups)
- ``P:maxinc``              hash node id -> highest incarnation registered (no TTL; fencing)
- ``P:node:<node>``         current incarnation (20-digit decimal), TTL refreshed by heartbeats
- ``P:blk:<node>:<inc>:<g>`` hash block_hash -> 5-byte entry (``ENTRY_STRUCT``), same TTL
- ``P:keys:<node>``         set of the node's ``blk`` keys, same TTL

The incarnation is part of every entry key, so a lookup never reads another incarnation's entries;
registering a newer incarnation unlinks the older keys, and a stopped node's keys expire with its
TTL. Scripts name keys they build from ARGV (fine on a single Redis, not on Redis Cluster).

Redis trouble (unreachable, slower than ``socket_timeout_s``, erroring) never raises out of this
class: a lookup answers ``NO_HIT``, a publish is dropped, both counted in ``stats`` with a logged
warning; for ``retry_interval_s`` after a failure calls are answered the same way without trying,
then the next call tries again (redis-py reconnects). Garbage found in the namespace (entries of the
wrong length or tier, records of the wrong type) is skipped and counted in
``stats.garbage_entries``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .block_index import (
    ENTRY_STRUCT,
    INCARNATION_DIGITS,
    NO_HIT,
    TIER_TO_CODE,
    Holder,
    IndexNamespace,
    IndexStats,
    IndexStatus,
    PrefixHit,
    PublishResult,
    Tier,
    check_incarnation,
    check_lookup_args,
    check_node_id,
    events_to_ops,
    make_holder,
    sort_holders,
)

logger = logging.getLogger(__name__)

# ARGV: P, node, inc, ttl_ms.  -> 1 registered, 0 refused (a newer incarnation exists).
_REGISTER_LUA = """
local P, node, inc, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local maxinc = redis.call('HGET', P .. ':maxinc', node)
if maxinc and inc < maxinc then return 0 end
redis.call('HSET', P .. ':maxinc', node, inc)
local nodekey, keyset = P .. ':node:' .. node, P .. ':keys:' .. node
local cur = redis.call('GET', nodekey)
local keys = redis.call('SMEMBERS', keyset)
if cur == inc then
  for _, k in ipairs(keys) do redis.call('PEXPIRE', k, ttl) end
  redis.call('PEXPIRE', keyset, ttl)
else
  for _, k in ipairs(keys) do redis.call('UNLINK', k) end
  redis.call('DEL', keyset)
end
redis.call('SET', nodekey, inc, 'PX', ttl)
redis.call('SADD', P .. ':nodes', node)
return 1
"""

# ARGV: P, node, inc, ttl_ms.  -> 1 alive, 0 fenced (expired or not the current incarnation).
_HEARTBEAT_LUA = """
local P, node, inc, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local nodekey, keyset = P .. ':node:' .. node, P .. ':keys:' .. node
if redis.call('GET', nodekey) ~= inc then return 0 end
redis.call('PEXPIRE', nodekey, ttl)
for _, k in ipairs(redis.call('SMEMBERS', keyset)) do redis.call('PEXPIRE', k, ttl) end
redis.call('PEXPIRE', keyset, ttl)
return 1
"""

# ARGV: P, node, inc, then 4 per op: kind, group, hash, value.  S: value = packed entry;
# R, C: value = tier code (R deletes only an entry of that tier, C every entry of that tier).
# -> 1 applied, 0 fenced.
_PUBLISH_LUA = """
local P, node, inc = ARGV[1], ARGV[2], ARGV[3]
local nodekey, keyset = P .. ':node:' .. node, P .. ':keys:' .. node
if redis.call('GET', nodekey) ~= inc then return 0 end
local base = P .. ':blk:' .. node .. ':' .. inc .. ':'
local touched = {}
for i = 4, #ARGV, 4 do
  local kind, h, v = ARGV[i], ARGV[i + 2], ARGV[i + 3]
  local key = base .. ARGV[i + 1]
  if kind == 'S' then
    redis.call('HSET', key, h, v)
    if not touched[key] then
      touched[key] = true
      redis.call('SADD', keyset, key)
    end
  elseif kind == 'R' then
    local old = redis.call('HGET', key, h)
    if old and string.sub(old, 5, 5) == v then redis.call('HDEL', key, h) end
  else
    for _, k in ipairs(redis.call('SMEMBERS', keyset)) do
      local flat = redis.call('HGETALL', k)
      for j = 1, #flat, 2 do
        if string.sub(flat[j + 1], 5, 5) == v then redis.call('HDEL', k, flat[j]) end
      end
    end
  end
end
local pttl = redis.call('PTTL', nodekey)
if pttl > 0 then
  for k in pairs(touched) do redis.call('PEXPIRE', k, pttl) end
  redis.call('PEXPIRE', keyset, pttl)
end
return 1
"""

# ARGV: P, hash_len, hashes (concatenated), num_groups, group ids..., excluded node ids...
# -> {garbage, then per holder: node, inc, run, packed entries of each group}.
# Each node's run is read with HMGET in doubling chunks (16, 32, ...) and stops at its first miss,
# so a node holding nothing costs one small HMGET and a node holding everything about N fields.
_LOOKUP_LUA = """
local P, L, blob, ng = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local n = #blob / L
local hashes = {}
for i = 1, n do hashes[i] = string.sub(blob, (i - 1) * L + 1, i * L) end
local groups, excluded = {}, {}
for i = 1, ng do groups[i] = ARGV[4 + i] end
for i = 5 + ng, #ARGV do excluded[ARGV[i]] = true end
local garbage = 0
local function run_of(key, limit)
  local run, chunk, parts = 0, 16, {}
  while run < limit do
    local vals = redis.pcall('HMGET', key, unpack(hashes, run + 1, math.min(limit, run + chunk)))
    if type(vals) ~= 'table' or vals.err then
      garbage = garbage + 1
      return run, parts
    end
    for j = 1, #vals do
      local v = vals[j]
      if not v then return run, parts end
      local t = string.byte(v, 5)
      if #v ~= 5 or (t ~= 100 and t ~= 104 and t ~= 115) then
        garbage = garbage + 1
        return run, parts
      end
      run = run + 1
      parts[run] = v
    end
    chunk = chunk * 2
  end
  return run, parts
end
local out = {0}
local nodes = redis.pcall('SMEMBERS', P .. ':nodes')
if type(nodes) ~= 'table' or nodes.err then return {1} end
for _, node in ipairs(nodes) do
  if not excluded[node] then
    local inc = redis.pcall('GET', P .. ':node:' .. node)
    if not inc then
      redis.call('SREM', P .. ':nodes', node)
    elseif type(inc) ~= 'string' or not string.match(inc, '^%d+$') then
      garbage = garbage + 1
    else
      local depth, packed = n, {}
      for gi = 1, ng do
        local run, parts = run_of(P .. ':blk:' .. node .. ':' .. inc .. ':' .. groups[gi], depth)
        depth = run
        packed[gi] = parts
        if depth == 0 then break end
      end
      if depth > 0 then
        out[#out + 1] = node
        out[#out + 1] = inc
        out[#out + 1] = depth
        for gi = 1, ng do out[#out + 1] = table.concat(packed[gi], '', 1, depth) end
      end
    end
  end
end
out[1] = garbage
return out
"""

_TROUBLE = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError)


class RedisBlockIndex:
    """``BlockIndex`` on Redis. ``url``: ``redis://host:port/db``. Timeouts are seconds.

    ``client``: an existing ``redis.Redis`` (bytes responses) to use instead of one built from
    ``url``. ``clock``: monotonic seconds, for the retry back-off.
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
    ) -> None:
        self.namespace = namespace
        self.stats = IndexStats()
        self._prefix = namespace.key_prefix
        self._client = client or redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast; the back-off below decides when to retry
        )
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._down_until_s: float | None = None  # set while Redis is considered down
        self._register = self._client.register_script(_REGISTER_LUA)
        self._heartbeat = self._client.register_script(_HEARTBEAT_LUA)
        self._publish = self._client.register_script(_PUBLISH_LUA)
        self._lookup = self._client.register_script(_LOOKUP_LUA)

    # -- Redis trouble -------------------------------------------------------------------------

    def _available(self) -> bool:
        if self._down_until_s is None:
            return True
        return self._clock() >= self._down_until_s

    def _on_success(self) -> None:
        if self._down_until_s is not None:
            self._down_until_s = None
            self.stats.reconnects += 1
            logger.info("block index: Redis reachable again (%s)", self._prefix)

    def _on_trouble(self, what: str, exc: Exception) -> None:
        kind = type(exc).__name__
        self.stats.errors_by_kind[kind] = self.stats.errors_by_kind.get(kind, 0) + 1
        if self._down_until_s is None:
            logger.warning(
                "block index: Redis trouble during %s (%s: %s); falling back to no hit, "
                "retrying in %.2f s", what, kind, exc, self._retry_interval_s,
            )
        self._down_until_s = self._clock() + self._retry_interval_s

    def _call(self, what: str, script: Any, args: list[Any]) -> Any:
        """Run one script; None on Redis trouble (counted by the caller, logged here)."""
        if not self._available():
            return None
        try:
            reply = script(keys=[], args=args)
        except _TROUBLE as exc:
            self._on_trouble(what, exc)
            return None
        self._on_success()
        return reply

    # -- BlockIndex ----------------------------------------------------------------------------

    @staticmethod
    def _inc_str(incarnation: int) -> str:
        check_incarnation(incarnation)
        return str(incarnation).zfill(INCARNATION_DIGITS)

    def register_node(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        check_node_id(node_id)
        args = [self._prefix, node_id, self._inc_str(incarnation), _ttl_ms(ttl_s)]
        reply = self._call("register", self._register, args)
        if reply is None:
            return "unavailable"
        return "ok" if reply == 1 else "fenced"

    def heartbeat(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        check_node_id(node_id)
        args = [self._prefix, node_id, self._inc_str(incarnation), _ttl_ms(ttl_s)]
        reply = self._call("heartbeat", self._heartbeat, args)
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
    ) -> PublishResult:
        check_node_id(node_id)
        ops = events_to_ops(events, default_tier)
        args: list[Any] = [self._prefix, node_id, self._inc_str(incarnation)]
        for op in ops:
            code = TIER_TO_CODE[op.tier]
            value = ENTRY_STRUCT.pack(op.block_id, code) if op.kind == "S" else code
            args += (op.kind, op.group_id, op.block_hash, value)
        reply = self._call("publish", self._publish, args)
        if reply is None:
            self.stats.publishes_dropped += 1
            self.stats.publish_ops_dropped += len(ops)
            return PublishResult("unavailable", len(ops))
        if reply != 1:
            self.stats.publishes_fenced += 1
            return PublishResult("fenced", len(ops))
        self.stats.publishes += 1
        self.stats.publish_ops += len(ops)
        return PublishResult("ok", len(ops))

    def longest_prefix(
        self,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        *,
        exclude_node_ids: Iterable[str] = (),
    ) -> PrefixHit:
        hash_len = check_lookup_args(block_hashes, group_ids)
        self.stats.lookups += 1
        if hash_len == 0:
            return NO_HIT
        args = [
            self._prefix, hash_len, b"".join(block_hashes), len(group_ids),
            *group_ids, *exclude_node_ids,
        ]
        reply = self._call("lookup", self._lookup, args)
        if reply is None:
            self.stats.lookups_failed += 1
            return NO_HIT
        hit = self._parse_lookup(reply, len(group_ids))
        if hit.num_blocks:
            self.stats.lookup_hits += 1
        return hit

    def _parse_lookup(self, reply: list[Any], num_groups: int) -> PrefixHit:
        self.stats.garbage_entries += int(reply[0])
        stride = 3 + num_groups
        holders: list[Holder] = []
        for i in range(1, len(reply), stride):
            node, inc, depth = reply[i], reply[i + 1], reply[i + 2]
            holders.append(
                make_holder(node.decode(), int(inc), int(depth), reply[i + 3 : i + stride])
            )
        return sort_holders(holders)

    def close(self) -> None:
        self._client.close()


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return max(1, round(ttl_s * 1000))
