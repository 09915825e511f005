"""The Redis index's ``PUBLISH`` script (a node's batch of ops, applied at once) and its
arguments, written as RESP in one pass (key layout: ``redis_scripts.py``).

A publish sends five arguments per op (kind, group id, lookup key, parent key, data), so a step
that caches a few hundred blocks is a thousand or more small arguments. Handed one by one to a
generic packer (``redis_direct.ScriptHead.pack``, or redis-py's), each costs a type test, a
length header and three list entries: most of the index thread's time per step, taken from the
engine it shares the interpreter with. ``pack_ops`` writes each op's five bulk strings with one
format instead; ``redis_direct.PackedArgs`` carries them to the sender, which splices them in
(``RedisBlockIndex._call_direct``) or, on the generic path, reads them back as plain arguments.

Thread: any (pure functions).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .index_stats import IndexStats
from .protocol import TIER_TO_CODE, OpFields, PublishResult
from .redis_direct import PackedArgs
from .redis_scripts import DROP_NODE_LUA

__all__ = ["ARGS_PER_OP", "PUBLISH_LUA", "count_publish", "pack_ops"]

ARGS_PER_OP = 5
"""The ``PUBLISH`` script's arguments per op: kind, group id, key, parent key, data."""

# ARGV: P, node, inc, seq first, seq last (0 0: unnumbered), resync ('1'/'0'), then 5 per op:
# kind, group, key, parent key ('' for block 0), data.
# S: data = block id(4) .. tier; run and slowest tier come from the node's parent entry.
# R: data = tier [.. block id(4)]; deletes the node's entry only if they match.
# C: drops every entry of the node.
# Within one call a stored entry's run and slowest tier are remembered (``made``), so a chain's
# blocks after its first read no parent entry; an entry new to the node is written by HSETNX
# (one call: an entry held already is read, then overwritten); entry keys new to the node are
# added to its key set in one SADD (before any remove or clear, and at the end); a group's hole
# hash is only searched when it existed or a remove in this call made a hole (``holed``).
# -> 1 applied, 0 fenced, 2 gap (first != last applied + 1, not a resync), 3 replayed (last <=
# last applied: ignored), 4 applied but for the stores whose entry key holds another type (not
# written by kvbridge: skipped, as lookups skip them). ``P:seq:<n>`` = inc(20) .. ':' .. the
# last batch number applied; it is one of the node's aux keys (same TTL, dropped with the node).
PUBLISH_LUA = DROP_NODE_LUA + """
local P, node, inc = ARGV[1], ARGV[2], ARGV[3]
local sfirst, slast, resync = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local nodekey = P .. ':node:' .. node
if redis.call('GET', nodekey) ~= inc then return 0 end
local keyset, auxset = P .. ':keys:' .. node, P .. ':aux:' .. node
local seqkey = P .. ':seq:' .. node
if sfirst > 0 then
  local sv = redis.pcall('GET', seqkey)
  local last = 0
  if type(sv) == 'string' and string.sub(sv, 1, 20) == inc then
    last = tonumber(string.sub(sv, 22)) or 0
  end
  if slast <= last then return 3 end
  if not resync and sfirst ~= last + 1 then return 2 end
end
local tail = ':' .. node .. ':' .. inc .. ':'
local aux, holed = {}, {}
local function aux_of(g)
  local a = aux[g]
  if not a then
    a = {P .. ':kids' .. tail .. g, P .. ':hp' .. tail .. g, P .. ':holes' .. tail .. g}
    aux[g] = a
    redis.call('SADD', auxset, a[1], a[2], a[3])
    holed[g] = redis.call('EXISTS', a[2]) == 1
  end
  return a
end
local made, added, foreign = {}, {}, 0
local function add_keys()
  if #added > 0 then
    redis.call('SADD', keyset, unpack(added))
    added = {}
  end
end
local function mine(v) return v and #v >= 30 and string.sub(v, 1, 20) == inc end
local function release(a, parent)
  while parent ~= '' do
    if redis.call('HINCRBY', a[1], parent, -1) > 0 then return end
    redis.call('HDEL', a[1], parent)
    local up = redis.call('HGET', a[2], parent)
    if not up then return end
    redis.call('HDEL', a[2], parent)
    redis.call('ZREM', a[3], parent)
    parent = up
  end
end
for i = 7, #ARGV, 5 do
  local kind, g, h, parent, data = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local ekey = P .. ':e:' .. g .. ':' .. h
  if kind == 'S' then
    local a = aux_of(g)
    local run, worst = 0, string.byte(data, 5)
    if parent == '' then
      run = 1
    else
      local known = made[g .. ':' .. parent]
      if known then
        if known[1] > 0 then
          run = known[1] + 1
          worst = math.max(worst, known[2])
        end
      else
        local pv = redis.pcall('HGET', P .. ':e:' .. g .. ':' .. parent, node)
        if mine(pv) then
          local prun = struct.unpack('>I4', pv, 26)
          if prun > 0 then
            run = prun + 1
            worst = math.max(worst, string.byte(pv, 30))
          end
        end
      end
    end
    local entry = inc .. data .. struct.pack('>I4', run) .. string.char(worst) .. parent
    local set = redis.pcall('HSETNX', ekey, node, entry)
    if type(set) ~= 'number' then
      foreign = foreign + 1  -- not a hash: skipped (its children start no run from it)
    else
      local fresh = set == 1
      if fresh or not mine(redis.call('HGET', ekey, node)) then
        if holed[g] and redis.call('HDEL', a[2], h) == 1 then
          redis.call('ZREM', a[3], h)
        elseif parent ~= '' then
          redis.call('HINCRBY', a[1], parent, 1)
        end
        added[#added + 1] = ekey
        if #added >= 512 then add_keys() end
      end
      if not fresh then redis.call('HSET', ekey, node, entry) end
      made[g .. ':' .. h] = {run, worst}
    end
  elseif kind == 'R' then
    add_keys()
    made[g .. ':' .. h] = nil
    local a = aux_of(g)
    local v = redis.pcall('HGET', ekey, node)  -- (a key of another type: not ours)
    if mine(v) and string.sub(v, 25, 25) == string.sub(data, 1, 1)
        and (#data == 1 or string.sub(v, 21, 24) == string.sub(data, 2, 5)) then
      redis.call('HDEL', ekey, node)
      redis.call('SREM', keyset, ekey)
      local vparent = string.sub(v, 31)
      if tonumber(redis.call('HGET', a[1], h) or '0') > 0 then
        redis.call('HSET', a[2], h, vparent)
        holed[g] = true
        local run = struct.unpack('>I4', v, 26)
        if run > 0 then redis.call('ZADD', a[3], run - 1, h) end
      else
        release(a, vparent)
      end
    end
  else
    add_keys()
    drop_node(P, node)
    aux, holed, made = {}, {}, {}
  end
end
add_keys()
local pttl = redis.call('PTTL', nodekey)
if sfirst > 0 then
  redis.call('SET', seqkey, inc .. ':' .. slast)
  redis.call('SADD', auxset, seqkey)
  if pttl > 0 then redis.call('PEXPIRE', seqkey, pttl) end
end
if pttl > 0 then
  for _, a in pairs(aux) do
    for j = 1, 3 do redis.call('PEXPIRE', a[j], pttl) end
  end
end
if foreign > 0 then return 4 end
return 1
"""

