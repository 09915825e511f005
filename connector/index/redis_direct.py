"""The lookups' and publishes' short path to Redis: one pre-packed ``EVALSHA`` on a connection
the thread holds.

A lookup is one script call with a handful of small arguments and one large one (the prompt's
lookup keys, 5 KB for 625 blocks). redis-py's generic ``execute_command`` adds per call its
packer, the retry wrapper, observability records, response callbacks, and on a cluster the
slot of the routing key and its redirect loop: client time for a lookup (single server) close
to the script's own server time. Taking a connection from the pool and giving it back costs
more again (the pool's lock, its observability records and a poll for unread data;
``benchmarks/bench_index.py``; docs/architecture.md, "Design measurements"). So
the call is packed into one RESP buffer (the script's name and route packed once per key prefix:
``ScriptHead``) and sent on a connection of the pool of the server that owns the key prefix that
the calling thread took once and keeps (``HeldConnections``), its reply read with the client's
parser.

Only the plain case takes this path: ``HeldConnections.send`` raises what redis-py raises
(``NoScriptError``, ``MovedError``, ``AskError``, ``ConnectionError``, ``TimeoutError``,
``ResponseError``, ...); ``RedisBlockIndex._call_direct`` sends a script the server does not know
as ``EVAL``, leaves redirects to the generic path (which follows them and refreshes a cluster's
slot map), and takes socket trouble as the generic path does.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import redis
from redis.connection import Connection, ConnectionPool

__all__ = ["LEFT_TO_GENERIC_PATH", "HeldConnections", "PackedArgs", "ScriptHead"]

# What a caller of ``HeldConnections.send`` leaves to redis-py's generic path, at once: replies
# that path acts on (a cluster's redirects, a slot in migration, a cluster that is down) and a
# slot whose owner the client's slot map does not know (that path refreshes the map). A script
# the server does not know (``NoScriptError``) is sent as EVAL. Socket trouble and timeouts are
# not sent again: a second try would double the wait, and ``interrupt`` (closing the pool's
# connections) must end a call in flight.
LEFT_TO_GENERIC_PATH = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.RedisClusterException,
)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class PackedArgs(NamedTuple):
    """``count`` script arguments already written as RESP bulk strings (``resp``), by a
    producer that packs a long run of small ones in one pass (the publishes' ops:
    ``redis_publish.pack_ops``). ``ScriptHead.pack`` splices them in as they are."""

    resp: bytes
    count: int

    def unpacked(self) -> list[bytes]:
        """The arguments as bytes again, for redis-py's generic path (which packs its own).

        Raises:
            ValueError: ``resp`` is not ``count`` whole bulk strings.
        """
        args: list[bytes] = []
        resp, at = self.resp, 0
        while at < len(resp):
            if resp[at:at + 1] != b"$":
                raise ValueError(f"packed arguments: no bulk string at byte {at}")
            end = resp.index(b"\r\n", at)
            start = end + 2
            stop = start + int(resp[at + 1:end])
            if resp[stop:stop + 2] != b"\r\n":
                raise ValueError(f"packed arguments: bulk string at byte {at} is cut short")
            args.append(resp[start:stop])
            at = stop + 2
        if len(args) != self.count:
            raise ValueError(f"packed arguments: {len(args)} bulk strings, {self.count} said")
        return args


class ScriptHead:
    """The RESP start of ``EVALSHA sha numkeys [route key] ...`` for one script and one route
    (``route``: the key the call is routed by, ``None`` on a single server), packed once."""

    __slots__ = ("_head", "_num_head_args")

    def __init__(self, sha: str, route: str | None) -> None:
        args = [b"EVALSHA", sha.encode(), b"0" if route is None else b"1"]
        if route is not None:
            args.append(route.encode())
        self._head = b"".join(map(_bulk, args))
        self._num_head_args = len(args)

    def pack(self, args: Iterable[bytes | str | int], packed: PackedArgs | None = None) -> bytes:
        """The whole command, the head followed by ``args`` and then ``packed``, as one buffer.
        Arguments are written as redis-py writes them: bytes as they are, text as UTF-8,
        integers in decimal (nothing else is used here: anything else, bools and floats too,
        raises TypeError)."""
        parts = [b"", self._head]
        for arg in args:
            if type(arg) is not bytes:
                if isinstance(arg, str):
                    arg = arg.encode()
                elif isinstance(arg, int) and not isinstance(arg, bool):
                    arg = b"%d" % arg
                else:
                    raise TypeError(f"a script argument must be bytes, str or int, not {arg!r}")
            parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
        num_args = self._num_head_args + (len(parts) - 2) // 3
        if packed is not None:
            parts.append(packed.resp)
            num_args += packed.count
        parts[0] = b"*%d\r\n" % num_args
        return b"".join(parts)


class _Held(NamedTuple):
    connection: Connection
    # False where the server may push unasked (client-side caching, maintenance notifications):
    # then, as in the pool, only a closed connection is replaced.
    data_is_stale: bool
    # The connection's reconnect mark (redis-py >= 7: a cluster node that moved); None before.
    should_reconnect: Callable[[], bool] | None


class _ThreadHeld:
    """One thread's held connections by pool; handed back to their pools when the thread ends
    (its ``threading.local`` storage, and so this object, is dropped then)."""

    __slots__ = ("by_pool",)

    def __init__(self) -> None:
        self.by_pool: weakref.WeakKeyDictionary[ConnectionPool, _Held] = (
            weakref.WeakKeyDictionary()
        )

    def __del__(self) -> None:
        for pool, held in list(self.by_pool.items()):
            if held.connection.pid == os.getpid():
                with contextlib.suppress(Exception):  # a pool torn down at interpreter exit
                    pool.release(held.connection)


def _take(pool: ConnectionPool) -> _Held:
    # The pool's own rule for unread data on a connection it hands out (redis-py 5 to 8).
    maint = getattr(pool, "maint_notifications_enabled", None)
    pushes = getattr(pool, "cache", None) is not None or bool(maint and maint())
    connection = pool.get_connection()
    return _Held(connection, not pushes, getattr(connection, "should_reconnect", None))


class HeldConnections:
    """The lookups' connections: per calling thread, one connection of each pool that thread
    sends to, taken from the pool at its first send there and kept.

    Before each send the connection gets the check the pool gives one it hands out: unread data
    or a connection the server closed (idle timeout, restart, ``CLIENT KILL``) means a new
    connection, not a failed call. A held connection stays the pool's (counted in use), so
    ``pool.disconnect()`` (the index's ``interrupt`` and ``close``, from any thread) closes it,
    which ends a call in flight; the owning thread's next send connects again. redis-py
    disconnects a connection on a socket error, a timeout or an interrupted read, so no half-read
    reply is left on it. It goes back to its pool when its thread ends; in a forked child the
    parent's connection is never used (the pool starts afresh there). Each thread that looks up
    keeps one connection of each pool it sent to (a pool with ``max_connections`` has that many
    fewer for other commands).
    Thread: any; each thread uses only its own connections, so no lock is taken.
    """

    __slots__ = ("_local",)

    def __init__(self) -> None:
        self._local = threading.local()

    def send(self, pool: ConnectionPool, packed: bytes) -> Any:
        """One exchange: ``packed`` on this thread's connection of ``pool``, the reply as the
        client's parser reads it (bytes responses; an error reply raised as redis-py's
        exception for it). Raises what redis-py raises for the call and for a new connection."""
        mine = getattr(self._local, "held", None)
        if mine is None:
            mine = self._local.held = _ThreadHeld()
        held = mine.by_pool.get(pool)
        if held is None or held.connection.pid != os.getpid():
            held = mine.by_pool[pool] = _take(pool)  # checked by the pool
        else:
            # The pool's order: a connection marked for reconnect (redis-py >= 7: a cluster
            # node that moved) is closed as the pool closes one given back; connect (a no-op
            # when connected; a failure raises, one wait); then unread data or a close by the
            # server means a new connection.
            if held.should_reconnect is not None and held.should_reconnect():
                held.connection.disconnect()
            held.connection.connect()
            try:
                stale = held.connection.can_read() and held.data_is_stale
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                stale = True  # closed by the server
            if stale:
                held.connection.disconnect()  # the send below connects again
        conn = held.connection
        conn.send_packed_command((packed,))
        return conn.read_response()
