"""Offload policy of a node (issue 7, part 2): write cold cached blocks to the store tier.

A block that is hashed and has ``ref_cnt == 0`` sits in the ``BlockPool`` free queue, still
findable by its hash, until ``get_new_blocks`` pops it and drops the hash (seed: the free queue is
the LRU order; the head is evicted first). Policy ``"evict"``: once per engine step the scheduler
half calls ``Offloader.on_step`` (from ``update_connector_output``: after the step's forward pass
and after the step's finished requests were freed, before the next ``schedule`` can reuse their
blocks); it walks the free queue from its head (at most ``scan_blocks`` entries), takes up to
``blocks_per_step`` hashed blocks not yet offloaded, gathers their bytes into staging tensors
(a consistent snapshot: this runs on the engine thread between forward passes, and a cached block
is never written again), and hands the send to the connector's loop thread. The step never waits
for the network. A block reused before its snapshot was taken is simply not offloaded.

Policy ``"write_through"``: additionally, every block that became cached (a ``BlockStored`` event)
is snapshotted at the next ``on_step`` (after the forward pass that computed it), if it still
holds that hash.

Parents. The store publishes a block to the index only once its chain back to the first block is
held (``cache.py``), so each write carries the block's parent hash, learned here from the
pool's ``BlockStored`` events (``observe``, fed by the connector's event publishing).

Back-pressure: at most ``max_inflight_bytes`` of snapshots wait for the store; beyond that a step
offloads nothing (counted in ``num_offload_skipped_blocks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from kvbridge.kernels import gather_blocks
from kvbridge.kvmanager.block_hash import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvbridge.kvmanager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from ..loop_thread import get_loop_thread
from ..stats import KVTransferStats
from .server import recv_exactly
from .wire import (
    FRAME_HEADER,
    PutGroup,
    PutReply,
    PutRequest,
    StoreWireError,
    decode_header,
    decode_reply,
    encode_put_header,
)

if TYPE_CHECKING:
    from kvbridge.kvmanager.block_pool import BlockPool

    from ..config import KVTransferConfig

__all__ = [
    "Offloader",
    "StoreWriter",
    "make_offloader",
    "parse_store_url",
    "snapshot_blocks",
    "staging_nbytes",
]

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 1 << 20
_PUT_TIMEOUT_S = 30.0
_MAX_REPLY_HEADER_BYTES = 1 << 20


def parse_store_url(url: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``. Raises ValueError for anything else."""
    host, sep, port = url.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store_url must be 'host:port', got {url!r}")
    return host, int(port)


def make_offloader(config: KVTransferConfig, stats: KVTransferStats) -> Offloader | None:
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


class StoreWriter:
    """One TCP connection to a store's write server, used from the connector's event loop; puts
    are sent one at a time (a lock), reconnecting after an error.

    The payload parts go out with ``loop.sock_sendall`` straight from the caller's memory (no
    copy into a stream buffer, no msgpack of the bytes): only the small header is packed."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._lock = asyncio.Lock()
        self._sock: socket.socket | None = None

    async def put(self, put: PutRequest, payloads: Sequence[memoryview]) -> PutReply:
        """Send ``put`` with its payload parts (byte views, ``put.payload_nbytes`` in all; read
        only, the caller keeps them alive until this returns); returns the store's reply.

        Raises:
            ValueError: the parts do not add up to ``put.payload_nbytes``.
            StoreWireError: the store refused the put (its message) or replied garbage.
            OSError, EOFError, asyncio.TimeoutError: the store is unreachable, closed the
                connection or is too slow.
        """
        num_bytes = sum(part.nbytes for part in payloads)
        if num_bytes != put.payload_nbytes:
            raise ValueError(f"payload parts hold {num_bytes} bytes, the put {put.payload_nbytes}")
        async with self._lock:
            try:
                return await asyncio.wait_for(self._put(put, payloads), _PUT_TIMEOUT_S)
            except BaseException:
                await self.close()  # the stream may be out of step; the next put reconnects
                raise

    async def _connect(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _put(self, put: PutRequest, payloads: Sequence[memoryview]) -> PutReply:
        loop = asyncio.get_running_loop()
        if self._sock is None:
            self._sock = await self._connect()
        sock = self._sock
        await loop.sock_sendall(sock, encode_put_header(put))
        for part in payloads:
            if part.nbytes:
                await loop.sock_sendall(sock, part.cast("B") if part.format != "B" else part)
        prefix = bytearray(FRAME_HEADER.size)
        await recv_exactly(sock, memoryview(prefix))
        (header_nbytes,) = FRAME_HEADER.unpack(prefix)
        if not 0 < header_nbytes <= _MAX_REPLY_HEADER_BYTES:
            raise StoreWireError(f"reply header of {header_nbytes} bytes")
        raw = bytearray(header_nbytes)
        await recv_exactly(sock, memoryview(raw))
        return decode_reply(decode_header(bytes(raw)))

    async def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def staging_nbytes(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> int:
    """Bytes of ``num_blocks`` blocks of one group in the ``gather_blocks`` staging layout."""
    return num_blocks * sum(int(c[0].numel()) * c.element_size() for c in kv_caches)


def snapshot_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor
) -> None:
    """Copy blocks ``block_ids`` of one group's layers into ``out`` (mutated), a uint8 CPU
    tensor of ``staging_nbytes(kv_caches, len(block_ids))`` bytes, in the ``gather_blocks``
    staging layout ``[num_layers, n, 2, block_size, num_kv_heads, head_size]``. Device caches
    are gathered on the device and copied to host once."""
    first = kv_caches[0]
    shape = (len(kv_caches), len(block_ids), *first.shape[1:])
    staging = out.view(first.dtype).view(shape)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=first.device)
    if first.device.type == "cpu":
        gather_blocks(kv_caches, ids, staging)
    else:
        staging.copy_(gather_blocks(kv_caches, ids))


class _StagingPool:
    """Reusable host buffers (uint8 tensors) for snapshots, taken on the engine thread and given
    back on the loop thread once the store replied. A fresh 32 MiB tensor costs about ten times
    its gather in first-touch page faults (``benchmarks/bench_store.py``), so buffers are kept:
    at most ``max_idle_bytes`` of them wait unused."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 ``[>= nbytes]`` CPU buffer: the smallest idle one that fits, else a new one."""
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fits:
                buffer = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
                self._idle_bytes -= buffer.numel()
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._idle_bytes + buffer.numel() <= self.max_idle_bytes:
                self._idle.append(buffer)
                self._idle_bytes += buffer.numel()


