"""The trace replay's per-policy result and its report: a table row and a JSON summary
(``kvbridge-replay``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ReplayResult", "row", "store_row", "summary_of"]


@dataclass
class ReplayResult:
    """One policy's counts over a whole replay (``Replay.run``)."""

    policy: str
    num_nodes: int
    hit_blocks: int = 0  # local prefix hits plus pulled blocks
    total_blocks: int = 0
    num_requests: int = 0
    num_dropped: int = 0  # larger than a whole pool
    total_wait_s: float = 0.0
    requests_per_node: list[int] = field(default_factory=list)
    # pull: blocks pulled beyond the puller's own hit, requests that pulled, pulls per holder
    num_pulled_blocks: int = 0
    num_pulls: int = 0
    num_stale_hits: int = 0  # the index named more blocks than the holder's pool had
    pulls_per_holder: list[int] = field(default_factory=list)
    num_lookups: int = 0  # every timed longest_prefix call, re-lookups included
    num_relookups: int = 0  # pull: a request that waited asked again at admission
    num_lookup_hashes: int = 0
    lookup_s: float = 0.0
    num_pings: int = 0
    ping_s: float = 0.0
    # pull with --store-blocks: the store's label (its node id), capacity and counts. Its
    # pulls are counted in pulls_per_holder too, as the entry after the nodes'.
    store_label: str | None = None
    num_store_blocks: int = 0
    num_store_pulls: int = 0
    num_store_pulled_blocks: int = 0
    num_offloaded_blocks: int = 0  # blocks written to the store (new there)
    num_ancestor_blocks: int = 0  # of those, ancestors written before an evicted block
    num_store_dropped_blocks: int = 0  # the store's own LRU evictions
    num_store_rewritten_blocks: int = 0  # written again: named missing by a later put's reply
    num_store_present_blocks: int = 0  # written while the store still held them (touched only)
    num_store_held_blocks: int = 0  # at the end of the replay
    num_store_listed_blocks: int = 0  # of those, listed in the index (anchored chains)

    def __post_init__(self) -> None:
        self.requests_per_node = [0] * self.num_nodes
        self.pulls_per_holder = [0] * (self.num_nodes + (self.store_label is not None))

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def lookup_us(self) -> float:
        return 1e6 * self.lookup_s / self.num_lookups if self.num_lookups else 0.0

    @property
    def ping_us(self) -> float | None:
        return 1e6 * self.ping_s / self.num_pings if self.num_pings else None


def _per_node(counts: list[int]) -> str:
    if len(counts) <= 8:
        return str(counts)
    return f"min {min(counts)} / max {max(counts)} over {len(counts)} nodes"


def row(result: ReplayResult, oracle_ratio: float) -> str:
    fraction = result.hit_ratio / oracle_ratio if oracle_ratio else 0.0
    wait = result.total_wait_s / max(1, result.num_requests)
    pulled = result.num_pulled_blocks / max(1, result.num_requests)
    lookups = result.num_lookups / max(1, result.num_requests)
    ping = result.ping_us
    vs_ping = f"{result.lookup_us / ping:>8.2f}" if ping and result.num_lookups else f"{'-':>8}"
    return (f"{result.policy:<12}{result.hit_ratio:>10.4f}{fraction:>12.3f}{pulled:>12.2f}"
            f"{lookups:>13.3f}{result.lookup_us:>11.1f}{vs_ping}{wait:>10.3f}"
            f"{result.num_dropped:>8}   "
            f"{_per_node(result.requests_per_node)}")


def store_row(result: ReplayResult) -> str:
    """The store's line to print under a policy's table row ("" without a store)."""
    if result.store_label is None:
        return ""
    return (f"\n  {result.store_label}: {result.num_store_blocks} blocks; pulls "
            f"{result.num_store_pulls} of {result.num_pulls} ({result.num_store_pulled_blocks} "
            f"of {result.num_pulled_blocks} pulled blocks); offloaded "
            f"{result.num_offloaded_blocks} ({result.num_ancestor_blocks} ancestors of evicted "
            f"blocks; {result.num_store_present_blocks} more already held), dropped "
            f"{result.num_store_dropped_blocks}, written again "
            f"{result.num_store_rewritten_blocks}, held "
            f"{result.num_store_held_blocks} ({result.num_store_listed_blocks} listed in the "
            f"index) at the end")


def summary_of(result: ReplayResult, oracle_ratio: float) -> dict:
    num_requests = max(1, result.num_requests)
    ping = result.ping_us
    out: dict[str, object] = {
        "hit_ratio": round(result.hit_ratio, 4),
        "fraction_of_unbounded": round(result.hit_ratio / oracle_ratio, 4)
        if oracle_ratio else 0.0,
        "num_dropped": result.num_dropped,
        "avg_wait_s": round(result.total_wait_s / num_requests, 4),
        "requests_per_node": result.requests_per_node,
        "lookups_per_request": round(result.num_lookups / num_requests, 3),
        "lookup_us": round(result.lookup_us, 1),
        "hashes_per_lookup": round(result.num_lookup_hashes / max(1, result.num_lookups), 1),
        "ping_us": None if ping is None else round(ping, 1),
        "lookup_us_per_request": round(1e6 * result.lookup_s / num_requests, 1),
        "lookup_vs_ping": round(result.lookup_us / ping, 3) if ping else None,
    }
    if result.policy == "pull":
        out.update(
            pulled_blocks_per_request=round(result.num_pulled_blocks / num_requests, 3),
            num_pulls=result.num_pulls,
            num_pulled_blocks=result.num_pulled_blocks,
            num_stale_hits=result.num_stale_hits,
            num_relookups=result.num_relookups,
            relookups_per_request=round(result.num_relookups / num_requests, 3),
            pulls_per_holder=result.pulls_per_holder,
        )
    if result.store_label is not None:
        out["store"] = {
            "label": result.store_label,  # pulls_per_holder's last entry
            "num_store_blocks": result.num_store_blocks,
            "num_pulls": result.num_store_pulls,
            "num_pulled_blocks": result.num_store_pulled_blocks,
            "num_offloaded_blocks": result.num_offloaded_blocks,
            "num_ancestor_blocks": result.num_ancestor_blocks,
            "num_dropped_blocks": result.num_store_dropped_blocks,
            "num_rewritten_blocks": result.num_store_rewritten_blocks,
            "num_present_blocks": result.num_store_present_blocks,
            "num_held_blocks": result.num_store_held_blocks,
            "num_listed_blocks": result.num_store_listed_blocks,
        }
    return out
