"""The store tier's address syntax: ``store_url`` is ``"host:port"`` of a store's write server,
``"[ipv6]:port"`` for an IPv6 address (``kvbridge.transport.address``, the one parser of
``host:port``).

Standard library only, so that configuration can check a URL without importing the store tier.
"""

from __future__ import annotations

from kvbridge.transport.address import HostPort, format_host_port, parse_host_port

__all__ = ["format_store_url", "parse_store_url"]


def parse_store_url(url: str) -> HostPort:
    """``"host:port"`` or ``"[ipv6]:port"`` -> ``HostPort`` (host bare, port in [1, 65535]).

    Raises:
        ValueError: one line with the expected form, e.g. ``store_url must be 'host:port' or
            '[ipv6]:port', got '::1:7600' (an IPv6 address takes brackets, ...)``.
    """
    return parse_host_port(url, what="store_url")


def format_store_url(host: str, port: int) -> str:
    """The ``store_url`` of a write server at ``host`` (bare) and ``port``; ``parse_store_url``
    reads it back."""
    return format_host_port(host, port)
