"""What every kvbridge console command shares (``[project.scripts]`` in ``pyproject.toml``).

The contract of a command (``kvbridge-proxy``, ``kvbridge-store``, ``kvbridge-node``,
``kvbridge-demo``, ``kvbridge-demo-vllm``, ``kvbridge-replay``):

- ``--help`` describes it; a bad argument is one line on stderr, ``PROG: error: ...``, and exit
  code 2 (``CommandParser``), before anything starts;
- a server prints one JSON object on one stdout line once it serves, holding its addresses
  (``announce``); ``kvbridge-store`` prints one more, ``{"stats": ..., "shelves": [...]}``, as
  it stops;
- SIGTERM and Ctrl-C stop it cleanly (uvicorn's own handlers for the HTTP servers; ``wait_for_stop``
  for the others), and it exits 0.

Standard library only (the HTTP servers need the ``serve`` extra; ``require_serve_extras`` says
so in one line instead of a traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

__all__ = [
    "SERVE_EXTRAS",
    "CommandParser",
    "announce",
    "require_serve_extras",
    "run_stopping_children",
    "serve_http",
    "wait_for_stop",
]

SERVE_EXTRAS = ("fastapi", "uvicorn", "httpx", "prometheus_client")
"""Modules the HTTP servers import (``pip install 'kvbridge[serve]'``)."""


class CommandParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line (``PROG: error: MESSAGE``) and exit code 2, without
    the usage block argparse prints above them (``--help`` still shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def require_serve_extras(prog: str) -> None:
    """Exit 2 with one line naming the missing modules when the ``serve`` extra is absent."""
    missing = [name for name in SERVE_EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        sys.stderr.write(f"{prog}: error: needs {', '.join(missing)}: "
                         f"pip install 'kvbridge[serve]'\n")
        raise SystemExit(2)


def announce(**fields: Any) -> None:
    """Print the command's one JSON line (its addresses, once it serves) and flush it."""
    print(json.dumps(fields), flush=True)


def run_stopping_children(run: Callable[[Any], int], args: Any) -> int:
    """``run(args)`` with SIGTERM behaving like Ctrl-C, for a command that starts child
    processes: ``run``'s own ``finally`` stops them; an interrupted run exits with 130."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted: stopped every process it started", file=sys.stderr)
        return 130


def wait_for_stop() -> None:
    """Block the calling (main) thread until SIGTERM or Ctrl-C."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):  # a bounded wait lets Ctrl-C's KeyboardInterrupt through
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_http(app: Any, *, host: str, port: int, announce_fields: dict[str, Any]) -> None:
    """Run ``app`` under uvicorn until SIGTERM / Ctrl-C, then return (exit code 0); once it
    listens, ``announce`` the fields plus ``"url"`` (the bound address: ``port`` 0 picks a free
    one). uvicorn's own signal capture re-raises the signal after its graceful shutdown (the
    process would die of it); here the signals only ask the server to stop.

    Raises:
        SystemExit(1): the address cannot be bound (uvicorn has logged why).
    """
    import uvicorn
    from kvbridge.transport.address import format_host_port

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    access_log=False))

    def stop(*_: Any) -> None:
        server.should_exit = True

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():  # bind failed: uvicorn logged it and gave up
                await task
                raise SystemExit(1)
            await asyncio.sleep(0.02)
        bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
        announce(**announce_fields, url=f"http://{format_host_port(bound_host, bound_port)}")
        await task

    asyncio.run(run())
