"""What this process has running, for the tests that a refused start leaves nothing behind:
its threads, its listening TCP sockets and the tasks on the connector's event loop.

The connector loop's thread and its default executor's (``asyncio_N``, e.g. a ``getaddrinfo``)
are the process's, shared by every node and started on first use: not counted.

Listening sockets come from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (state ``0A``, LISTEN),
kept when their inode is one of this process's open file descriptors (``/proc/self/fd``): Linux
only, as CI is (psutil, which would do the same, is not a dependency).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass

from kvbridge.connector.loop_thread import get_loop_thread

_TCP_LISTEN = "0A"
_LOOP_THREAD_NAME = "kvbridge-connector-loop"


def listening_sockets() -> set[str]:
    """``"address:port"`` (hex, as ``/proc/net/tcp*`` writes it) of every TCP socket this
    process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd among them)
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in lines.readlines()[1:]:
                fields = line.split()
                if fields[3] == _TCP_LISTEN and fields[9] in inodes:
                    found.add(fields[1])
    return found


def _loop_tasks() -> set[str]:
    """Names and coroutines of the tasks on the connector loop (the caller's excluded)."""

    async def tasks() -> set[str]:
        me = asyncio.current_task()
        return {f"{t.get_name()} {t.get_coro()!r}" for t in asyncio.all_tasks() if t is not me}

    return get_loop_thread().run(tasks(), 10)


def _shared(thread: threading.Thread) -> bool:
    """The connector loop's thread or one of its default executor's (module docstring)."""
    return thread.name == _LOOP_THREAD_NAME or thread.name.startswith("asyncio_")


@dataclass(frozen=True)
class Running:
    """A snapshot: thread objects, listening sockets, connector-loop tasks."""

    threads: frozenset[threading.Thread]
    listening: frozenset[str]
    loop_tasks: frozenset[str]

    @classmethod
    def now(cls) -> Running:
        loop_tasks = frozenset(_loop_tasks())  # first: it may start the connector loop
        return cls(frozenset(t for t in threading.enumerate() if not _shared(t)),
                   frozenset(listening_sockets()), loop_tasks)

    def started_since(self, before: Running) -> dict[str, list[str]]:
        """What runs now that did not in ``before`` (empty lists: nothing)."""
        return {
            "threads": sorted(t.name for t in self.threads - before.threads),
            "listening": sorted(self.listening - before.listening),
            "loop_tasks": sorted(self.loop_tasks - before.loop_tasks),
        }


def started_since(before: Running, *, settle_s: float = 2.0) -> dict[str, list[str]]:
    """What was started since ``before`` and still runs ``settle_s`` later at the most (a
    thread asked to stop may take a moment to end)."""
    deadline = time.monotonic() + settle_s
    while True:
        started = Running.now().started_since(before)
        if not any(started.values()) or time.monotonic() > deadline:
            return started
        time.sleep(0.05)
