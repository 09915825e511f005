"""The syntax of every network address kvbridge takes or hands out: one host, ``host:port``, and
the address part of a URL. Standard library only (``ipaddress``), so that configuration checks
an address without loading the transport.

A *host* is a hostname (``node-1``, ``p.example.com``), an IPv4 address (``10.0.0.2``) or an
IPv6 address, bare (``::1``) wherever the host is a field of its own (``kv_transfer_params``'
``remote_host``, the ``host`` setting, the node directory, the handshake). Where a host and a
port are written as one string (``store_url``, index URLs, cluster seeds, proxy backends) an
IPv6 address takes brackets, as in URLs (RFC 3986, section 3.2.2): ``[::1]:7600``. Whatever is
ambiguous or cannot be an address is refused, never guessed at: an IPv6 address without
brackets before a port (``::1:7600`` reads as ``[::1]:7600`` and as ``[::1:7600]``), brackets
around a host that stands alone, an empty host, a port outside [1, 65535], and an IPv6 zone id
(``fe80::1%eth0``: URLs would have to spell it ``%25eth0``, and HTTP clients disagree on it;
use a global or loopback address). ``format_host_port(*parse_host_port(x))`` gives ``x`` back.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

__all__ = [
    "HOST_FORM",
    "HOST_PORT_FORM",
    "HostPort",
    "check_host",
    "format_host_port",
    "parse_base_url",
    "parse_host_port",
    "split_host_port",
]

HOST_FORM = "a hostname or an IP address (IPv6 without brackets, e.g. '::1')"
HOST_PORT_FORM = "'host:port' or '[ipv6]:port'"
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_.])?")
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")
_PORT = re.compile(r"[0-9]{1,5}")


class HostPort(NamedTuple):
    """A host (bare, never bracketed) and a port in [1, 65535]."""

    host: str
    port: int


def _host_problem(host: str) -> str | None:
    """Why ``host`` (bare) is not a host, or None when it is one."""
    if not host:
        return "empty host"
    if ":" in host:
        if "%" in host:
            return "IPv6 zone ids (%...) are not supported; use a global or loopback address"
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "not an IPv6 address"
        return None
    if _DOTTED_NUMBERS.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return "not an IPv4 address"
        return None
    if not _HOSTNAME.fullmatch(host):
        return "not a hostname"
    return None


def check_host(host: object, *, what: str) -> str:
    """``host`` itself when it is a host standing alone (see the module docstring). Pure.

    Raises:
        ValueError: one line naming ``what``, the expected form and ``host`` (brackets around
            an IPv6 address, an empty or malformed host, a zone id, not a string).
    """
    if not isinstance(host, str):
        raise ValueError(f"{what} must be {HOST_FORM}, got {host!r}")
    if host.startswith("[") and host.endswith("]"):
        reason = "no brackets around an address that stands alone"
    else:
        reason = _host_problem(host)
    if reason is not None:
        raise ValueError(f"{what} must be {HOST_FORM}, got {host!r} ({reason})")
    return host


def split_host_port(text: str, *, default_port: int | None = None) -> HostPort:
    """``"host:port"`` or ``"[ipv6]:port"`` -> ``HostPort`` (``default_port`` where the text
    has no port; None: a port is required). The parser behind every other function here. Pure.

    Raises:
        ValueError: the reason alone (``"an IPv6 address takes brackets"``), for a caller that
            writes its own message (``parse_host_port`` does).
    """
    if not isinstance(text, str):
        raise ValueError(f"not a string but {type(text).__name__}")
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket:
            raise ValueError("no closing bracket")
        if ":" not in host:
            raise ValueError("brackets hold an IPv6 address only")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{rest!r} after the closing bracket")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ValueError("an IPv6 address takes brackets, as in '[::1]:7600'")
    else:
        host, colon, port_text = text.partition(":")
        port_text = port_text if colon else None
    reason = _host_problem(host)
    if reason is not None:
        raise ValueError(reason)
    if port_text is None:
        if default_port is None:
            raise ValueError("no port")
        return HostPort(host, default_port)
    if not _PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
        raise ValueError(f"port must be in [1, 65535], got {port_text!r}")
    return HostPort(host, int(port_text))


def parse_host_port(text: str, *, what: str, default_port: int | None = None) -> HostPort:
    """``"host:port"`` or ``"[ipv6]:port"`` -> ``HostPort``, as ``split_host_port``. Pure.

    Raises:
        ValueError: one line naming ``what``, the expected form, ``text`` and why, e.g.
            ``store_url must be 'host:port' or '[ipv6]:port', got '::1:7600' (an IPv6 address
            takes brackets, as in '[::1]:7600')``.
    """
    try:
        return split_host_port(text, default_port=default_port)
    except ValueError as exc:
        form = "'host[:port]' or '[ipv6][:port]'" if default_port is not None else HOST_PORT_FORM
        raise ValueError(f"{what} must be {form}, got {text!r} ({exc})") from None


def format_host_port(host: str, port: int) -> str:
    """``"host:port"``, with brackets around an IPv6 ``host`` (``"[::1]:7600"``): the form
    ``parse_host_port`` reads back, and the authority of a URL (``f"http://{...}/path"``). Pure;
    ``host`` is bare, as ``HostPort.host``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_base_url(url: str, *, what: str, schemes: tuple[str, ...] = ("http", "https")) -> str:
    """``url`` without its trailing ``/`` when it is ``scheme://host[:port][/path]`` with a
    scheme of ``schemes`` and a host as ``split_host_port`` reads it (an IPv6 one in brackets:
    ``http://[::1]:8100``), no user name, query or fragment: a base that paths are appended
    to (``f"{base}/v1/completions"``). Pure.

    Raises:
        ValueError: one line naming ``what``, the expected form and ``url``.
    """
    form = f"'{schemes[0]}://host:port' or '{schemes[0]}://[ipv6]:port'"
    scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    netloc, slash, path = rest.partition("/")
    if not sep or scheme not in schemes:
        reason = f"the scheme must be one of {schemes}"
    elif "@" in netloc or "?" in rest or "#" in rest:
        reason = "no user name, query or fragment"
    else:
        try:
            split_host_port(netloc, default_port=443 if scheme == "https" else 80)
        except ValueError as exc:
            reason = str(exc)
        else:
            return f"{scheme}://{netloc}{slash}{path}".rstrip("/")
    raise ValueError(f"{what} must be {form}, got {url!r} ({reason})")
