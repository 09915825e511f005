"""``StoreShelf``: one block geometry's part of a store node (docs/operations.md, "Several
block geometries in one store").

A shelf holds the blocks of one ``StoreProfile``: its own ``StoreCache`` over host tensors of
that geometry, its own transport listener whose handshake is the profile's identity (a puller
of another identity is refused there), and its own index client, which publishes in the
profile's index namespace (where engines of that geometry look up) under the store's node id,
its entries naming this shelf's pull address. The node (``node.StoreNode``) opens a shelf when
the first writer of a profile says hello, routes each write connection to it, and closes it.

Everything runs on the node's asyncio loop, except the index publishes, which run on the node's
publisher thread (one for all shelves, so each shelf's events are applied in order).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any, Literal

import torch
from kvbridge.transport import LeaseRef, LoopbackNetwork, PeerAddress, Transport
from kvbridge.transport.address import format_host_port

from ..index.client import IndexClient, open_index
from .cache import StoreCache
from .profile import StoreProfile
from .put_checks import check_put, put_heads
from .store_stats import StoreStats
from .wire import PutReply, PutRequest

__all__ = ["StoreShelf"]

logger = logging.getLogger(__name__)

_RESYNC_TIMEOUT_S = 60.0
# How long a put waits for its index events to reach the index before replying anyway (the index
# down: the put still succeeds, its blocks are found once the queued batch lands).
_PUBLISH_WAIT_S = 2.0


class StoreShelf:
    """One geometry's blocks in a store. See the module docstring.

    Args:
        profile: the geometry (the writers' ``StoreProfile``).
        kv_caches_by_group: its host tensors (``profile.kv_caches``), ``[group][layer]``
            ``[num_store_blocks + 1, *block_shape]``; held, written by puts, read by pulls.
        num_store_blocks: blocks the tensors hold.
        engine_id, incarnation: the store's (its handshake and index entries).
        read_guard_s: a block validated for a pull this recently is never overwritten.
        node_stats: the store's totals; the shelf counts into them and into its own ``stats``.
        publisher: the node's single index thread.

    Attributes:
        stats: this shelf's counters (``capacity_blocks`` is its own).
        transport, index_client: set by ``open`` (None before and after ``close``).
    """

    def __init__(self, profile: StoreProfile, kv_caches_by_group: list[list[torch.Tensor]],
                 num_store_blocks: int, *, engine_id: str, incarnation: int,
                 read_guard_s: float, node_stats: StoreStats, publisher: Executor) -> None:
        self.profile, self.block_size = profile, profile.identity.block_size
        self.kv_caches_by_group = kv_caches_by_group
        self.cache = StoreCache(kv_caches_by_group, read_guard_s=read_guard_s)
        self.metadata = replace(profile.metadata(engine_id, kv_caches_by_group),
                                incarnation=str(incarnation))
        self.namespace = profile.namespace
        self.engine_id, self.incarnation = engine_id, incarnation
        self.stats = StoreStats(capacity_blocks=num_store_blocks)
        self._sinks = (self.stats, node_stats)
        node_stats.add(capacity_blocks=num_store_blocks)
        self._publisher = publisher
        self.transport: Transport | None = None
        self.index_client: IndexClient | None = None
        self._index_tick: asyncio.Task[None] | None = None

    def count(self, **amounts: int) -> None:
        """Add ``amounts`` to this shelf's counters and to the store's totals."""
        for stats in self._sinks:
            stats.add(**amounts)

    @property
    def address(self) -> PeerAddress:
        """Where this shelf serves pulls (valid once opened)."""
        if self.transport is None:
            raise RuntimeError("StoreShelf.address read before open()")
        return self.transport.address

    # ------------------------------------------------------------------ life
    async def open(self, *, transport: Literal["ucxx", "loopback"], host: str, port: int,
                   auth_key: bytes | None, loopback_network: LoopbackNetwork | None,
                   index_url: str | None, index_ttl_s: float,
                   index_socket_timeout_s: float) -> None:
        """Serve pulls of this geometry's blocks on ``host:port`` (0: any free port) and
        register in its index namespace (``index_url`` None: publish nothing). A failed open
        leaves what it started for ``close``."""
        where: dict[str, Any] = {"host": host, "port": port, "auth_key": auth_key}
        if transport == "loopback":
            from kvbridge.transport import LoopbackTransport

            where["network"] = loopback_network
            self.transport = LoopbackTransport(self.metadata, self.kv_caches_by_group, **where)
        else:
            from kvbridge.transport import UcxxTransport

            self.transport = UcxxTransport(self.metadata, self.kv_caches_by_group, **where)
        # The transport re-checks served blocks after copying them; the re-check must not count
        # requests and hits a second time.
        self.transport.set_callbacks(
            block_validator=self._validate_blocks,
            block_rechecker=self.cache.validate,
            serve_unchecked_reads=False,  # the store serves by hash only
        )
        await self.transport.start()
        if index_url:
            index, directory = open_index(index_url, self.namespace,
                                          socket_timeout_s=index_socket_timeout_s)
            self.index_client = IndexClient(
                index, directory, node_id=self.engine_id, incarnation=self.incarnation,
                group_ids=range(len(self.kv_caches_by_group)), ttl_s=index_ttl_s, tier="store",
            )
            loop = asyncio.get_running_loop()
            self.index_client.set_resync_events(lambda: self._resync_events(loop))
            client, address = self.index_client, self.transport.address
            await loop.run_in_executor(self._publisher, client.start, address.host, address.port)
            self._index_tick = asyncio.create_task(self._tick_index(client, index_ttl_s / 3))
        logger.info("store %s: %d blocks, pulls on %s, profile %s", self.engine_id,
                    self.cache.num_store_blocks, format_host_port(*self.transport.address),
                    self.profile.to_json())

    async def close(self) -> None:
        """Stop serving pulls and withdraw from the index. Idempotent."""
        tick, self._index_tick = self._index_tick, None
        if tick is not None:
            tick.cancel()
        transport, self.transport = self.transport, None
        if transport is not None:
            await transport.close()
        client, self.index_client = self.index_client, None
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(self._publisher, client.close)

    def release(self) -> None:
        """Take this shelf's capacity back out of the store's totals (a shelf that failed to
        open, or is closed with its store)."""
        self._sinks[1].add(capacity_blocks=-self.stats.capacity_blocks)

    # ------------------------------------------------------------------ writes
    def check_put(self, put: PutRequest) -> None:
        """Raise StoreWireError if ``put`` does not fit this shelf (``put_checks.check_put``)."""
        check_put(put, self.metadata, self.cache)

    async def put(self, put: PutRequest, payload: torch.Tensor) -> PutReply:
        """Store a checked put (``check_put``) from ``payload`` (uint8 ``[put.payload_nbytes]``,
        read only); publish its index events before replying. See ``StoreNode.put``."""
        events: list[Any] = []
        refused: list[tuple[int, bytes]] = []
        missing: list[tuple[int, bytes]] = []
        num_stored = num_present = num_incomplete = 0
        offset = 0
        heads = put_heads(put, self.metadata)
        for group in put.groups:
            caches = self.cache.groups[group.group_id].kv_caches
            n = len(group.block_hashes)
            staging = payload[offset : offset + group.nbytes]
            offset += group.nbytes
            if not n:
                continue
            if heads is None or heads.whole:
                staging = staging.view(caches[0].dtype).view(len(caches), n, *caches[0].shape[1:])
            else:  # each row's bytes of these heads
                staging = staging.view(len(caches), n, -1)
            result = self.cache.put(
                group.group_id, group.block_hashes, group.parent_hashes, staging, heads
            )
            block_nbytes = group.nbytes // n  # the bytes a block of this put carries
            num_incomplete += result.num_incomplete
            num_stored += result.num_stored
            num_present += result.num_present
            refused.extend((group.group_id, h) for h in result.refused)
            missing.extend((group.group_id, h) for h in result.missing_ancestors)
            events.extend(result.events)
            self.count(
                num_blocks_stored=result.num_stored,
                bytes_stored=result.num_stored * block_nbytes,
                num_blocks_present=result.num_present,
                num_blocks_refused=len(result.refused),
                num_blocks_dropped=result.num_dropped,
                bytes_dropped=result.num_dropped * self.cache.groups[group.group_id].block_nbytes,
            )
        if any(group.block_hashes for group in put.groups):  # not a writer's empty probe
            self.count(num_puts=1)
        client = self.index_client
        if events and client is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._publisher, self._publish_and_wait, client, events)
        return PutReply(num_stored, num_present, len(refused), tuple(refused), tuple(missing),
                        self.incarnation, num_incomplete)

    # ------------------------------------------------------------------ index
    async def _tick_index(self, client: IndexClient, interval_s: float) -> None:
        """Offer the index client a step every ``interval_s``, so that a resync it asks for
        (Redis restarted empty, a lost batch) is read while no put comes: the shelf's held
        blocks are listed again without being written again. Survives a failed step."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)
            try:
                await loop.run_in_executor(self._publisher, client.publish, [])
            except Exception:
                logger.exception("store %s: index step failed", self.engine_id)

    def _resync_events(self, loop: asyncio.AbstractEventLoop) -> list[Any]:
        """The index client's resync, called on the publisher thread: ``cache.resync_events``,
        read on the loop thread that owns the cache. A put's events queued behind the read
        repeat stores it saw, with the same parents (the index applies them to the same end),
        and removals of blocks it no longer held."""

        async def read() -> list[Any]:
            return self.cache.resync_events()

        return asyncio.run_coroutine_threadsafe(read(), loop).result(_RESYNC_TIMEOUT_S)

    def _publish_and_wait(self, client: IndexClient, events: list[Any]) -> None:
        """On the publisher thread: queue ``events`` and wait (at most ``_PUBLISH_WAIT_S``)
        until the index client has applied them, so that a ``put_ok`` means "indexed"."""
        client.publish(events)
        # (an index that does not answer said so in a line of its own; flush returns at once
        # while the store's registration is unanswered: its events wait queued for it)
        if not client.flush(timeout_s=_PUBLISH_WAIT_S) and client.index.available:
            logger.warning("store %s: index events of a put not applied within %.1f s; "
                           "replying anyway", self.engine_id, _PUBLISH_WAIT_S)

    # ------------------------------------------------------------------ reads
    def _validate_blocks(
        self,
        group_id: int,
        block_ids: list[int],
        expected_hashes: list[bytes],
        lease: LeaseRef | None = None,
    ) -> list[int]:
        """The shelf's ``block_validator``: ``cache.validate`` (the ``lease`` is ignored),
        counted once per read."""
        bad = self.cache.validate(group_id, block_ids, expected_hashes, lease)
        num_hit = len(block_ids) - len(bad)
        groups = self.cache.groups
        block_nbytes = groups[group_id].block_nbytes if group_id < len(groups) else 0
        self.count(
            num_blocks_requested=len(block_ids),
            num_blocks_hit=num_hit,
            bytes_served=num_hit * block_nbytes,
        )
        return bad
