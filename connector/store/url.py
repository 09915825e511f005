"""The store tier's address syntax: ``store_url`` is ``"host:port"`` of a store's write server.

Standard library only, so that configuration can check a URL without importing the store tier.
"""

from __future__ import annotations

__all__ = ["parse_store_url"]


def parse_store_url(url: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)`` (the port follows the last colon, in [1, 65535]).
    Raises ValueError for anything else."""
    host, sep, port = url.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store_url must be 'host:port', got {url!r}")
    return host, int(port)
