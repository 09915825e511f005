"""The ``index_url`` syntax: ``"memory"``, ``redis://`` / ``rediss://`` / ``unix://`` (redis-py's
URLs) and ``redis-cluster://`` seed lists. Host and port go through ``kvbridge.transport.address``
(an IPv6 address in brackets: ``redis://[::1]:6379/0``, ``redis-cluster://[::1]:7000,[::1]:7001``).
Standard library only, so that configuration checks a URL at start without connecting; no message
here repeats a password (``redact_url``).
"""

from __future__ import annotations

from urllib.parse import parse_qs

from kvbridge.transport.address import HostPort, split_host_port

__all__ = [
    "CLUSTER_SCHEME",
    "DEFAULT_NUM_BUCKETS",
    "REDIS_SCHEMES",
    "check_index_url",
    "parse_cluster_url",
    "redact_url",
    "redis_url_address",
]

CLUSTER_SCHEME = "redis-cluster://"
REDIS_SCHEMES = ("redis://", "rediss://")
DEFAULT_NUM_BUCKETS = 32
_MAX_BUCKETS = 1024
_REDIS_PORT = 6379
_FORMS = (
    "'memory', 'redis://host[:port]/db', 'redis://[ipv6][:port]/db' (or rediss://), "
    "'unix:///path' or 'redis-cluster://host:port[,host:port...]'"
)


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not (sep and at and ":" in userinfo):
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


def redis_url_address(url: str) -> HostPort:
    """The server of a ``redis://`` or ``rediss://`` URL (port 6379 where it names none), read
    as redis-py reads it (the user and password before ``@`` are skipped).

    Raises:
        ValueError: one line with the expected form, the URL (password redacted) and why.
    """
    rest = url.partition("://")[2]
    netloc = rest.partition("/")[0].partition("?")[0].partition("#")[0]
    try:
        return split_host_port(netloc.rpartition("@")[2], default_port=_REDIS_PORT)
    except ValueError as exc:
        raise ValueError(
            "index_url must be 'redis://host[:port]/db' or 'redis://[ipv6][:port]/db', "
            f"got {redact_url(url)!r} ({exc})"
        ) from None


def parse_cluster_url(url: str) -> tuple[list[HostPort], int]:
    """Seed nodes and bucket count of ``redis-cluster://HOST:PORT[,HOST:PORT...][?buckets=N]``
    (``[ipv6]:port`` for an IPv6 seed; N in [1, 1024], default 32).

    Raises:
        ValueError: one line naming what is wrong.
    """
    if not url.startswith(CLUSTER_SCHEME):
        raise ValueError(f"a cluster index_url starts with {CLUSTER_SCHEME!r}, got {url!r}")
    rest, _, query = url[len(CLUSTER_SCHEME):].partition("?")
    netloc = rest.partition("/")[0]
    seeds: list[HostPort] = []
    for item in netloc.split(","):
        try:
            if "@" in item:
                raise ValueError("a cluster index_url takes no user or password")
            seeds.append(split_host_port(item))
        except ValueError as exc:
            raise ValueError(
                f"index_url must be 'redis-cluster://HOST:PORT[,HOST:PORT...]' ('[IPV6]:PORT' "
                f"for IPv6), got {redact_url(url)!r} (seed {item.rpartition('@')[2]!r}: {exc})"
            ) from None
    num_buckets = DEFAULT_NUM_BUCKETS
    values = parse_qs(query).get("buckets")
    if values:
        value = values[-1]
        if not value.isdigit() or not 1 <= int(value) <= _MAX_BUCKETS:
            raise ValueError(f"index_url buckets must be in [1, {_MAX_BUCKETS}], got {value!r}")
        num_buckets = int(value)
    return seeds, num_buckets


def check_index_url(url: str) -> None:
    """Refuse an ``index_url`` that cannot name an index, before anything connects. Pure.

    Raises:
        ValueError: one line with the accepted forms and the URL (password redacted).
    """
    if not isinstance(url, str):
        raise ValueError(f"index_url must be {_FORMS}, got {url!r}")
    if url == "memory":
        return
    if url.startswith(CLUSTER_SCHEME):
        parse_cluster_url(url)
    elif url.startswith(REDIS_SCHEMES):
        redis_url_address(url)
    elif not (url.startswith("unix://") and len(url) > len("unix://")):
        raise ValueError(f"index_url must be {_FORMS}, got {redact_url(url)!r}")
