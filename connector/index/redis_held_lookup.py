"""``RedisBlockIndex``'s lookup under a hit rule: the script and the reading of its reply.

A node with sliding-window (or Mamba) groups is looked up by what each holder holds of the
prompt's blocks in each group, not by runs from block 0; ``hit_rule.hit_of_holder`` then applies
the local coordinator's rule. Key layout: ``redis_scripts.py``. One ``EVALSHA``, as every lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .hit_rule import hit_of_holder
from .protocol import CODE_TO_TIER, TIER_RANK, Holder, PrefixHit, sort_holders

if TYPE_CHECKING:
    from kvbridge.kvmanager import PrefixHitRule

__all__ = [
    "GET_BLOCK_IDS_LUA",
    "LOOKUP_HELD_LUA",
    "held_lookup_args",
    "hit_of_holders",
    "holders_of_held_reply",
]

# ARGV: P, node, inc, key_len, keys (concatenated), group ids...
# -> per group the block ids (4 bytes each, concatenated), or nil if any is not held.
GET_BLOCK_IDS_LUA = """
local P, node, inc, L, blob = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
if redis.call('GET', P .. ':node:' .. node) ~= inc then return false end
local out = {}
for gi = 6, #ARGV do
  local ids = {}
  for pos = 0, #blob / L - 1 do
    local key = P .. ':e:' .. ARGV[gi] .. ':' .. string.sub(blob, pos * L + 1, (pos + 1) * L)
    local v = redis.pcall('HGET', key, node)  -- (a key of another type: not held)
    if type(v) ~= 'string' or #v < 30 or string.sub(v, 1, 20) ~= inc then return false end
    ids[pos + 1] = string.sub(v, 21, 24)
  end
  out[#out + 1] = table.concat(ids)
end
return out
"""

# ARGV: P, key_len, keys (concatenated), num_groups, then per group: id, full ('1': a
# full-attention group, whose hit needs every block from block 0), then excluded node ids.
# -> {garbage, then per holder: node, inc, then per group a string of 5 bytes per position
# (block id(4) .. tier; zeros where not held), as many positions as were read}.
# Full-attention groups are read first, block by block from block 0 while some holder's run
# goes on; that bounds the positions read in the other groups (no hit can be longer). Cost: one
# HGETALL per position read and group (a hybrid prompt of N blocks: about N per group).
LOOKUP_HELD_LUA = """
local P, L, blob, ng = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local n = #blob / L
local groups, full, excluded = {}, {}, {}
for i = 1, ng do
  groups[i] = ARGV[3 + 2 * i]
  full[i] = ARGV[4 + 2 * i] == '1'
end
for i = 5 + 2 * ng, #ARGV do excluded[ARGV[i]] = true end
local garbage = 0
local byte, sub = string.byte, string.sub
local function tier_ok(t) return t == 100 or t == 104 or t == 115 end
local incs = {}
local function inc_of(node)
  local inc = incs[node]
  if inc == nil then
    local v = redis.pcall('GET', P .. ':node:' .. node)
    if type(v) == 'string' and #v == 20 and string.match(v, '^%d+$') then
      inc = v
    else
      if type(v) == 'table' or type(v) == 'string' then garbage = garbage + 1 end
      inc = false
    end
    incs[node] = inc
  end
  return inc
end
local held = {}  -- node -> group index -> position -> block id(4) .. tier(1)
local order = {}  -- holders in the order met
local function read(gi, pos, wanted)
  local key = P .. ':e:' .. groups[gi] .. ':' .. sub(blob, pos * L + 1, pos * L + L)
  local flat = redis.pcall('HGETALL', key)
  if flat.err then
    garbage = garbage + 1
    return {}
  end
  local got = {}
  for j = 1, #flat, 2 do
    local node, v = flat[j], flat[j + 1]
    if not excluded[node] and (wanted == nil or wanted[node]) then
      local inc = inc_of(node)
      if #v < 30 or not tier_ok(byte(v, 25)) then
        garbage = garbage + 1
      elseif inc and sub(v, 1, 20) == inc then
        local h = held[node]
        if not h then
          h = {}
          held[node] = h
          order[#order + 1] = node
        end
        h[gi] = h[gi] or {}
        h[gi][pos] = sub(v, 21, 25)
        got[node] = true
      end
    end
  end
  return got
end
local limit, candidates = n, nil
for gi = 1, ng do
  if full[gi] and limit > 0 then
    local alive, depth, first = candidates, 0, {}
    for pos = 0, limit - 1 do
      alive = read(gi, pos, alive)
      if pos == 0 then first = alive end
      if next(alive) == nil then break end
      depth = pos + 1
    end
    candidates, limit = first, depth
  end
end
for gi = 1, ng do
  if not full[gi] then
    for pos = 0, limit - 1 do read(gi, pos, candidates) end
  end
end
local out = {garbage}
local zeros = string.rep(string.char(0), 5)
for _, node in ipairs(order) do
  out[#out + 1] = node
  out[#out + 1] = incs[node]
  for gi = 1, ng do
    local h, parts = held[node][gi] or {}, {}
    for pos = 0, limit - 1 do parts[pos + 1] = h[pos] or zeros end
    out[#out + 1] = table.concat(parts)
  end
end
return out
"""


def held_lookup_args(
    prefix: str, key_len: int, keys: bytes, group_ids: Sequence[int], rule: PrefixHitRule,
    exclude_node_ids: Sequence[str],
) -> list[object]:
    """ARGV of ``LOOKUP_HELD_LUA`` for ``keys`` (the prompt's lookup keys, concatenated)."""
    args: list[object] = [prefix, key_len, keys, len(group_ids)]
    for group_id in group_ids:
        args += (group_id, b"1" if group_id in rule.full_attention_group_ids else b"0")
    args.extend(exclude_node_ids)
    return args


def holders_of_held_reply(
    reply: list, block_hashes: Sequence[bytes], group_ids: Sequence[int], rule: PrefixHitRule,
    key_len: int, block_size: int,
) -> tuple[int, list[Holder]]:
    """The garbage count and every holder with a hit (any run length) from the script's reply.
    Raises ValueError for a reply of the wrong shape (the caller counts it as trouble)."""
    num_groups = len(group_ids)
    stride = 2 + num_groups
    if (len(reply) - 1) % stride:
        raise ValueError(f"held lookup reply of {len(reply)} items, not 1 + k * {stride}")
    holders: list[Holder] = []
    for i in range(1, len(reply), stride):
        node_id, incarnation = reply[i].decode(), int(reply[i + 1])
        held: dict[int, dict[bytes, tuple[int, int]]] = {}
        for gi, group_id in enumerate(group_ids):
            packed = reply[i + 2 + gi]
            entries: dict[bytes, tuple[int, int]] = {}
            for pos in range(len(packed) // 5):
                block_id = int.from_bytes(packed[pos * 5 : pos * 5 + 4], "big")
                if block_id:
                    tier = CODE_TO_TIER[packed[pos * 5 + 4 : pos * 5 + 5]]
                    entries[block_hashes[pos][:key_len]] = (block_id, TIER_RANK[tier])
            held[group_id] = entries
        found = hit_of_holder(rule, block_hashes, held, key_len, block_size)
        if found.num_blocks:
            holders.append(
                Holder(node_id, incarnation, found.num_blocks, found.tier, found.block_ids)
            )
    return reply[0], holders


def hit_of_holders(holders: list[Holder], all_holders: bool) -> PrefixHit:
    """The ``PrefixHit`` of ``holders_of_held_reply``'s holders: every one with ``all_holders``,
    else those of the deepest hit."""
    if holders and not all_holders:
        best = max(holder.num_blocks for holder in holders)
        holders = [holder for holder in holders if holder.num_blocks == best]
    return sort_holders(holders)
