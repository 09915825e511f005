"""Server-side Lua scripts of ``RedisBlockIndex`` (one EVALSHA per index call); the publish
script, with its arguments' packer, is ``redis_publish.py``.

Keys, ``P`` = ``IndexNamespace.key_prefix``; ``<key>`` = the first ``key_hash_bytes`` of a block
hash; ``<inc>`` = a 20-digit incarnation (string order = numeric order):

- ``P:e:<g>:<key>``   hash: node id -> entry = inc(20) .. block id(4) .. tier(1) .. run(4) ..
  slowest tier(1) .. parent key. ``run``: the node held blocks 0..run-1 of this hash's chain when
  it stored it (0: it did not hold the parent). Every node holding the hash is one field, so one
  HGETALL answers "who holds block i" for all nodes.
- ``P:node:<n>``      the node's current incarnation; TTL, refreshed by heartbeats. Entries whose
  inc differs, or whose node key is gone, are ignored by lookups (and deleted when seen).
- ``P:nodes`` set of registered nodes; ``P:maxinc`` hash node -> highest incarnation (fencing).
- ``P:keys:<n>``      set of the node's entry keys (to drop them all on clear, restart, expiry).
- ``P:kids|hp|holes:<n>:<inc>:<g>`` hole records, TTL as the node key; ``P:aux:<n>`` lists them.
  A hole is a removed hash whose descendants the node still holds: ``hp`` hash -> parent key,
  ``holes`` zset member = hash key, score = its position; ``kids`` counts each hash's held or hole
  children. A hole goes when its last child goes (``release`` walks up the chain).

Lookups. Let probe(i) = "the node holds block i with run == i + 1". With no hole on the path,
probe holds exactly for i below the node's run, so a binary search finds the run in O(log N)
HGETALLs (after probing block 0 and block N-1). With holes, probe stays true below the first
missing block t (nothing there was removed), so the search ends at some d >= t; if d > t the
missing block t has held descendants, so it is a hole on this prompt's path at position t, and
the run is cut there. Exact, and tested against ``InMemoryBlockIndex``'s block-by-block scan.
A lookup for the deepest run in one group first tries the prompt held whole (the holders of the
last block with run == N, each checked for block 0, its incarnation and holes: four calls for one
holder), which is the benchmark's case; otherwise the search above.

Lookups under a hit rule (sliding-window or Mamba groups, ``LOOKUP_HELD_LUA``) read the entries
themselves, not runs: which of the prompt's blocks each holder holds in each group, for the
rule to decide in Python (``redis_held_lookup.py``, ``hit_rule.py``).

Scripts build key names from ARGV: fine on one Redis server, not on Redis Cluster.
"""

# Shared by register and publish (``redis_publish.py``): drop every entry and hole record of a
# node (any incarnation).
DROP_NODE_LUA = """
local function drop_node(P, node)
  local keyset, auxset = P .. ':keys:' .. node, P .. ':aux:' .. node
  for _, k in ipairs(redis.call('SMEMBERS', keyset)) do redis.pcall('HDEL', k, node) end
  for _, k in ipairs(redis.call('SMEMBERS', auxset)) do redis.call('UNLINK', k) end
  redis.call('DEL', keyset, auxset)
end
"""

# ARGV: P, node, inc, ttl_ms -> 1 registered, 0 refused (a newer incarnation registered).
# A new incarnation, or the same one after expiry, starts empty. Nodes that expired without
# registering again are swept here.
REGISTER_LUA = DROP_NODE_LUA + """
local P, node, inc, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local maxinc = redis.pcall('HGET', P .. ':maxinc', node)  -- (another type: none known)
if type(maxinc) == 'string' and inc < maxinc then return 0 end
redis.pcall('HSET', P .. ':maxinc', node, inc)
local nodekey = P .. ':node:' .. node
if redis.call('GET', nodekey) ~= inc then drop_node(P, node) end
redis.call('SET', nodekey, inc, 'PX', ttl)
redis.call('SADD', P .. ':nodes', node)
for _, k in ipairs(redis.call('SMEMBERS', P .. ':aux:' .. node)) do
  redis.call('PEXPIRE', k, ttl)
end
for _, other in ipairs(redis.call('SMEMBERS', P .. ':nodes')) do
  if redis.call('EXISTS', P .. ':node:' .. other) == 0 then
    drop_node(P, other)
    redis.call('SREM', P .. ':nodes', other)
  end
end
return 1
"""