_OP = b"$1\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
_KIND = {"S": b"S", "R": b"R", "C": b"C"}


def pack_ops(ops: Iterable[OpFields], key_len: int) -> PackedArgs:
    """``ops`` (``IndexOp`` values or ``protocol.iter_event_ops`` tuples, in order) as the
    ``PUBLISH`` arguments, five per op: the kind (``S``/``R``/``C``), the group id in decimal,
    the block hash and the parent hash cut to ``key_len`` bytes, and the data: a store's block
    id (4 bytes, big-endian) then its tier code; a remove's tier code then its block id (none:
    any block). The bytes are those redis-py would write for the same arguments.

    Raises:
        KeyError: an op of another kind or tier.
        OverflowError: a stored block id outside ``[0, 2**32)``, a removed one above it.
        ValueError: raised by ``ops`` itself (``iter_event_ops``: a malformed event).
    """
    parts: list[bytes] = []
    append = parts.append
    for kind, tier, group_id, block_hash, block_id, parent_hash in ops:
        code = TIER_TO_CODE[tier]
        if kind == "S":
            data = block_id.to_bytes(4, "big") + code  # block id(4) .. tier
        else:
            data = code if block_id < 0 else code + block_id.to_bytes(4, "big")
        group = b"%d" % group_id
        key, parent = block_hash[:key_len], parent_hash[:key_len]
        append(_OP % (_KIND[kind], len(group), group, len(key), key, len(parent), parent,
                      len(data), data))
    return PackedArgs(b"".join(parts), ARGS_PER_OP * len(parts))


_REPLY_TO_STATUS: dict[Any, str] = {
    1: "ok", 0: "fenced", 2: "gap", 3: "replayed",
    4: "ok",  # applied, but for stores whose entry key holds another type (``PUBLISH_LUA``)
}


def count_publish(stats: IndexStats, reply: Any, num_ops: int, resync: bool,
                  now_s: float) -> PublishResult:
    """The ``PublishResult`` of a ``PUBLISH`` call's ``reply`` (None: unanswered), counted in
    ``stats`` (the publishing thread's); ``now_s``: the backend's clock."""
    if reply is None:
        stats.publishes_dropped += 1
        stats.publish_ops_dropped += num_ops
        return PublishResult("unavailable", num_ops)
    if reply == 4:  # one count per call: the script says that some were, not how many
        stats.count_garbage(1, now_s)
    status = _REPLY_TO_STATUS.get(reply, "fenced")
    if status == "fenced":
        stats.publishes_fenced += 1
    elif status == "gap":
        stats.publishes_gap += 1
    elif status == "replayed":
        stats.publishes_replayed += 1
    else:
        stats.publishes += 1
        stats.publish_ops += num_ops
        stats.resyncs += resync
    return PublishResult(status, num_ops)  # type: ignore[arg-type]
