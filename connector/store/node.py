"""The remote store tier's node (issue 7, part 1; docs/architecture.md, "Life of a store offload
and restore").

A ``StoreNode`` holds offloaded blocks in host memory, on one shelf per block geometry
(``shelf.StoreShelf``: a ``StoreCache`` of KV tensors shaped like the writers', a hash map, LRU
eviction within the shelf's share of ``capacity_bytes``), serves pulls with the same
``Transport`` as any holder (its ``block_validator`` checks that the store still holds the
expected hash in that block, so a pull never gets stale bytes and an unknown hash is a load error
for that request), accepts writes on a small TCP server (``server.py``, schema in
``wire.py``; each connection's hello picks its shelf), and publishes what it stores and drops
to the block index as tier ``"store"``, in each shelf's namespace, with its own node id and
incarnation (a restart is a new incarnation: its old entries vanish).

Everything runs on one asyncio loop (the connector's loop thread when in-process). Start and
stop with ``await node.start()`` / ``await node.close()``, or ``start_store_node`` from a thread.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
from kvbridge.kernels.model import ModelConfig
from kvbridge.transport import LoopbackNetwork, NodeMetadata, PeerAddress, Transport
from kvbridge.transport.address import check_host

from ..index.client import INDEX_SOCKET_TIMEOUT_S, IndexClient
from ..index.protocol import IndexNamespace, new_incarnation
from ..index.redis_cluster import cluster_client
from ..loop_thread import get_loop_thread
from .cache import StoreCache
from .model_profile import model_profile, store_kv_caches
from .profile import StoreProfile
from .put_checks import check_put
from .server import StoreWriteServer
from .shelf import StoreShelf
from .store_stats import StoreStats
from .url import format_store_url
from .wire import PutReply, PutRequest, StoreWireError

__all__ = [
    "StoreNode", "StoreStats", "close_store_node", "model_profile", "start_store_node",
    "store_kv_caches",
]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


class StoreNode:
    """A store node. See the module docstring.

    Its blocks are kept on shelves (``shelf.StoreShelf``), one per block geometry
    (``StoreProfile``): a geometry fixed up front by ``model_config`` or ``profile`` is the first
    shelf from the start; a writer's hello (``hello``) of a geometry the store has no shelf for
    opens one, up to ``max_shelves``; a writer beyond that is refused, naming both profiles
    (docs/operations.md, "Several block geometries in one store"). Each shelf gets
    ``capacity_bytes // max_shelves`` bytes of host memory, allocated when it opens.

    ``profile``, ``block_size``, ``kv_caches_by_group``, ``cache``, ``metadata``, ``namespace``,
    ``transport``, ``index_client`` and ``address`` are the first shelf's (None, and ``address``
    raises, before there is one); ``shelves`` lists them all, in the order they opened.

    Args:
        model_config: the model of kvbridge's own nodes whose KV this store keeps (layout,
            dtype, groups: ``model_profile``); None: ``profile``, or the writers'.
        block_size: tokens per block (must match the nodes'), with ``model_config``.
        capacity_bytes: host memory for blocks, across all shelves, groups and layers.
        engine_id: the store's node id in the index and at handshake.
        model_name, model_revision, hash_fn_name: the nodes' (its ``BlockIdentity``: a put
            of another identity is refused; such a node never finds or pulls its blocks).
        index_url: ``redis://...`` or ``"memory"``; None: publish nothing (tests of the cache).
        host, port: where the shelves serve pulls: shelf ``i`` on ``port + i`` (port 0: any
            free one); a hostname or an IP address, IPv6 bare (``"::1"``).
        write_host, write_port: where the write server listens (port 0: any free one).
        transport: ``"ucxx"`` or ``"loopback"`` (needs ``loopback_network``).
        read_guard_s: a block validated for a pull this recently is never overwritten.
        index_ttl_s: the store's index entries expire this long after its last heartbeat.
        index_socket_timeout_s: how long one Redis call of the index may go unanswered before
            it counts as an outage (seconds, > 0; as the engines' ``index_socket_timeout_s``).
        max_put_bytes: largest payload one put may carry.
        auth_key: the cluster key its transport proves and demands (``transport.auth``), as
            every node's ``auth_key``; None: none. The write server is not authenticated.
        profile: the writers' ``StoreProfile`` (their block identity, KV geometry and index
            namespace), in place of ``model_config``, ``block_size`` and the names: the store
            of another engine's KV (vLLM's), fixed up front.
        max_shelves: how many geometries the store keeps at most (>= 1); 1: the store keeps
            the first geometry only, with all of ``capacity_bytes``.

    Raises:
        ValueError: ``max_shelves`` < 1, ``index_socket_timeout_s`` <= 0, or the capacity holds
            no block of the geometry fixed up front.
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
        index_socket_timeout_s: float = INDEX_SOCKET_TIMEOUT_S,
        max_put_bytes: int = 256 << 20,
        auth_key: bytes | None = None,
        profile: StoreProfile | None = None,
        max_shelves: int = 1,
    ) -> None:
        if transport == "loopback" and loopback_network is None:
            raise ValueError("transport 'loopback' needs a loopback_network")
        if max_shelves < 1:
            raise ValueError(f"max_shelves must be >= 1, got {max_shelves}")
        if not index_socket_timeout_s > 0:
            raise ValueError(f"index_socket_timeout_s must be > 0, got {index_socket_timeout_s}")
        check_host(host, what="host")
        check_host(write_host, what="write_host")
        self.engine_id = engine_id
        self.incarnation = new_incarnation()
        self.capacity_bytes, self.read_guard_s = capacity_bytes, read_guard_s
        self.max_shelves = max_shelves
        self.stats = StoreStats()
        self.shelves: list[StoreShelf] = []
        self.index_url = index_url
        self.index_ttl_s, self.index_socket_timeout_s = index_ttl_s, index_socket_timeout_s
        self.max_put_bytes = max_put_bytes
        self._transport_kind = transport
        self._loopback_network = loopback_network
        self._host, self._port = host, port
        self._auth_key = auth_key
        self._write_host, self._write_port = write_host, write_port
        self._server: StoreWriteServer | None = None
        # One thread: index publishes are applied in the order the caches produced them.
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-{engine_id}-index")
        self._shelf_lock = asyncio.Lock()  # hellos that may open a shelf, one at a time
        if profile is None and model_config is not None:  # kvbridge's own nodes of a model
            profile = model_profile(model_config, block_size=block_size, model_name=model_name,
                                    model_revision=model_revision, hash_fn_name=hash_fn_name)
        if profile is not None:
            self.shelves.append(
                self._new_shelf(profile, *profile.kv_caches(self.shelf_capacity_bytes)))

    @property
    def shelf_capacity_bytes(self) -> int:
        """Host memory each shelf gets: ``capacity_bytes // max_shelves``."""
        return self.capacity_bytes // self.max_shelves

    def _new_shelf(self, profile: StoreProfile, kv_caches_by_group: list[list[torch.Tensor]],
                   num_store_blocks: int) -> StoreShelf:
        return StoreShelf(profile, kv_caches_by_group, num_store_blocks,
                          engine_id=self.engine_id, incarnation=self.incarnation,
                          read_guard_s=self.read_guard_s, node_stats=self.stats,
                          publisher=self._publisher)

    # ------------------------------------------------------------------ the first shelf
    @property
    def _first(self) -> StoreShelf | None:
        return self.shelves[0] if self.shelves else None

    @property
    def profile(self) -> StoreProfile | None:
        return None if self._first is None else self._first.profile

    @property
    def block_size(self) -> int | None:
        return None if self._first is None else self._first.block_size

    @property
    def kv_caches_by_group(self) -> list[list[torch.Tensor]] | None:
        return None if self._first is None else self._first.kv_caches_by_group

    @property
    def cache(self) -> StoreCache | None:
        return None if self._first is None else self._first.cache

    @property
    def metadata(self) -> NodeMetadata | None:
        return None if self._first is None else self._first.metadata

    @property
    def namespace(self) -> IndexNamespace | None:
        return None if self._first is None else self._first.namespace

    @property
    def transport(self) -> Transport | None:
        return None if self._first is None else self._first.transport

    @property
    def index_client(self) -> IndexClient | None:
        return None if self._first is None else self._first.index_client

    # ------------------------------------------------------------------ life
    @property
    def address(self) -> PeerAddress:
        """Where the first shelf serves pulls (valid once it has a geometry and started)."""
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
        if self.shelves:  # the geometry fixed up front
            await self._open(self.shelves[0], 0)
        elif self.index_url and self.index_url.startswith("redis-cluster://"):
            # the shelves (and their index clients) wait for writers: refuse a dead cluster now
            cluster_client(self.index_url, socket_timeout_s=1.0, connect_timeout_s=1.0).close()
        self._server = StoreWriteServer(self, host=self._write_host, port=self._write_port)
        await self._server.start()
        if not self.shelves:
            logger.info("store %s: writes on %s; block geometries come with the writers "
                        "(at most %d, %d bytes each)", self.engine_id, self.store_url,
                        self.max_shelves, self.shelf_capacity_bytes)

    async def _open(self, shelf: StoreShelf, number: int) -> None:
        """Open ``shelf``, the store's shelf ``number`` (its pulls on ``port + number``)."""
        port = self._port + number if self._port else 0
        await shelf.open(transport=self._transport_kind, host=self._host, port=port,
                         auth_key=self._auth_key, loopback_network=self._loopback_network,
                         index_url=self.index_url, index_ttl_s=self.index_ttl_s,
                         index_socket_timeout_s=self.index_socket_timeout_s)

    async def close(self) -> None:
        """Stop the write server and every shelf, withdraw from the index. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            await server.close()
        shelves, self.shelves = self.shelves, []
        for shelf in shelves:
            await shelf.close()
            shelf.release()
        self._publisher.shutdown(wait=False)

    async def hello(self, profile: StoreProfile) -> StoreShelf:
        """A writer's hello (``PutHandler``): the shelf of ``profile``, opened if the store has
        none yet (allocate its blocks, start its transport, register in its index namespace).
        The write server sends that connection's puts to it.

        Raises:
            StoreWireError: the store keeps ``max_shelves`` geometries already
                (``StoreProfile.refusal``: names the first shelf's and the writer's, and says to
                start another kvbridge-store), another shelf has the writer's index namespace
                (its engines could not tell the two apart), or a geometry the store could not
                take (its share of the capacity holds no block of it, its transport did not
                start); no shelf is then opened.
        """
        async with self._shelf_lock:
            for shelf in self.shelves:
                if shelf.profile == profile:
                    return shelf
            if len(self.shelves) >= self.max_shelves:
                raise StoreWireError(self.shelves[0].profile.refusal(
                    profile, max_shelves=self.max_shelves))
            for shelf in self.shelves:
                if shelf.namespace == profile.namespace:
                    raise StoreWireError(
                        "this store keeps blocks of another geometry in the writer's index "
                        f"namespace ({shelf.profile.first_difference(profile)}); engines could "
                        "not tell the two apart: give the models distinct names or revisions, "
                        "or start another kvbridge-store for it")
            loop = asyncio.get_running_loop()
            try:
                caches, num_blocks = await loop.run_in_executor(
                    None, profile.kv_caches, self.shelf_capacity_bytes)
            except Exception as exc:
                raise StoreWireError(f"this store cannot take the writer's block geometry: "
                                     f"{exc}") from None
            shelf = self._new_shelf(profile, caches, num_blocks)
            try:
                await self._open(shelf, len(self.shelves))
            except Exception as exc:
                await shelf.close()
                shelf.release()
                raise StoreWireError(f"this store cannot take the writer's block geometry: "
                                     f"{exc}") from None
            self.shelves.append(shelf)
            return shelf

    # ------------------------------------------------------------------ writes (PutHandler)
    def count_put_error(self) -> None:
        """One malformed or refused put frame (``StoreStats.num_put_errors``)."""
        self.stats.add(num_put_errors=1)

    def shelf_for(self, put: PutRequest, shelf: StoreShelf | None = None) -> StoreShelf:
        """The shelf ``put`` goes to: ``shelf`` (its connection's hello's), or, for a
        connection without a hello, the one shelf whose ``compat_hash`` is the put's.

        Raises:
            StoreWireError: no shelf yet, or none (or more than one) of the put's
                ``compat_hash`` (``put_checks.check_put`` names the difference).
        """
        if shelf is not None:
            return shelf
        matching = [s for s in self.shelves if s.metadata.compat_hash == put.compat_hash]
        if len(matching) == 1:
            return matching[0]
        if len(matching) > 1:
            raise StoreWireError("this store keeps blocks of this compat_hash for several "
                                 "tensor-parallel layouts: a writer names its own in a hello "
                                 "on its connection")
        check_put(put, self.metadata, self.cache)  # raises naming what differs
        raise StoreWireError(f"compat_hash {put.compat_hash[:16]}... is not this store's")

    def check_put(self, put: PutRequest, shelf: StoreShelf | None = None) -> None:
        """Raise StoreWireError if ``put`` does not fit its shelf (``shelf_for``;
        ``put_checks.check_put``: identity, groups, sizes, KV heads)."""
        self.shelf_for(put, shelf).check_put(put)

    async def put(self, put: PutRequest, payload: torch.Tensor,
                  shelf: StoreShelf | None = None) -> PutReply:
        """Store a checked put (``check_put``) on its shelf (``shelf_for``); publish the index
        events before replying, so a writer that got ``put_ok`` finds the blocks indexed.

        Args:
            payload: uint8 ``[put.payload_nbytes]`` on CPU, the groups' staging bytes back to
                back (read only; copied once into the shelf's tensors, so the caller may reuse
                it as soon as this returns).

        Raises:
            ValueError: ``payload`` is not ``put.payload_nbytes`` uint8 bytes.
        """
        if payload.dtype != torch.uint8 or tuple(payload.shape) != (put.payload_nbytes,):
            raise ValueError(
                f"payload must be uint8 [{put.payload_nbytes}], got {payload.dtype} "
                f"{tuple(payload.shape)}"
            )
        return await self.shelf_for(put, shelf).put(put, payload)


def start_store_node(node: StoreNode) -> StoreNode:
    """Start ``node`` on the process's connector loop thread (from any other thread)."""
    get_loop_thread().run(node.start(), _START_TIMEOUT_S)
    return node


def close_store_node(node: StoreNode) -> None:
    """Close ``node`` on the connector loop thread (from any other thread)."""
    get_loop_thread().run(node.close(), _START_TIMEOUT_S)
