"""Transitional facade: today's one-object offload API (``Offloader``: ``bind``, ``observe``,
``on_step``, ``wait_idle``, ``close``) built from the two halves, ``OffloadPlanner``
(``planner.py``, scheduler half) and ``OffloadSender`` (``sender.py``, worker half), for a
connector that runs both halves on one thread. It goes once the connector wires the halves
itself: plan in ``build_connector_meta``, submit in ``start_load_kv``, outcomes back through the
worker output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from kvbridge.kvmanager.block_pool import BlockPool

from ..stats import KVTransferStats
from .planner import OffloadPlanner
from .sender import OffloadSender
from .url import parse_store_url

__all__ = ["OffloadSettings", "Offloader", "make_offloader", "parse_store_url"]


class OffloadSettings(Protocol):
    """The configuration fields offload reads (``KVTransferConfig`` has them)."""

    @property
    def offload(self) -> str: ...
    @property
    def store_url(self) -> str | None: ...
    @property
    def offload_blocks_per_step(self) -> int: ...
    @property
    def offload_scan_blocks(self) -> int: ...
    @property
    def offload_max_inflight_bytes(self) -> int: ...


def make_offloader(config: OffloadSettings, stats: KVTransferStats) -> Offloader | None:
    """The node's offloader per ``kv_connector_extra_config`` (None when ``offload`` is off)."""
    if config.offload == "off" or config.store_url is None:
        return None
    return Offloader(
        store_address=parse_store_url(config.store_url),
        policy=config.offload,
        blocks_per_step=config.offload_blocks_per_step,
        scan_blocks=config.offload_scan_blocks,
        max_inflight_bytes=config.offload_max_inflight_bytes,
        stats=stats,
    )


class Offloader:
    """Both halves of offload behind today's API. Owner: the engine thread, which in this
    connector also owns the KV tensors (the sender's writes still run on the loop thread).

    Args:
        store_address: the store's write server ``(host, port)``.
        policy: ``"evict"`` or ``"write_through"``.
        blocks_per_step: most blocks snapshotted per ``on_step``.
        scan_blocks: most free-queue entries looked at per ``on_step``.
        max_inflight_bytes: snapshot bytes allowed to wait for the store.
        stats: the node's ``KVTransferStats`` (offload counters).
    """

    def __init__(
        self,
        *,
        store_address: tuple[str, int],
        policy: str,
        blocks_per_step: int,
        scan_blocks: int,
        max_inflight_bytes: int,
        stats: KVTransferStats,
    ) -> None:
        self.planner = OffloadPlanner(
            policy=policy, blocks_per_step=blocks_per_step, scan_blocks=scan_blocks
        )
        self.sender = OffloadSender(
            store_address=store_address, max_inflight_bytes=max_inflight_bytes, stats=stats
        )

    def bind(self, kv_caches_by_group: Sequence[Sequence[torch.Tensor]], compat_hash: str) -> None:
        """``OffloadSender.bind``."""
        self.sender.bind(kv_caches_by_group, compat_hash)

    def observe(self, events: Iterable[Any]) -> None:
        """``OffloadPlanner.observe``."""
        self.planner.observe(events)

    def on_step(self, block_pool: BlockPool) -> int:
        """Apply the sender's outcomes, plan, and submit: returns the blocks snapshotted. Call
        it after the step's forward (and, for ``"evict"``, after its finished requests were
        freed). Nothing before ``bind``."""
        if not self.sender.is_bound:
            return 0
        self.planner.apply_outcomes(self.sender.take_outcomes())
        return self.sender.submit(self.planner.plan(block_pool))

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """``OffloadSender.wait_idle``."""
        self.sender.wait_idle(timeout_s)

    def close(self) -> None:
        """``OffloadSender.close``."""
        self.sender.close()