# ARGV: P, node, inc, ttl_ms -> 1 alive, 0 fenced (expired, or not the current incarnation).
HEARTBEAT_LUA = """
local P, node, inc, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local nodekey = P .. ':node:' .. node
if redis.call('GET', nodekey) ~= inc then return 0 end
redis.call('PEXPIRE', nodekey, ttl)
for _, k in ipairs(redis.call('SMEMBERS', P .. ':aux:' .. node)) do
  redis.call('PEXPIRE', k, ttl)
end
return 1
"""

LOOKUP_SAMPLE_HOLDERS = 8
"""A lookup for the deepest run (not every holder) reads at most this many holders of a block,
drawn at random (``HRANDFIELD``), so that its cost stays flat in the number of nodes holding
a popular prefix (issue 14: 64 nodes each holding a shared system prompt made every probe read
64 entries and check 64 incarnations). A block with more holders is judged on the sample: a
popular prefix's holders nearly all hold it as a full run, so one in the sample is enough; if
none in the sample does, the lookup reports a shallower hit (advisory, never wrong bytes).
Lookups of every holder (``all``) read every holder."""

# ARGV: P, key_len, keys (concatenated), all ('1': every holder; '0': the holders of the
# deepest run), num_groups, group ids..., excluded node ids...
# -> {garbage, then per holder: node, inc, run, slowest tier code}.
# Cost (benchmarks/bench_index.py): a prompt held whole by one node, one group: HRANDFIELD, GET,
# HGET, EXISTS (the fast path). Otherwise one HRANDFIELD (at most LOOKUP_SAMPLE_HOLDERS holders;
# HGETALL for every holder) per probed position and group, one GET/MGET
# for the incarnations of the nodes met there, EXISTS (and ZRANGEBYSCORE where holes exist) per
# candidate holder. Redis hashes every byte of a Lua string it creates (docs/architecture.md,
# "Design measurements"), so nothing is copied out of the blob but the probed keys; no string is
# built per entry (prefix compare with string.find, tier bytes with string.byte).
LOOKUP_LUA = """
local P, L, blob, ng = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5])
local all = ARGV[4] == '1'
local sample_only = not all
-- the holders of one block: all of them, or at most SAMPLE drawn at random (a flat list)
local function holders_of(key)
  if sample_only then return redis.pcall('HRANDFIELD', key, SAMPLE, 'WITHVALUES') end
  return redis.pcall('HGETALL', key)
end
local n = #blob / L
local groups, excluded = {}, {}
for i = 1, ng do groups[i] = ARGV[5 + i] end
for i = 6 + ng, #ARGV do excluded[ARGV[i]] = true end
local garbage = 0
local byte, find, sub, unpack_u32 = string.byte, string.find, string.sub, struct.unpack
local function tier_ok(t) return t == 100 or t == 104 or t == 115 end
local memo = {}
-- Fast path: the holders of the deepest run, one group, the prompt held whole. The nodes whose
-- entry of the last block is a full run (run == n), checked inline as the general path below
-- checks them (live incarnation, block 0 held as run 1, no hole on the path); if any passes, they
-- are the answer (every such node is checked, so ties are all reported). Otherwise nothing is
-- counted here and the general path decides.
if not all and ng == 1 and n > 0 then
  local prefix = P .. ':e:' .. groups[1] .. ':'
  local flat = holders_of(prefix .. sub(blob, n * L - L + 1, n * L))
  if not flat.err then
    if flat[1] == nil then memo[n - 1] = {} end  -- nobody holds the last block
    local out, seen_garbage, key0 = {0}, 0, nil
    for j = 1, #flat, 2 do
      local node, v = flat[j], flat[j + 1]
      local tier, _, _, _, _, worst = byte(v, 25, 30)
      if not (worst and tier_ok(tier) and tier_ok(worst)) then
        if not excluded[node] then seen_garbage = seen_garbage + 1 end
      elseif not excluded[node] and unpack_u32('>I4', v, 26) == n then
        local inc = redis.pcall('GET', P .. ':node:' .. node)
        if inc and (type(inc) ~= 'string' or #inc ~= 20 or not string.match(inc, '^%d+$')) then
          seen_garbage = seen_garbage + 1
        elseif inc and find(v, inc, 1, true) == 1 then
          key0 = key0 or sub(blob, 1, L)
          local v0 = redis.pcall('HGET', prefix .. key0, node)
          local held = type(v0) == 'string' and find(v0, inc, 1, true) == 1
          if held then
            local tier0, _, _, _, _, worst0 = byte(v0, 25, 30)
            held = worst0 and tier_ok(tier0) and tier_ok(worst0) and unpack_u32('>I4', v0, 26) == 1
          end
          local holes_key = P .. ':holes:' .. node .. ':' .. inc .. ':' .. groups[1]
          if held and redis.call('EXISTS', holes_key) == 1 then
            local holes = redis.pcall('ZRANGEBYSCORE', holes_key, 0, n - 1, 'WITHSCORES')
            held = not holes.err
            for h = 1, held and #holes or 0, 2 do
              local pos = tonumber(holes[h + 1])
              if pos and pos < n and sub(blob, pos * L + 1, pos * L + L) == holes[h] then
                held = false
              end
            end
          end
          if held then
            out[#out + 1] = node
            out[#out + 1] = inc
            out[#out + 1] = n
            out[#out + 1] = string.char(worst)
          end
        end
      end
    end
    if out[2] then
      out[1] = seen_garbage
      return out
    end
  end
end
-- node -> its live incarnation, or false (gone, or a garbage node record).
local incs = {}
local function fetch_incs(nodes)
  local keys = {}
  for i = 1, #nodes do keys[i] = P .. ':node:' .. nodes[i] end
  -- One node (the usual case): GET, whose WRONGTYPE error marks a garbage record. Several: one
  -- MGET, which answers nil for a record that is not a string (told apart by EXISTS).
  local got = #keys == 1 and {redis.pcall('GET', keys[1])} or redis.call('MGET', unpack(keys))
  for i = 1, #nodes do
    local inc = got[i]
    if type(inc) == 'string' then
      if #inc ~= 20 or not string.match(inc, '^%d+$') then
        garbage = garbage + 1
        inc = false
      end
    elseif inc or redis.call('EXISTS', keys[i]) == 1 then
      garbage = garbage + 1
      inc = false
    end
    incs[nodes[i]] = inc
  end
end
-- at(pos): node -> slowest tier code, for nodes holding block pos as the end of a full run
-- (run == pos + 1) in every group.
local function at(pos)
  local r = memo[pos]
  if r then return r end
  local key_hash = sub(blob, pos * L + 1, pos * L + L)
  for gi = 1, ng do
    local key = P .. ':e:' .. groups[gi] .. ':' .. key_hash
    local flat = holders_of(key)
    if flat.err then
      garbage = garbage + 1
      flat = {}
    end
    if gi == 1 then
      local unknown
      for j = 1, #flat, 2 do
        if incs[flat[j]] == nil then
          unknown = unknown or {}
          unknown[#unknown + 1] = flat[j]
        end
      end
      if unknown then fetch_incs(unknown) end
    end
    local cur = {}
    for j = 1, #flat, 2 do
      local node = flat[j]
      if not excluded[node] and (gi == 1 or r[node]) then
        local v, inc = flat[j + 1], incs[node]
        local tier, _, _, _, _, worst = byte(v, 25, 30)  -- worst is nil below 30 bytes
        if not (worst and tier_ok(tier) and tier_ok(worst)) then
          garbage = garbage + 1
        elseif not (inc and find(v, inc, 1, true) == 1) then
          redis.call('HDEL', key, node)  -- stale: an old incarnation, or the node is gone
        elseif unpack_u32('>I4', v, 26) == pos + 1 then
          cur[node] = (gi == 1 or worst > r[node]) and worst or r[node]
        end
      end
    end
    r = cur
    if next(r) == nil then break end
  end
  memo[pos] = r
  return r
end
-- Deepest d such that pred(at(d - 1)), assuming pred is monotone; 0 if not even at(0).
-- Block 0 first (a prompt whose block 0 differs shares nothing), then the last block (a
-- prompt held whole costs two probes), then bisection.
local function search(pred)
  if not pred(at(0)) then return 0 end
  if n == 1 or pred(at(n - 1)) then return n end
  local lo, hi = 0, n - 1  -- pred(at(lo)) holds, pred(at(hi)) does not
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if pred(at(mid)) then lo = mid else hi = mid end
  end
  return lo + 1
end
-- Whether `node` holds block 0 (run 1) in every group: for the holders of the last block, a
-- check cheaper than reading every holder of block 0 (a garbage entry answers no; at() counts it).
local function holds_block_0(node)
  local key_hash = sub(blob, 1, L)
  for gi = 1, ng do
    local v = redis.pcall('HGET', P .. ':e:' .. groups[gi] .. ':' .. key_hash, node)
    if type(v) ~= 'string' then return false end
    local tier, _, _, _, _, worst = byte(v, 25, 30)
    if not (worst and tier_ok(tier) and tier_ok(worst)) or find(v, incs[node], 1, true) ~= 1
        or unpack_u32('>I4', v, 26) ~= 1 then
      return false
    end
  end
  return true
end
-- The node's run d cut at the first hole on this prompt's path, in any group.
local function cut(node, d)
  local holes_keys = {}
  for gi = 1, ng do
    holes_keys[gi] = P .. ':holes:' .. node .. ':' .. incs[node] .. ':' .. groups[gi]
  end
  if redis.call('EXISTS', unpack(holes_keys)) == 0 then return d end  -- no hole anywhere
  for gi = 1, ng do
    local holes = redis.pcall('ZRANGEBYSCORE', holes_keys[gi], 0, d - 1, 'WITHSCORES')
    if holes.err then
      garbage = garbage + 1
    else
      for j = 1, #holes, 2 do
        local pos = tonumber(holes[j + 1])
        if pos and pos < d and sub(blob, pos * L + 1, pos * L + L) == holes[j] then
          d = pos
        end
      end
    end
  end
  return d
end
local function node_run(node)
  return cut(node, search(function(s) return s[node] ~= nil end))
end
local out = {0}
local function emit(node, d)
  out[#out + 1] = node
  out[#out + 1] = incs[node]
  out[#out + 1] = d
  out[#out + 1] = string.char(at(d - 1)[node] or 100)
end
if n > 0 then
  local runs, best = {}, 0
  if not all then
    -- A prompt held whole: the holders of its last block as a full run, if they hold block 0
    -- (read for them only); otherwise the general search.
    local d, deepest = n, {}
    for node, tier in pairs(at(n - 1)) do
      if holds_block_0(node) then deepest[node] = tier end
    end
    if next(deepest) == nil then
      d = search(function(s) return next(s) ~= nil end)
      deepest = d > 0 and at(d - 1) or {}
    end
    if d > 0 then
      for node in pairs(deepest) do
        runs[node] = cut(node, d)
        best = math.max(best, runs[node])
      end
    end
    all = d > 0 and best < d
  end
  if all then
    runs, best = {}, 0
    for node in pairs(at(0)) do
      runs[node] = node_run(node)
      best = math.max(best, runs[node])
    end
  end
  for node, d in pairs(runs) do
    if d > 0 and (ARGV[4] == '1' or d == best) then emit(node, d) end
  end
end
out[1] = garbage
return out
""".replace("SAMPLE", str(LOOKUP_SAMPLE_HOLDERS))
