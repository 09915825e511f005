"""One remote-prefix lookup, from block hashes to a pullable answer (docs/architecture.md, "Life
of an index hit").

``resolve_remote_prefix`` asks the index for the longest prefix held on another node, checks that
it beats the local hit, resolves the holder's address in the node directory and fetches its block
ids: one to three round trips, so it runs on ``IndexWorker``'s thread, never on the engine thread.
``resolve_remote_prefixes`` does the same for the lookups queued together, with one index round
trip for all of them.
``LookupResult`` is what the engine thread polls: pending, a hit with its ``RemotePrefix``, or a
miss with its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

from .node_directory import NodeAddress, NodeDirectory
from .protocol import BlockIndex, Holder, PrefixHit

if TYPE_CHECKING:
    from kvbridge.kvmanager import PrefixHitRule

__all__ = [
    "LOOKUP_PENDING",
    "LookupQuery",
    "LookupResult",
    "LookupStatus",
    "RemotePrefix",
    "resolve_remote_prefix",
    "resolve_remote_prefixes",
]

logger = logging.getLogger(__name__)


class RemotePrefix(NamedTuple):
    """A pullable prefix: ``num_blocks`` blocks from block 0, held by ``holder`` at ``address``
    in blocks ``block_ids[group][i]``."""

    holder: Holder
    address: NodeAddress
    num_blocks: int
    block_ids: list[list[int]]


LookupStatus = Literal["pending", "hit", "no_hit", "unavailable", "timed_out", "overloaded"]


class LookupResult(NamedTuple):
    """The state of one lookup.

    ``status``:

    - ``"pending"``: not answered yet; ask again next step.
    - ``"hit"``: ``prefix`` is a remote prefix that beats the local hit by ``min_gain_blocks``.
    - ``"no_hit"``: nobody else holds enough (or the holder's address or block ids are gone).
    - ``"unavailable"``: the index backend is down or erroring (counted in its stats).
    - ``"timed_out"``: no answer within the client's ``lookup_timeout_s``.
    - ``"overloaded"``: refused at start, too many lookups in flight.

    Every status but ``"pending"`` is final, and all but ``"hit"`` mean: go on with local APC.
    """

    status: LookupStatus
    prefix: RemotePrefix | None = None

    @property
    def done(self) -> bool:
        return self.status != "pending"


LOOKUP_PENDING = LookupResult("pending")
_NO_HIT = LookupResult("no_hit")
_UNAVAILABLE = LookupResult("unavailable")


def resolve_remote_prefix(
    index: BlockIndex,
    directory: NodeDirectory,
    *,
    node_id: str,
    group_ids: Sequence[int],
    block_hashes: Sequence[bytes],
    num_local_blocks: int,
    min_gain_blocks: int,
    choose: Callable[[Sequence[Holder]], Sequence[Holder]] = lambda holders: holders,
    hit_rule: PrefixHitRule | None = None,
) -> LookupResult:
    """The longest prefix of ``block_hashes`` held on a node other than ``node_id``, if it beats
    ``num_local_blocks`` by at least ``min_gain_blocks`` and its holder is reachable.
    ``hit_rule``: the node's ``kvmanager.PrefixHitRule`` when a group is not full attention
    (the prefix is then what that rule restores from the holder, block ids read with it).

    Blocking: one index round trip, plus one directory and one block-id round trip per holder
    tried on a hit. Never raises for backend trouble (answers ``"unavailable"``); raises
    ValueError for bad arguments (hashes of different lengths, no group ids).
    """
    results: list[LookupResult] = []
    resolve_remote_prefixes(
        index, directory, node_id=node_id, group_ids=group_ids,
        queries=[LookupQuery(block_hashes, num_local_blocks, min_gain_blocks)],
        answer=lambda _, result: results.append(result), choose=choose, hit_rule=hit_rule)
    return results[0]


class LookupQuery(NamedTuple):
    """One prompt to look up: its block hashes from block 0, its local hit in blocks, and the
    blocks a remote hit must add to it."""

    block_hashes: Sequence[bytes]
    num_local_blocks: int
    min_gain_blocks: int


def resolve_remote_prefixes(
    index: BlockIndex,
    directory: NodeDirectory,
    *,
    node_id: str,
    group_ids: Sequence[int],
    queries: Sequence[LookupQuery],
    answer: Callable[[int, LookupResult], None],
    choose: Callable[[Sequence[Holder]], Sequence[Holder]] = lambda holders: holders,
    hit_rule: PrefixHitRule | None = None,
) -> None:
    """``resolve_remote_prefix`` of every query, the index asked for all of them at once
    (``BlockIndex.longest_prefixes``: one round trip on Redis); ``answer(i, result)`` is called
    once per query as soon as its result is known (misses first, then each hit once its
    holder's address and block ids are read). Blocking; raises as ``resolve_remote_prefix``."""
    asked: list[int] = []
    for i, query in enumerate(queries):
        if len(query.block_hashes) < query.num_local_blocks + query.min_gain_blocks:
            answer(i, _NO_HIT)
        else:
            asked.append(i)
    if not asked:
        return
    if hit_rule is not None and hit_rule.only_full_attention:
        hit_rule = None  # the run from block 0 is the rule: the fast lookup answers it
    excluded = (node_id,)
    if len(asked) == 1:
        hits = [index.longest_prefix(queries[asked[0]].block_hashes, group_ids,
                                     exclude_node_ids=excluded, hit_rule=hit_rule)]
    else:
        hits = index.longest_prefixes([queries[i].block_hashes for i in asked], group_ids,
                                      exclude_node_ids=excluded, hit_rule=hit_rule)
    available = index.available
    found = []
    for i, hit in zip(asked, hits, strict=True):
        query = queries[i]
        if hit.num_blocks == 0 and not available:
            answer(i, _UNAVAILABLE)
        elif hit.num_blocks - query.num_local_blocks < query.min_gain_blocks:
            answer(i, _NO_HIT)
        else:
            found.append((i, hit))
    for i, hit in found:
        answer(i, _pullable(index, directory, hit, queries[i].block_hashes, group_ids, choose))


def _pullable(
    index: BlockIndex, directory: NodeDirectory, hit: PrefixHit, block_hashes: Sequence[bytes],
    group_ids: Sequence[int], choose: Callable[[Sequence[Holder]], Sequence[Holder]],
) -> LookupResult:
    """The first of ``hit``'s holders (in ``choose``'s order) whose address is live and whose
    block ids are read; a miss when none is."""
    for holder in choose(hit.holders):
        address = directory.lookup(holder.node_id)
        if address is None or address.incarnation != holder.incarnation:
            continue  # gone, or restarted since it published these entries
        if holder.block_ids is not None:
            block_ids: list[list[int]] | None = [list(ids) for ids in holder.block_ids]
        else:
            block_ids = index.get_block_ids(
                holder.node_id, holder.incarnation, block_hashes[: holder.num_blocks], group_ids
            )
        if block_ids is not None:
            return LookupResult("hit", RemotePrefix(holder, address, holder.num_blocks, block_ids))
        if not index.available:
            return _UNAVAILABLE
    return _NO_HIT
