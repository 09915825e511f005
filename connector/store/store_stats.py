"""``StoreStats``: a store node's counters (``node.StoreNode.stats``; ``kvbridge-store`` prints
them as it stops, ``kvbridge-node``'s store app serves them on ``/metrics``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StoreStats"]


@dataclass
class StoreStats:
    """Counters of one store node (thread-safe reads via ``snapshot``).

    ``num_blocks_stored`` / ``bytes_stored``: blocks (or a tensor-parallel rank's slices of
    KV heads of blocks) written; ``num_blocks_present``: writes of
    blocks already held (touched only); ``num_blocks_refused``: writes refused for lack of room;
    ``num_blocks_dropped`` / ``bytes_dropped``: LRU evictions; ``num_blocks_requested`` /
    ``num_blocks_hit`` / ``bytes_served``: blocks pulls asked for, and those the store still held
    (served); ``num_put_errors``: malformed or refused put messages.
    """

    capacity_blocks: int = 0
    num_puts: int = 0
    num_put_errors: int = 0
    num_blocks_stored: int = 0
    bytes_stored: int = 0
    num_blocks_present: int = 0
    num_blocks_refused: int = 0
    num_blocks_dropped: int = 0
    bytes_dropped: int = 0
    num_blocks_requested: int = 0
    num_blocks_hit: int = 0
    bytes_served: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    @property
    def hit_ratio(self) -> float | None:
        """Blocks served / blocks asked for (None before the first pull)."""
        if not self.num_blocks_requested:
            return None
        return self.num_blocks_hit / self.num_blocks_requested

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        out["hit_ratio"] = self.hit_ratio
        return out
