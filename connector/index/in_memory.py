"""``InMemoryBlockIndex``: the embedded ``BlockIndex`` backend, one process.

Contract and freshness rules: ``protocol.py`` (docs/architecture.md, "The block index"). Also the
reference the Redis backend is tested against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .hit_rule import hit_of_holder
from .protocol import (
    RANK_TO_TIER,
    TIER_RANK,
    Holder,
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
    events_to_ops,
    seq_verdict,
    sort_holders,
)

if TYPE_CHECKING:
    from kvbridge.kvmanager import PrefixHitRule


@dataclass(slots=True)
class _NodeState:
    incarnation: int
    deadline_s: float
    last_seq: int = 0  # the last publish batch applied (0: none, or unnumbered ones only)
    # group_id -> block_hash -> (block_id, tier)
    group_to_entries: dict[int, dict[bytes, tuple[int, Tier]]] = field(default_factory=dict)


class InMemoryBlockIndex:
    """The embedded backend: one process, shared by the nodes living in it.

    Lookups scan each node's run block by block (exact, O(len(block_hashes)) per node); this is
    also the reference the Redis backend is tested against. ``clock`` returns monotonic seconds.
    """

    def __init__(
        self, namespace: IndexNamespace, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.namespace = namespace
        self.stats = IndexStats()
        self._clock = clock
        self._nodes: dict[str, _NodeState] = {}
        self._node_to_max_incarnation: dict[str, int] = {}

    def _live_node(self, node_id: str) -> _NodeState | None:
        state = self._nodes.get(node_id)
        if state is not None and state.deadline_s <= self._clock():
            del self._nodes[node_id]  # expired: its entries go with it
            return None
        return state

    def register_node(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        check_node_id(node_id)
        check_incarnation(incarnation)
        check_ttl(ttl_s)
        if incarnation < self._node_to_max_incarnation.get(node_id, -1):
            return "fenced"
        self._node_to_max_incarnation[node_id] = incarnation
        state = self._live_node(node_id)
        deadline_s = self._clock() + ttl_s
        if state is None or state.incarnation != incarnation:
            self._nodes[node_id] = _NodeState(incarnation, deadline_s)
        else:
            state.deadline_s = deadline_s
        return "ok"

    def heartbeat(self, node_id: str, incarnation: int, *, ttl_s: float) -> IndexStatus:
        check_ttl(ttl_s)
        state = self._live_node(node_id)
        if state is None or state.incarnation != incarnation:
            self.stats.heartbeats_failed += 1
            return "fenced"
        state.deadline_s = self._clock() + ttl_s
        return "ok"

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
        check_seq(seq)
        ops = events_to_ops(events, default_tier)
        state = self._live_node(node_id)
        if state is None or state.incarnation != incarnation:
            self.stats.publishes_fenced += 1
            return PublishResult("fenced", len(ops))
        verdict = seq_verdict(state.last_seq, seq, resync)
        if verdict == "gap":
            self.stats.publishes_gap += 1
            return PublishResult("gap", len(ops))
        if verdict == "replayed":
            self.stats.publishes_replayed += 1
            return PublishResult("replayed", len(ops))
        if seq is not None:
            state.last_seq = seq[1]
        self.stats.resyncs += resync
        key_len = self.namespace.key_hash_bytes
        for op in ops:
            key = op.block_hash[:key_len]
            if op.kind == "S":
                entries = state.group_to_entries.setdefault(op.group_id, {})
                entries[key] = (op.block_id, op.tier)
            elif op.kind == "R":
                entries = state.group_to_entries.get(op.group_id, {})
                held = entries.get(key)
                if held is not None and held[1] == op.tier and op.block_id in (-1, held[0]):
                    del entries[key]
            else:
                state.group_to_entries.clear()
        self.stats.publishes += 1
        self.stats.publish_ops += len(ops)
        return PublishResult("ok", len(ops))

    def longest_prefixes(
        self, prompts: Sequence[Sequence[bytes]], group_ids: Sequence[int] = (0,), *,
        exclude_node_ids: Iterable[str] = (), hit_rule: PrefixHitRule | None = None,
    ) -> list[PrefixHit]:
        excluded = tuple(exclude_node_ids)
        return [self.longest_prefix(hashes, group_ids, exclude_node_ids=excluded,
                                    hit_rule=hit_rule) for hashes in prompts]

    def longest_prefix(
        self,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        *,
        exclude_node_ids: Iterable[str] = (),
        all_holders: bool = False,
        hit_rule: PrefixHitRule | None = None,
    ) -> PrefixHit:
        check_lookup_args(block_hashes, group_ids)
        self.stats.lookups += 1
        excluded = set(exclude_node_ids)
        key_len = self.namespace.key_hash_bytes
        keys = [h[:key_len] for h in block_hashes]
        holders: list[Holder] = []
        for node_id in sorted(self._nodes):
            state = self._live_node(node_id)
            if state is None or node_id in excluded:
                continue
            if hit_rule is not None:
                held = {}
                for g in group_ids:
                    entries = state.group_to_entries.get(g, {})
                    held[g] = {
                        k: (entries[k][0], TIER_RANK[entries[k][1]]) for k in keys if k in entries
                    }
                found = hit_of_holder(
                    hit_rule, block_hashes, held, key_len, self.namespace.block_size
                )
                if found.num_blocks:
                    holders.append(Holder(
                        node_id, state.incarnation, found.num_blocks, found.tier, found.block_ids
                    ))
                continue
            depth = len(block_hashes)
            worst_rank = 0
            for group_id in group_ids:
                entries = state.group_to_entries.get(group_id, {})
                run = 0
                while run < depth and keys[run] in entries:
                    run += 1
                depth = run
            for group_id in group_ids if depth else ():
                entries = state.group_to_entries[group_id]
                for key in keys[:depth]:
                    worst_rank = max(worst_rank, TIER_RANK[entries[key][1]])
            if depth:
                tier = RANK_TO_TIER[worst_rank]
                holders.append(Holder(node_id, state.incarnation, depth, tier))
        if holders and not all_holders:
            best = max(holder.num_blocks for holder in holders)
            holders = [holder for holder in holders if holder.num_blocks == best]
        hit = sort_holders(holders)
        if hit.num_blocks:
            self.stats.lookup_hits += 1
        return hit

    def parked_parts(self, node_id: str) -> ParkedParts:  # (a call lands whole or not)
        return ParkedParts()

    def send_parked(self, node_id: str, incarnation: int) -> IndexStatus:
        return "ok"

    def node_entries(self, node_id: str) -> set[tuple[int, bytes, int]] | None:
        state = self._live_node(node_id)
        if state is None:
            return None
        return {
            (group_id, key, entry[0])
            for group_id, entries in state.group_to_entries.items()
            for key, entry in entries.items()
        }

    def get_block_ids(
        self,
        node_id: str,
        incarnation: int,
        block_hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
    ) -> list[list[int]] | None:
        check_lookup_args(block_hashes, group_ids)
        state = self._live_node(node_id)
        if state is None or state.incarnation != incarnation:
            return None
        group_to_block_ids: list[list[int]] = []
        for group_id in group_ids:
            entries = state.group_to_entries.get(group_id, {})
            held = [entries.get(h[: self.namespace.key_hash_bytes]) for h in block_hashes]
            if any(entry is None for entry in held):
                return None
            group_to_block_ids.append([entry[0] for entry in held if entry is not None])
        return group_to_block_ids

    @property
    def available(self) -> bool:
        return True  # nothing between the caller and the entries can fail

    def interrupt(self) -> None:
        return None  # calls never block

    def close(self) -> None:
        self._nodes.clear()
