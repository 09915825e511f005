"""``ConnectorContext``: the state both halves of one node's connector share (same process).

vLLM runs the scheduler half and the worker half of a connector in different processes; kvbridge
runs a node in one, so the halves share the lease table, the statistics, the transport, the index
client and, once attached, the ``KVCacheManager`` whose block hashes the holder checks before it
serves a read.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.kvmanager.kv_cache_spec import KVCacheConfig
from kvbridge.transport import LoopbackFaults, LoopbackNetwork, Transport

from .config import KVTransferConfig
from .index.client import IndexClient
from .index.protocol import new_incarnation
from .lease import LeaseTable
from .stats import KVTransferStats
from .store.offload import Offloader, make_offloader

if TYPE_CHECKING:
    from kvbridge.kvmanager.kv_cache_manager import KVCacheManager

__all__ = ["ConnectorContext", "WaitingTickets"]

TICKET_MAX_WAIT_S = 300.0
"""A ticket heart-beaten this long without its request being scheduled is dropped, so a request
lost between admission and the queue cannot pin a prefill node's blocks forever."""


class WaitingTickets:
    """Pull tickets of admitted requests whose pull has not started yet: their leases on the
    prefill node need heartbeats while the request waits in the queue (a queue longer than the
    lease would otherwise lose the blocks). Thread-safe: the scheduler half adds and removes, the
    connector loop reads. A ticket is ``(remote_host, remote_port, remote_request_id)``."""

    def __init__(self, max_wait_s: float = TICKET_MAX_WAIT_S) -> None:
        self._max_wait_s = max_wait_s
        self._added_at: dict[tuple[str, int, str], float] = {}
        self._lock = threading.Lock()

    def add(self, ticket: tuple[str, int, str]) -> None:
        with self._lock:
            self._added_at.setdefault(ticket, time.monotonic())

    def discard(self, ticket: tuple[str, int, str]) -> bool:
        """Stop heart-beating ``ticket``; False if it was not waiting."""
        with self._lock:
            return self._added_at.pop(ticket, None) is not None

    def snapshot(self) -> list[tuple[str, int, str]]:
        """The tickets to heartbeat now (older than ``max_wait_s`` ones are dropped)."""
        now = time.monotonic()
        with self._lock:
            for ticket in [t for t, at in self._added_at.items() if now - at > self._max_wait_s]:
                del self._added_at[ticket]
            return list(self._added_at)

    def __len__(self) -> int:
        with self._lock:
            return len(self._added_at)


@dataclass
class ConnectorContext:
    """State shared by the scheduler and worker halves of one node's connector.

    Attributes:
        incarnation: this start of the node (``new_incarnation()``); the transport advertises it
            as a string, the index fences entries by it.
        store_engine_ids: holders seen with tier ``"store"`` (their pulls count as restores).
    """

    config: KVTransferConfig
    kv_cache_config: KVCacheConfig
    hash_fn_name: str
    stats: KVTransferStats = field(default_factory=KVTransferStats)
    leases: LeaseTable = field(init=False)
    kv_cache_manager: KVCacheManager | None = None
    transport: Transport | None = None
    loopback_network: LoopbackNetwork | None = None
    loopback_faults: LoopbackFaults | None = None
    incarnation: int = field(default_factory=new_incarnation)
    index_client: IndexClient | None = None
    offloader: Offloader | None = None  # issue 7: writes cold blocks to the store tier
    store_engine_ids: set[str] = field(default_factory=set)
    waiting_tickets: WaitingTickets = field(default_factory=WaitingTickets)

    def __post_init__(self) -> None:
        self.leases = LeaseTable(self.config.lease_s)
        if self.offloader is None:
            self.offloader = make_offloader(self.config, self.stats)

    @property
    def block_size(self) -> int:
        """Tokens per block (one block size for every group)."""
        return self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)