class _Candidate(NamedTuple):
    group_id: int
    block_hash: bytes
    parent_hash: bytes
    block_id: int


class Offloader:
    """Writes a node's cold (or all) cached blocks to a store. See the module docstring.

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
        if policy not in ("evict", "write_through"):
            raise ValueError(f"policy must be 'evict' or 'write_through', got {policy!r}")
        if blocks_per_step < 1 or scan_blocks < 1 or max_inflight_bytes < 1:
            raise ValueError("blocks_per_step, scan_blocks and max_inflight_bytes must be >= 1")
        self.policy = policy
        self.blocks_per_step = blocks_per_step
        self.scan_blocks = scan_blocks
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = stats
        self.writer = StoreWriter(*store_address)
        self._kv_caches_by_group: list[list[torch.Tensor]] | None = None
        self._compat_hash = ""
        # (group_id, hash) -> parent hash (b"": first block), for every cached block on the node
        self._parent_of: dict[tuple[int, bytes], bytes] = {}
        self._write_through: deque[tuple[int, bytes, int]] = deque()
        # (group_id, hash) handed to the store (or in flight); bounded, oldest forgotten first
        self._offloaded: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        self._lock = threading.Lock()  # _offloaded and _inflight_bytes: engine and loop threads
        self._inflight_bytes = 0
        self._futures: set[Future[None]] = set()
        self._staging_pool = _StagingPool(max_inflight_bytes)

    def bind(self, kv_caches_by_group: Sequence[Sequence[torch.Tensor]], compat_hash: str) -> None:
        """Give the offloader the node's KV tensors (worker half, ``register_kv_caches``) and its
        ``NodeMetadata.compat_hash`` (the store refuses another layout)."""
        self._kv_caches_by_group = [list(g) for g in kv_caches_by_group]
        self._compat_hash = compat_hash

    def observe(self, events: Iterable[Any]) -> None:
        """Learn parents (and write-through candidates) from the pool's KV events, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                parent = bytes(event.parent_block_hash or b"")
                for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                    block_hash = bytes(block_hash)
                    self._parent_of[(event.group_id, block_hash)] = parent
                    if self.policy == "write_through":
                        self._write_through.append((event.group_id, block_hash, block_id))
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._parent_of.pop((event.group_id, bytes(block_hash)), None)
            elif isinstance(event, AllBlocksCleared):
                self._parent_of.clear()
                self._write_through.clear()

    # ------------------------------------------------------------------ engine thread
    def on_step(self, block_pool: BlockPool) -> int:
        """Snapshot this step's blocks and start sending them. Returns the number of blocks
        handed to the loop thread (mutates nothing in the pool)."""
        if self._kv_caches_by_group is None:
            return 0
        candidates = self._pick(block_pool)
        if not candidates:
            return 0
        with self._lock:
            if self._inflight_bytes >= self.max_inflight_bytes:
                self.stats.add("num_offload_skipped_blocks", len(candidates))
                return 0
        by_group: dict[int, list[_Candidate]] = {}
        for candidate in candidates:
            by_group.setdefault(candidate.group_id, []).append(candidate)
        groups: list[PutGroup] = []
        for group_id, members in sorted(by_group.items()):
            caches = self._kv_caches_by_group[group_id]
            nbytes = staging_nbytes(caches, len(members))
            groups.append(
                PutGroup(
                    group_id=group_id,
                    block_hashes=tuple(c.block_hash for c in members),
                    parent_hashes=tuple(c.parent_hash for c in members),
                    nbytes=nbytes,
                )
            )
        put = PutRequest(compat_hash=self._compat_hash, groups=tuple(groups))
        buffer = self._staging_pool.take(put.payload_nbytes)
        offset = 0
        for group in groups:
            caches = self._kv_caches_by_group[group.group_id]
            ids = [c.block_id for c in by_group[group.group_id]]
            snapshot_blocks(caches, ids, buffer[offset : offset + group.nbytes])
            offset += group.nbytes
        keys = [(c.group_id, c.block_hash) for c in candidates]
        with self._lock:
            self._inflight_bytes += put.payload_nbytes
            for key in keys:
                self._offloaded[key] = None
            while len(self._offloaded) > _MAX_REMEMBERED:
                self._offloaded.popitem(last=False)
        future = get_loop_thread().submit(self._send(put, buffer, keys))
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return len(candidates)

    def _pick(self, block_pool: BlockPool) -> list[_Candidate]:
        picked: list[_Candidate] = []
        seen: set[tuple[int, bytes]] = set()

        def consider(group_id: int, block_hash: bytes, block_id: int) -> None:
            key = (group_id, block_hash)
            parent = self._parent_of.get(key)
            if parent is None or key in seen or key in self._offloaded:
                return
            seen.add(key)
            picked.append(_Candidate(group_id, block_hash, parent, block_id))

        while self._write_through and len(picked) < self.blocks_per_step:
            group_id, block_hash, block_id = self._write_through.popleft()
            block = block_pool.blocks[block_id]
            if block.block_hash == make_block_hash_with_group_id(block_hash, group_id):
                consider(group_id, block_hash, block_id)
        queue = block_pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        num_scanned = 0
        while (
            block is not None
            and block is not tail
            and num_scanned < self.scan_blocks
            and len(picked) < self.blocks_per_step
        ):
            key_with_group = block.block_hash
            if key_with_group is not None:
                group_id = get_group_id(key_with_group)
                consider(group_id, get_block_hash(key_with_group), block.block_id)
            block = block.next_free_block
            num_scanned += 1
        return picked

    # ------------------------------------------------------------------ loop thread
    async def _send(
        self, put: PutRequest, buffer: torch.Tensor, keys: list[tuple[int, bytes]]
    ) -> None:
        try:
            view = memoryview(buffer[: put.payload_nbytes].numpy())
            reply = await self.writer.put(put, [view])
        except (TimeoutError, StoreWireError, OSError, EOFError) as exc:
            logger.warning("offload of %d block(s) failed: %s", len(keys), exc)
            self.stats.add("num_offload_failures")
            self._forget(keys)
            return
        finally:
            with self._lock:
                self._inflight_bytes -= put.payload_nbytes
            self._staging_pool.give(buffer)  # the socket no longer reads it
        self._forget(list(reply.refused))
        num_held = reply.num_stored + reply.num_present
        self.stats.add("num_offloaded_blocks", num_held)
        self.stats.add("bytes_offloaded", put.payload_nbytes * num_held // max(len(keys), 1))
        self.stats.add("num_offload_refused_blocks", reply.num_refused)

    def _forget(self, keys: Iterable[tuple[int, bytes]]) -> None:
        with self._lock:
            for key in keys:
                self._offloaded.pop(key, None)

    # ------------------------------------------------------------------ any thread
    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Block until every started send settled (tests, shutdown)."""
        for future in list(self._futures):
            with contextlib.suppress(Exception):  # already logged and counted by _send
                future.result(timeout_s)

    def close(self) -> None:
        self.wait_idle(5.0)
        try:
            get_loop_thread().run(self.writer.close(), 5.0)
        except Exception:  # shutting down: never raise
            logger.exception("closing the store writer failed")


class OffloadPlanner:  # TEMP shim until the store split lands
    @classmethod
    def from_config(cls, config):
        if config.offload == "off":
            return None
        raise RuntimeError("temp")


class OffloadSender:  # TEMP shim
    @classmethod
    def from_config(cls, config, stats):
        if config.offload == "off":
            return None
        raise RuntimeError("temp")
