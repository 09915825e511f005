"""``RedisBlockIndex``'s lookups of many prompts in one round trip: the script and its replies.

The lookups an engine step starts (a burst of new requests) reach ``IndexWorker`` together; it
asks for them all at once (``BlockIndex.longest_prefixes``). On Redis that is one ``EVALSHA`` of
``LOOKUP_MANY_LUA`` per server (a cluster: per bucket), which runs ``redis_scripts.LOOKUP_LUA``
unchanged for each prompt, in the order given, and answers a list of their replies; one call
per prompt cost the worker thread a round trip each and, in the engine process, Python time that
competes with the scheduler step (docs/vllm-prefix-reuse.md, "Lookup and pull").

``ARGV``: ``P``, the number of prompts, then per prompt the count of its arguments and
``LOOKUP_LUA``'s ``ARGV`` after ``P`` (key_len, keys, all, number of groups, group ids,
excluded node ids). Reply: one ``LOOKUP_LUA`` reply per prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .protocol import (
    CODE_TO_TIER,
    NO_HIT,
    Holder,
    IndexStats,
    PrefixHit,
    join_keys,
    sort_holders,
)
from .redis_scripts import LOOKUP_LUA

__all__ = [
    "LOOKUP_MANY_LUA",
    "MAX_KEY_BYTES_PER_CALL",
    "calls_of",
    "hit_of_reply",
    "lookup_many_args",
    "replies_of",
]

LOOKUP_MANY_LUA = (
    "local function lookup(ARGV)\n" + LOOKUP_LUA + "\nend\n"
    """
local out, i = {}, 3
for q = 1, tonumber(ARGV[2]) do
  local count, args = tonumber(ARGV[i]), {ARGV[1]}
  for j = 1, count do args[j + 1] = ARGV[i + j] end
  out[q] = lookup(args)
  i = i + count + 1
end
return out
"""
)

MAX_KEY_BYTES_PER_CALL = 1 << 18
"""A call carries prompts' keys up to this many bytes (about 420 prompts of 625 blocks), so
that one call never holds the server long; more prompts go in further calls."""


Call = list[tuple[int, bytes, int]]
"""The prompts of one call: (position among the prompts asked, joined lookup keys, key length)."""


def calls_of(
    prompts: Sequence[Sequence[bytes]], key_hash_bytes: int, prefix_of: Callable[[bytes], str]
) -> list[tuple[str, Call]]:
    """The calls that look ``prompts`` up: by key prefix (``prefix_of(first key)``: one on one
    server, a cluster's bucket), each up to ``MAX_KEY_BYTES_PER_CALL`` of keys (at least one
    prompt). Empty prompts are left out (nothing to look up). Raises ValueError for a prompt
    whose hashes differ in length (``protocol.join_keys``)."""
    by_prefix: dict[str, list[Call]] = {}
    for i, hashes in enumerate(prompts):
        if not hashes:
            continue
        keys, key_len = join_keys(hashes, key_hash_bytes)
        calls = by_prefix.setdefault(prefix_of(keys[:key_len]), [[]])
        if calls[-1] and sum(len(k) for _, k, _ in calls[-1]) + len(keys) > MAX_KEY_BYTES_PER_CALL:
            calls.append([])
        calls[-1].append((i, keys, key_len))
    return [(prefix, call) for prefix, calls in by_prefix.items() for call in calls]


def lookup_many_args(
    prefix: str, call: Call, group_ids: Sequence[int], exclude_node_ids: Sequence[str]
) -> list[Any]:
    """``ARGV`` of ``LOOKUP_MANY_LUA`` for the prompts of ``call`` (deepest runs only)."""
    tail = [b"0", len(group_ids), *group_ids, *exclude_node_ids]
    args: list[Any] = [prefix, len(call)]
    for _, keys, key_len in call:
        args += (2 + len(tail), key_len, keys, *tail)
    return args


def replies_of(call: Call, reply: Any) -> Iterator[tuple[int, Any]]:
    """(position among the prompts asked, its ``LOOKUP_LUA`` reply) for each prompt of ``call``.
    Raises ValueError for a reply that does not hold one per prompt."""
    if not isinstance(reply, list) or len(reply) != len(call):
        raise ValueError(f"a lookup call of {len(call)} prompts answered {reply!r:.80}")
    return ((i, one) for (i, _, _), one in zip(call, reply, strict=True))


def hit_of_reply(reply: Any, stats: IndexStats, now_s: float) -> PrefixHit:
    """The ``PrefixHit`` of one ``LOOKUP_LUA`` reply: the garbage count (counted in ``stats``),
    then 4 items per holder: node id, incarnation (20 digits), run, tier. Raises ValueError,
    IndexError or KeyError for a reply of another shape (the caller takes it as trouble)."""
    if len(reply) % 4 != 1:
        raise ValueError(f"lookup reply of {len(reply)} items, not 1 + 4k")
    stats.count_garbage(reply[0], now_s)
    if len(reply) == 1:
        return NO_HIT
    stats.lookup_hits += 1
    if len(reply) == 5:
        holder = Holder(reply[1].decode(), int(reply[2]), reply[3], CODE_TO_TIER[reply[4]])
        return PrefixHit(holder.num_blocks, (holder,))
    return sort_holders([
        Holder(reply[i].decode(), int(reply[i + 1]), reply[i + 2], CODE_TO_TIER[reply[i + 3]])
        for i in range(1, len(reply), 4)
    ])
