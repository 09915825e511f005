"""IPv6 loopback for the tests that run something over ``[::1]``: whether this host has it,
found out at run time by listening on ``::1`` and connecting to it (a container without IPv6,
or with ``net.ipv6.conf.lo.disable_ipv6=1``, has none), and a skip that says so."""

from __future__ import annotations

import functools
import socket

import pytest


@functools.cache
def ipv6_loopback_problem() -> str | None:
    """Why a TCP connection over ``::1`` cannot be made here, or None when it can."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as listener:
            listener.bind(("::1", 0))
            listener.listen(1)
            with socket.create_connection(listener.getsockname()[:2], timeout=2.0):
                pass
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def require_ipv6_loopback() -> None:
    """Skip the calling test where this host has no IPv6 loopback, naming why."""
    problem = ipv6_loopback_problem()
    if problem is not None:
        pytest.skip(f"IPv6 loopback (::1) is unavailable on this host: {problem}")
