"""Where each node's transport listens, so a request can pull from a holder the index names.

The block index says *which* node holds a prefix (node id + incarnation); the directory says
*where* to reach it (host, port). Entries expire unless re-announced (the same TTL rhythm as the
index's node heartbeats), so a stopped node disappears from both.

Two backends with one contract: ``InMemoryNodeDirectory`` (one process) and
``RedisNodeDirectory`` (one ``SET key value EX ttl`` per announce, one ``GET`` per lookup; Redis
trouble answers None, never raises, and is logged once per outage by the ``Reachability`` it
shares with the index on the same server).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import msgpack
import redis
from kvbridge.transport.address import check_host

from .reachability import Reachability

__all__ = [
    "InMemoryNodeDirectory",
    "NodeAddress",
    "NodeDirectory",
    "RedisNodeDirectory",
    "decode_address",
    "encode_address",
]

logger = logging.getLogger(__name__)


class NodeAddress(NamedTuple):
    """A node's transport address and the incarnation listening there. ``host`` is bare, an
    IPv6 address without brackets (``"::1"``; ``kvbridge.transport.address``)."""

    host: str
    port: int
    incarnation: int


def _checked(address: NodeAddress) -> NodeAddress:
    """``address`` when its fields are a host, a port in [1, 65535] and an int; else
    ValueError naming the field."""
    host, port, incarnation = address
    check_host(host, what="node address host")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"node address port must be in [1, 65535], got {port!r}")
    if isinstance(incarnation, bool) or not isinstance(incarnation, int):
        raise ValueError(f"node address incarnation must be an int, got {incarnation!r}")
    return address


def encode_address(address: NodeAddress) -> bytes:
    """The stored form of ``address``: msgpack ``[host, port, incarnation]``, host bare.
    Raises ValueError for a field that is not an address (a caller mistake)."""
    return msgpack.packb(list(_checked(address)))


def decode_address(raw: bytes) -> NodeAddress:
    """``encode_address`` read back. Raises ValueError for bytes that are not one (a garbage
    entry: not msgpack, wrong fields, a bracketed or malformed host, a port out of range)."""
    try:
        fields = msgpack.unpackb(raw)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(fields, list) or len(fields) != 3:
        raise ValueError(f"expected [host, port, incarnation], got {fields!r}")
    return _checked(NodeAddress(*fields))


class NodeDirectory(Protocol):
    def announce(self, node_id: str, address: NodeAddress, *, ttl_s: float) -> None:
        """Publish (or refresh) ``node_id``'s address for ``ttl_s`` seconds."""
        ...

    def lookup(self, node_id: str) -> NodeAddress | None:
        """The node's live address, or None (unknown, expired, or backend trouble)."""
        ...

    def withdraw(self, node_id: str) -> None:
        """Remove the node's entry (clean shutdown)."""
        ...

    def interrupt(self) -> None:
        """Make calls in flight on other threads return at once (as backend trouble: logged,
        answered None); later calls reconnect. Safe from any thread; for prompt shutdown."""
        ...


class InMemoryNodeDirectory:
    """Process-local directory; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, tuple[NodeAddress, float]] = {}
        self._lock = threading.Lock()

    def announce(self, node_id: str, address: NodeAddress, *, ttl_s: float) -> None:
        _checked(address)
        with self._lock:
            self._entries[node_id] = (address, self._clock() + ttl_s)

    def lookup(self, node_id: str) -> NodeAddress | None:
        with self._lock:
            entry = self._entries.get(node_id)
            if entry is None or entry[1] <= self._clock():
                return None
            return entry[0]

    def withdraw(self, node_id: str) -> None:
        with self._lock:
            self._entries.pop(node_id, None)

    def interrupt(self) -> None:
        return None  # calls never block


class RedisNodeDirectory:
    """Directory in Redis under ``<key_prefix>:addr:<node_id>``.

    Args:
        client: a redis-py client (its socket timeouts bound every call).
        key_prefix: the index namespace's key prefix (the nodes' block identity).
        reachability: the server's up/down state and log lines, shared with the index on it
            (``client.open_index``); default: one of its own, named by the client's address.
    """

    def __init__(self, client: redis.Redis, key_prefix: str,
                 reachability: Reachability | None = None) -> None:
        self._client = client
        self._prefix = f"{key_prefix}:addr:"
        if reachability is None:
            kwargs = client.connection_pool.connection_kwargs
            where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
            reachability = Reachability(f"the Redis at {where}")
        self.reachability = reachability

    def _call(self, *command: object) -> object:
        """One command; None (the trouble reported to ``reachability``) if Redis fails."""
        try:
            reply = self._client.execute_command(*command)
        except redis.ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                self.reachability.failed("directory", exc)
                return None
            # A key of another type under the directory's prefix (not kvbridge's): garbage,
            # not a server down (the index keeps answering).
            logger.warning("node directory: %s holds a key of another type; skipped",
                           command[1])
            return None
        except redis.RedisError as exc:
            self.reachability.failed("directory", exc)
            return None
        self.reachability.answered("directory")
        return reply

    def announce(self, node_id: str, address: NodeAddress, *, ttl_s: float) -> None:
        self._call("SET", self._prefix + node_id, encode_address(address),
                   "PX", max(int(ttl_s * 1000), 1))

    def lookup(self, node_id: str) -> NodeAddress | None:
        raw = self._call("GET", self._prefix + node_id)
        if raw is None:
            return None
        try:
            return decode_address(raw)
        except ValueError as exc:
            logger.warning("node directory: garbage entry for %s skipped: %s", node_id, exc)
            return None

    def withdraw(self, node_id: str) -> None:
        self._call("DEL", self._prefix + node_id)

    def interrupt(self) -> None:
        self._client.connection_pool.disconnect()
