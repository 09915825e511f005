"""A request's prefix found through the block index, for the scheduler half
(docs/architecture.md, "Life of an index hit").

A request that arrives without a ticket asks the index for its longest prefix held on another
node, asynchronously: the first call starts the lookup and answers None ("ask again next step")
until the answer is in; the client bounds the wait, after which the request goes on with its
local hit alone.
"""

from __future__ import annotations

from typing import Any

from kvbridge.kvmanager.connector_interface import MatchedTokens

from .index import IndexClient, RemotePrefix
from .metadata import HolderRef
from .pull_plan import RemoteMatch
from .stats import KVTransferStats

__all__ = ["match_from_index"]

_LOOKUP_FAILURES = frozenset({"unavailable", "timed_out", "overloaded"})
"""Lookup statuses that went on without the index's answer (``num_index_lookup_failures``)."""


def match_from_index(
    client: IndexClient | None,
    lookups: set[str],
    request: Any,
    num_computed_tokens: int,
    *,
    block_size: int,
    min_gain_blocks: int,
    load_async: bool,
    stats: KVTransferStats,
) -> tuple[MatchedTokens, RemoteMatch | None]:
    """``get_num_new_matched_tokens`` of a request without a ticket (a kvmanager ``Request``
    or the vLLM adapter's ``RequestView``), and the match to plan its pull from once allocated.

    ``lookups`` (mutated) holds the requests whose lookup is started and not yet answered; the
    pull is planned as the engine is told (``load_async``). Scheduler thread only.
    """
    if client is None or request.skip_reading_prefix_cache:
        return MatchedTokens(0, False), None
    request_id = request.request_id
    if request_id not in lookups:
        # Never plan the last token's block: it is recomputed for its logits anyway.
        hashes = request.block_hashes[: (request.num_tokens - 1) // block_size]
        stats.add("num_index_lookups")
        client.start_lookup(
            request_id,
            hashes,
            num_local_blocks=num_computed_tokens // block_size,
            min_gain_blocks=min_gain_blocks,
        )
        lookups.add(request_id)
    result = client.poll_lookup(request_id)
    if not result.done:
        return MatchedTokens(None, False), None
    lookups.discard(request_id)
    if result.status in _LOOKUP_FAILURES:
        stats.add("num_index_lookup_failures")
    found: RemotePrefix | None = result.prefix
    if found is None:
        return MatchedTokens(0, False), None
    num_remote_tokens = found.num_blocks * block_size
    if num_remote_tokens <= num_computed_tokens:
        return MatchedTokens(0, False), None
    match = RemoteMatch(
        holder=HolderRef(
            engine_id=found.holder.node_id,
            incarnation=str(found.holder.incarnation),
            host=found.address.host,
            port=found.address.port,
            tier=found.holder.tier,
        ),
        remote_block_ids=tuple(tuple(ids) for ids in found.block_ids),
        ticket=None,
        num_local_tokens=num_computed_tokens,
        num_remote_tokens=num_remote_tokens,
        load_async=load_async,
    )
    return MatchedTokens(num_remote_tokens - num_computed_tokens, load_async), match
