"""The remote store tier's node (issue 7, part 1; docs/architecture.md, "Life of a store offload
and restore").

A ``StoreNode`` holds offloaded blocks in host memory (``StoreCache``: KV tensors shaped like a
node's, a hash map, LRU eviction within ``capacity_bytes``), serves pulls with the same
``Transport`` as any holder (its ``block_validator`` checks that the store still holds the
expected hash in that block, so a pull never gets stale bytes and an unknown hash is a load error
for that request), accepts writes on a small TCP server (``server.py``, schema in
``wire.py``), and publishes what it stores and drops to the block index as tier ``"store"``
with its own node id and incarnation (a restart is a new incarnation: its old entries vanish).

Everything runs on one asyncio loop (the connector's loop thread when in-process). Start and
stop with ``await node.start()`` / ``await node.close()``, or ``start_store_node`` from a thread.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Literal

import torch
from kvbridge.kernels.model import ModelConfig
from kvbridge.transport import LeaseRef, LoopbackNetwork, NodeMetadata, PeerAddress, Transport
from kvbridge.transport.address import check_host, format_host_port

from ..index.client import IndexClient, open_index
from ..index.protocol import IndexNamespace, new_incarnation
from ..index.redis_cluster import cluster_client
from ..loop_thread import get_loop_thread
from .cache import StoreCache
from .model_profile import model_profile, store_kv_caches
from .profile import StoreProfile
from .put_checks import check_put, put_heads
from .server import StoreWriteServer
from .store_stats import StoreStats
from .url import format_store_url
from .wire import PutReply, PutRequest, StoreWireError

__all__ = [
    "StoreNode", "StoreStats", "close_store_node", "model_profile", "start_store_node",
    "store_kv_caches",
]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0
# How long a put waits for its index events to reach the index before replying anyway (the index
# down: the put still succeeds, its blocks are found once the queued batch lands).
_PUBLISH_WAIT_S = 2.0


class StoreNode:
    """A store node. See the module docstring.

    The block geometry (``profile``) is fixed up front by ``model_config`` or ``profile``, or,
    with neither, taken from the first writer's hello (``hello``): until then the store has no
    KV tensors, no transport and no index registration (``profile``, ``cache``, ``metadata``,
    ``namespace`` and ``transport`` are None), and refuses puts. One store keeps one geometry:
    a writer of another is refused, naming both profiles (docs/operations.md, "One block
    geometry per store").

    Args:
        model_config: the model of kvbridge's own nodes whose KV this store keeps (layout,
            dtype, groups: ``model_profile``); None: ``profile``, or the first writer's.
        block_size: tokens per block (must match the nodes'), with ``model_config``.
        capacity_bytes: host memory for blocks, across all groups and layers.
        engine_id: the store's node id in the index and at handshake.
        model_name, model_revision, hash_fn_name: the nodes' (its ``BlockIdentity``: a put
            of another identity is refused; such a node never finds or pulls its blocks).
        index_url: ``redis://...`` or ``"memory"``; None: publish nothing (tests of the cache).
        host, port: where the transport serves pulls (port 0: any free one); a hostname or an
            IP address, IPv6 bare (``"::1"``).
        write_host, write_port: where the write server listens (port 0: any free one).
        transport: ``"ucxx"`` or ``"loopback"`` (needs ``loopback_network``).
        read_guard_s: a block validated for a pull this recently is never overwritten.
        index_ttl_s: the store's index entries expire this long after its last heartbeat.
        max_put_bytes: largest payload one put may carry.
        auth_key: the cluster key its transport proves and demands (``transport.auth``), as
            every node's ``auth_key``; None: none. The write server is not authenticated.
        profile: the writers' ``StoreProfile`` (their block identity, KV geometry and index
            namespace), in place of ``model_config``, ``block_size`` and the names: the store
            of another engine's KV (vLLM's), fixed up front.

    Raises:
        ValueError: the capacity holds no block of the geometry fixed up front.
    """

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        *,
        block_size: int = 16,
        capacity_bytes: int,
        engine_id: str = "store-0",
        model_name: str = "kvbridge",
        model_revision: str = "",
        hash_fn_name: str = "sha256_cbor",
        index_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        write_host: str = "127.0.0.1",
        write_port: int = 0,
        transport: Literal["ucxx", "loopback"] = "ucxx",
        loopback_network: LoopbackNetwork | None = None,
        read_guard_s: float = 30.0,
        index_ttl_s: float = 10.0,
        max_put_bytes: int = 256 << 20,
        auth_key: bytes | None = None,
        profile: StoreProfile | None = None,
    ) -> None:
        if transport == "loopback" and loopback_network is None:
            raise ValueError("transport 'loopback' needs a loopback_network")
        check_host(host, what="host")
        check_host(write_host, what="write_host")
        self.engine_id = engine_id
        self.incarnation = new_incarnation()
        self.capacity_bytes, self.read_guard_s = capacity_bytes, read_guard_s
        self.stats = StoreStats()
        self.profile: StoreProfile | None = None
        self.block_size: int | None = None
        self.kv_caches_by_group: list[list[torch.Tensor]] | None = None
        self.cache: StoreCache | None = None
        self.metadata: NodeMetadata | None = None
        self.namespace: IndexNamespace | None = None
        if profile is None and model_config is not None:  # kvbridge's own nodes of a model
            profile = model_profile(model_config, block_size=block_size, model_name=model_name,
                                    model_revision=model_revision, hash_fn_name=hash_fn_name)
        if profile is not None:
            self._shelve(profile, *profile.kv_caches(capacity_bytes))
        self._shelf_lock = asyncio.Lock()  # hellos that may open the shelf, one at a time
        self.index_url = index_url
        self.index_ttl_s = index_ttl_s
        self.max_put_bytes = max_put_bytes
        self._transport_kind = transport
        self._loopback_network = loopback_network
        self._host, self._port = host, port
        self._auth_key = auth_key
        self._write_host, self._write_port = write_host, write_port
        self.transport: Transport | None = None
        self.index_client: IndexClient | None = None
        self._server: StoreWriteServer | None = None
        self._index_tick: asyncio.Task[None] | None = None
        # One thread: index publishes are applied in the order the cache produced them.
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-{engine_id}-index")

    def _shelve(self, profile: StoreProfile, kv_caches_by_group: list[list[torch.Tensor]],
                num_store_blocks: int) -> None:
        """Take ``profile``'s geometry over ``kv_caches_by_group`` (``profile.kv_caches``)."""
        self.profile, self.block_size = profile, profile.identity.block_size
        self.kv_caches_by_group = kv_caches_by_group
        self.cache = StoreCache(kv_caches_by_group, read_guard_s=self.read_guard_s)
        self.stats.capacity_blocks = num_store_blocks
        self.metadata = replace(profile.metadata(self.engine_id, kv_caches_by_group),
                                incarnation=str(self.incarnation))
        self.namespace = profile.namespace

    def _unshelve(self) -> None:
        self.profile = self.block_size = self.kv_caches_by_group = None
        self.cache = self.metadata = self.namespace = None
        self.stats.capacity_blocks = 0

    # ------------------------------------------------------------------ life
    @property
    def address(self) -> PeerAddress:
        """Where the store serves pulls (valid once it has a geometry and started)."""
        if self.transport is None:
            raise RuntimeError("StoreNode.address read before start() or before its geometry")
        return self.transport.address

    @property
    def write_address(self) -> tuple[str, int]:
        """``(host, port)`` of the write server, host bare (valid after ``start``)."""
        if self._server is None:
            raise RuntimeError("StoreNode.write_address read before start()")
        return self._server.address

    @property
    def store_url(self) -> str:
        """The ``store_url`` nodes write to: ``"host:port"``, ``"[ipv6]:port"`` for IPv6."""
        return format_store_url(*self.write_address)

    async def start(self) -> None:
        """Serve pulls, accept writes, register in the index (a fresh incarnation). A start
        that fails part-way closes what it started (``close``) and raises."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        if self.profile is not None:
            await self._open_shelf()
        elif self.index_url and self.index_url.startswith("redis-cluster://"):
            # the shelf (and its index client) waits for a writer: refuse a dead cluster now
            cluster_client(self.index_url, socket_timeout_s=1.0, connect_timeout_s=1.0).close()
        self._server = StoreWriteServer(self, host=self._write_host, port=self._write_port)
        await self._server.start()
        if self.transport is None:
            logger.info("store %s: writes on %s; its block geometry comes with the first "
                        "writer", self.engine_id, self.store_url)

    async def _open_shelf(self) -> None:
        """Serve pulls of the geometry's blocks and register in the index."""
        assert self.metadata is not None and self.cache is not None
        where: dict[str, Any] = {"host": self._host, "port": self._port,
                                 "auth_key": self._auth_key}
        if self._transport_kind == "loopback":
            from kvbridge.transport import LoopbackTransport

            where["network"] = self._loopback_network
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
        if self.index_url:
            index, directory = open_index(self.index_url, self.namespace)
            self.index_client = IndexClient(
                index,
                directory,
                node_id=self.engine_id,
                incarnation=self.incarnation,
                group_ids=range(len(self.kv_caches_by_group)),
                ttl_s=self.index_ttl_s,
                tier="store",
            )
            loop = asyncio.get_running_loop()
            self.index_client.set_resync_events(lambda: self._resync_events(loop))
            client, address = self.index_client, self.transport.address
            await loop.run_in_executor(self._publisher, client.start, address.host, address.port)
            self._index_tick = asyncio.create_task(self._tick_index(client))
        logger.info("store %s: %d blocks, pulls on %s, profile %s", self.engine_id,
                    self.cache.num_store_blocks, format_host_port(*self.transport.address),
                    self.profile.to_json() if self.profile is not None else None)

    async def close(self) -> None:
        """Stop the write server and the transport, withdraw from the index. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            await server.close()
        await self._close_shelf()
        self._publisher.shutdown(wait=False)

    async def _close_shelf(self) -> None:
        tick, self._index_tick = self._index_tick, None
        if tick is not None:
            tick.cancel()
        transport, self.transport = self.transport, None
        if transport is not None:
            await transport.close()
        client, self.index_client = self.index_client, None
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(self._publisher, client.close)

    async def hello(self, profile: StoreProfile) -> int:
        """A writer's hello (``PutHandler``): without a geometry, take ``profile``'s (allocate
        the blocks, start the transport, register in its index namespace); with one, check that
        ``profile`` is it. Returns the store's incarnation.

        Raises:
            StoreWireError: another profile (``StoreProfile.refusal``: names both, and says to
                start another kvbridge-store), or a geometry the store could not take (its
                capacity holds no block of it, its transport did not start); the store then
                still has no geometry.
        """
        async with self._shelf_lock:
            if self.profile is None:
                loop = asyncio.get_running_loop()
                try:
                    caches, num_blocks = await loop.run_in_executor(
                        None, profile.kv_caches, self.capacity_bytes)
                    self._shelve(profile, caches, num_blocks)
                    await self._open_shelf()
                except Exception as exc:
                    await self._close_shelf()
                    self._unshelve()
                    raise StoreWireError(f"this store cannot take the writer's block geometry: "
                                         f"{exc}") from None
            elif profile != self.profile:
                raise StoreWireError(self.profile.refusal(profile))
        return self.incarnation

    # ------------------------------------------------------------------ writes (PutHandler)
    def count_put_error(self) -> None:
        """One malformed or refused put frame (``StoreStats.num_put_errors``)."""
        self.stats.add(num_put_errors=1)

    def check_put(self, put: PutRequest) -> None:
        """Raise StoreWireError if ``put`` does not fit this store (``put_checks.check_put``:
        identity, groups, sizes, KV heads)."""
        check_put(put, self.metadata, self.cache)

    async def put(self, put: PutRequest, payload: torch.Tensor) -> PutReply:
        """Store a checked put (``check_put``); publish the index events before replying, so a
        writer that got ``put_ok`` finds the blocks indexed.

        Args:
            payload: uint8 ``[put.payload_nbytes]`` on CPU, the groups' staging bytes back to
                back (read only; copied once into the store's tensors, so the caller may reuse
                it as soon as this returns).

        Raises:
            ValueError: ``payload`` is not ``put.payload_nbytes`` uint8 bytes.
        """
        if payload.dtype != torch.uint8 or tuple(payload.shape) != (put.payload_nbytes,):
            raise ValueError(
                f"payload must be uint8 [{put.payload_nbytes}], got {payload.dtype} "
                f"{tuple(payload.shape)}"
            )
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
            self.stats.add(
                num_blocks_stored=result.num_stored,
                bytes_stored=result.num_stored * block_nbytes,
                num_blocks_present=result.num_present,
                num_blocks_refused=len(result.refused),
                num_blocks_dropped=result.num_dropped,
                bytes_dropped=result.num_dropped * self.cache.groups[group.group_id].block_nbytes,
            )
        if any(group.block_hashes for group in put.groups):  # not a writer's empty probe
            self.stats.add(num_puts=1)
        client = self.index_client
        if events and client is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._publisher, self._publish_and_wait, client, events)
        return PutReply(num_stored, num_present, len(refused), tuple(refused), tuple(missing),
                        self.incarnation, num_incomplete)

    async def _tick_index(self, client: IndexClient) -> None:
        """Offer the index client a step every third of the TTL, so that a resync it asks for
        (Redis restarted empty, a lost batch) is read while no put comes: the store's held
        blocks are listed again without being written again. Survives a failed step."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.index_ttl_s / 3)
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

        return asyncio.run_coroutine_threadsafe(read(), loop).result(_START_TIMEOUT_S)

    def _publish_and_wait(self, client: IndexClient, events: list[Any]) -> None:
        """On the publisher thread: queue ``events`` and wait (at most ``_PUBLISH_WAIT_S``)
        until the index client has applied them, so that a ``put_ok`` means "indexed"."""
        client.publish(events)
        if not client.flush(timeout_s=_PUBLISH_WAIT_S):
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
        """The store's ``block_validator``: ``cache.validate`` (the ``lease`` is ignored), counted
        once per read in the store's stats."""
        bad = self.cache.validate(group_id, block_ids, expected_hashes, lease)
        num_hit = len(block_ids) - len(bad)
        groups = self.cache.groups
        block_nbytes = groups[group_id].block_nbytes if group_id < len(groups) else 0
        self.stats.add(
            num_blocks_requested=len(block_ids),
            num_blocks_hit=num_hit,
            bytes_served=num_hit * block_nbytes,
        )
        return bad


def start_store_node(node: StoreNode) -> StoreNode:
    """Start ``node`` on the process's connector loop thread (from any other thread)."""
    get_loop_thread().run(node.start(), _START_TIMEOUT_S)
    return node


def close_store_node(node: StoreNode) -> None:
    """Close ``node`` on the connector loop thread (from any other thread)."""
    get_loop_thread().run(node.close(), _START_TIMEOUT_S)
