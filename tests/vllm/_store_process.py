"""``kvbridge-store`` as its own process for the store-tier tests: started with the plain
command line (no model or profile: it takes its geometry from the first writer), in a session
of its own so it can be paused and killed whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


class StoreProcess:
    """A started ``kvbridge-store`` (``announced``: its one JSON line, once serving)."""

    def __init__(self, redis_url: str, write_port: int, log_path: Path, *,
                 capacity_bytes: int, max_shelves: int = 1, extra_args: Sequence[str] = ()
                 ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in kill
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.connector.serve.store_server",
             "--index-url", redis_url, "--capacity-bytes", str(capacity_bytes),
             "--write-port", str(write_port), "--max-shelves", str(max_shelves), *extra_args],
            stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            for line in self.proc.stdout:  # its one JSON line once serving (UCX may warn first)
                if line.startswith("{"):
                    self.announced = json.loads(line)
                    break
            else:
                raise AssertionError(f"the store exited before serving (log: {log_path})")
        except BaseException:
            self.kill()  # never left running
            raise

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()
