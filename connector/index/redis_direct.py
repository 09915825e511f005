"""The lookups' short path to Redis: one pre-packed ``EVALSHA`` on a pooled connection.

A lookup is one script call with a handful of small arguments and one large one (the prompt's
lookup keys, 5 KB for 625 blocks). redis-py's generic ``execute_command`` adds per call its
packer, the retry wrapper, observability records, response callbacks, and on a cluster the
slot of the routing key and its redirect loop: on these hosts about 19 us of client time for
a lookup (single server), nearly the script's own server time (``benchmarks/bench_index.py``;
README, "Benchmarks"). Here the call
is packed into one RESP buffer (the script's name and route packed once per key prefix:
``ScriptHead``), sent on a connection taken from the pool of the server that owns the key
prefix and released to it (the connection the client's own commands use), and its reply read
with the client's parser.

Only the plain case takes this path: ``send`` raises what redis-py raises (``NoScriptError``,
``MovedError``, ``AskError``, ``ConnectionError``, ``TimeoutError``, ``ResponseError``, ...);
``RedisBlockIndex._call_direct`` sends a script the server does not know as ``EVAL``, leaves
redirects to the generic path (which follows them and refreshes a cluster's slot map), and takes
socket trouble as the generic path does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from redis.connection import ConnectionPool

__all__ = ["LEFT_TO_GENERIC_PATH", "ScriptHead", "send"]

# What a caller of ``send`` leaves to redis-py's generic path, at once: replies that path acts on
# (a cluster's redirects, a slot in migration, a cluster that is down) and a slot whose owner the
# client's slot map does not know (that path refreshes the map). A script the server does not
# know (``NoScriptError``) is sent as EVAL. Socket trouble and timeouts are not sent again: a
# second try would double the wait, and ``interrupt`` (closing the pool's connections) must end a
# call in flight.
LEFT_TO_GENERIC_PATH = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.RedisClusterException,
)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


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

    def pack(self, args: Iterable[bytes | str | int]) -> bytes:
        """The whole command, the head followed by ``args``, as one buffer. Arguments are
        written as redis-py writes them: bytes as they are, text as UTF-8, integers in decimal
        (nothing else is used here: anything else, bools and floats too, raises TypeError)."""
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
        parts[0] = b"*%d\r\n" % (self._num_head_args + (len(parts) - 2) // 3)
        return b"".join(parts)


def send(pool: ConnectionPool, packed: bytes) -> Any:
    """One exchange: ``packed`` on a connection from ``pool``, the reply as the client's parser
    reads it (bytes responses; an error reply raised as redis-py's exception for it). The
    connection goes back to the pool whatever happens (redis-py has already disconnected it after
    a socket error or timeout, so that no half-read reply is left on it)."""
    conn = pool.get_connection()
    try:
        conn.send_packed_command((packed,))
        return conn.read_response()
    finally:
        pool.release(conn)
