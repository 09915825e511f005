"""A node's link to the cross-node block index (issue 6, part 4; DESIGN.md, "Block index").

``IndexClient`` publishes the node's ``BlockPool`` events in batches, keeps the node alive in the
index and the node directory with heartbeats from a daemon thread, and answers the connector's
question "which node holds the longest prefix of these block hashes, and where do I pull it?".

Everything it learns is advisory: the holder re-checks each block's hash when it serves it, so a
stale entry costs a recompute, never wrong output. Backend trouble never raises out of here: the
index answers "no hit" (counted) and the request falls back to local prefix caching.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import redis

from .in_memory import InMemoryBlockIndex
from .node_directory import (
    InMemoryNodeDirectory,
    NodeAddress,
    NodeDirectory,
    RedisNodeDirectory,
)
from .protocol import BlockIndex, Holder, IndexNamespace, Tier
from .redis_index import RedisBlockIndex

__all__ = ["IndexClient", "RemotePrefix", "open_index"]

logger = logging.getLogger(__name__)

_SOCKET_TIMEOUT_S = 0.25


class RemotePrefix(NamedTuple):
    """A pullable prefix: ``num_blocks`` blocks from block 0, held by ``holder`` at ``address``
    in blocks ``block_ids[group][i]``."""

    holder: Holder
    address: NodeAddress
    num_blocks: int
    block_ids: list[list[int]]


class _Locked:
    """Serialises every method call of a shared in-process backend (several nodes' threads)."""

    def __init__(self, target: Any, lock: threading.Lock) -> None:
        self._target = target
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return locked


_memory_backends: dict[str, tuple[Any, Any]] = {}
_memory_lock = threading.Lock()


def open_index(url: str, namespace: IndexNamespace) -> tuple[BlockIndex, NodeDirectory]:
    """The index and node directory behind ``url``.

    ``"memory"``: the embedded in-process backend, shared by every node of this process in the
    same namespace. ``"redis://host:port/db"``: a Redis server. Raises ValueError for another
    scheme.
    """
    if url == "memory":
        with _memory_lock:
            key = namespace.key_prefix
            if key not in _memory_backends:
                lock = threading.Lock()
                _memory_backends[key] = (
                    _Locked(InMemoryBlockIndex(namespace), lock),
                    InMemoryNodeDirectory(),
                )
            return _memory_backends[key]
    if url.startswith(("redis://", "rediss://", "unix://")):
        client = redis.Redis.from_url(
            url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=_SOCKET_TIMEOUT_S
        )
        index = RedisBlockIndex(namespace, url)
        return index, RedisNodeDirectory(client, namespace.key_prefix)
    raise ValueError(f"index_url must be 'memory' or a redis:// URL, got {url!r}")


class IndexClient:
    """One node's use of the index.

    Args:
        index, directory: from ``open_index``.
        node_id: the node's engine id (no ``:`` or whitespace).
        incarnation: this start's incarnation (the transport advertises the same number).
        group_ids: the KV cache groups a prefix must be held in.
        ttl_s: the node's entries and address expire this long after the last heartbeat.
        tier: the tier this node's blocks are published as (``"store"`` for a store node).
    """

    def __init__(
        self,
        index: BlockIndex,
        directory: NodeDirectory,
        *,
        node_id: str,
        incarnation: int,
        group_ids: Sequence[int],
        ttl_s: float,
        tier: Tier = "device",
    ) -> None:
        self.index = index
        self.directory = directory
        self.node_id = node_id
        self.incarnation = incarnation
        self.group_ids = tuple(group_ids)
        self.ttl_s = ttl_s
        self.tier: Tier = tier
        self._address: NodeAddress | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_reregistrations = 0

    # ------------------------------------------------------------------ life
    def start(self, host: str, port: int) -> None:
        """Register the node, announce its address, start heart-beating."""
        self._address = NodeAddress(host, port, self.incarnation)
        self._register()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"kvbridge-index-{self.node_id}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop heart-beating and withdraw the address (entries expire with the TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.directory.withdraw(self.node_id)

    def _register(self) -> None:
        status = self.index.register_node(self.node_id, self.incarnation, ttl_s=self.ttl_s)
        if status != "ok":
            logger.warning("index: register of %s answered %s", self.node_id, status)
        if self._address is not None:
            self.directory.announce(self.node_id, self._address, ttl_s=self.ttl_s)

    def _heartbeat_loop(self) -> None:
        interval = self.ttl_s / 3
        while not self._stop.wait(interval):
            status = self.index.heartbeat(self.node_id, self.incarnation, ttl_s=self.ttl_s)
            if status == "fenced":
                # Expired (a long pause, or Redis restarted): register again, entries empty.
                self.num_reregistrations += 1
                self._register()
            elif self._address is not None:
                self.directory.announce(self.node_id, self._address, ttl_s=self.ttl_s)

    # ------------------------------------------------------------------ use
    def publish(self, events: Iterable[Any]) -> None:
        """Apply a batch of ``BlockPool`` events to this node's entries (one round trip)."""
        events = list(events)
        if not events:
            return
        result = self.index.publish(self.node_id, self.incarnation, events, default_tier=self.tier)
        if result.status == "fenced":
            # Our registration lapsed (a long pause, or Redis lost its data): register again
            # and apply the batch once more; blocks stored before the lapse stay unlisted.
            logger.warning("index: publish of %s fenced; registering again", self.node_id)
            self.num_reregistrations += 1
            self._register()
            self.index.publish(self.node_id, self.incarnation, events, default_tier=self.tier)

    def find_remote_prefix(
        self,
        block_hashes: Sequence[bytes],
        *,
        num_local_blocks: int,
        min_gain_blocks: int,
        choose: Callable[[Sequence[Holder]], Sequence[Holder]] = lambda holders: holders,
    ) -> RemotePrefix | None:
        """The longest prefix of ``block_hashes`` held on another node, if it beats the local
        hit by at least ``min_gain_blocks`` blocks and its holder is reachable; else None.

        Costs one index round trip, plus one directory and one block-id round trip on a hit.
        """
        if len(block_hashes) < num_local_blocks + min_gain_blocks:
            return None
        hit = self.index.longest_prefix(
            block_hashes, self.group_ids, exclude_node_ids=(self.node_id,)
        )
        if hit.num_blocks - num_local_blocks < min_gain_blocks:
            return None
        for holder in choose(hit.holders):
            address = self.directory.lookup(holder.node_id)
            if address is None or address.incarnation != holder.incarnation:
                continue  # gone, or restarted since it published these entries
            block_ids = self.index.get_block_ids(
                holder.node_id,
                holder.incarnation,
                block_hashes[: holder.num_blocks],
                self.group_ids,
            )
            if block_ids is not None:
                return RemotePrefix(holder, address, holder.num_blocks, block_ids)
        return None


class _TempLookup(NamedTuple):  # TEMP shim until the async client lands
    pending: bool
    prefix: RemotePrefix | None


def _start_lookup(self, key, hashes, *, num_local_blocks, min_gain_blocks):
    self._temp = getattr(self, "_temp", {})
    self._temp[key] = self.find_remote_prefix(hashes, num_local_blocks=num_local_blocks, min_gain_blocks=min_gain_blocks)


def _poll_lookup(self, key):
    return _TempLookup(False, self._temp.pop(key, None))


def _cancel_lookup(self, key):
    getattr(self, "_temp", {}).pop(key, None)


IndexClient.start_lookup = _start_lookup
IndexClient.poll_lookup = _poll_lookup
IndexClient.cancel_lookup = _cancel_lookup
_orig_init = IndexClient.__init__
def _init(self, *a, lookup_timeout_s=0.5, **k):
    _orig_init(self, *a, **k)
IndexClient.__init__ = _init
