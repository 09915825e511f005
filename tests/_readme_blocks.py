"""The README's runnable shell blocks, and a runner for them (issue 29, part 4).

A fenced ``bash`` block right after a ``<!-- run serve -->`` (``<!-- run serve vllm -->`` for the
vLLM suite) line is a deployment a reader copies: servers started with ``&``, then a ``curl``.
``run_block`` runs it as one bash script, as written, with only what a test needs changed:

- the ports it names become free ports (two runs never collide with each other or a user's);
- ``substitutions`` (for example ``MODEL`` -> a tiny checkpoint, ``redis-server`` -> the server
  the suite found) are applied word for word;
- ``curl`` retries until the servers it talks to answer (``--retry-connrefused``; a proxy
  answers 502/503 until its backends are up, which curl also retries);
- every process the script started is stopped afterwards (its own process group).

The block passes when the script exits 0 and its last JSON line is a completion with tokens.

Every other fenced shell block of the README and of ``docs/*.md`` that a reader might run has a
``<!-- not run: REASON -->`` line right before it instead (``unmarked_shell_blocks`` finds the
blocks with neither); the reason says why, and which test runs its short form if one does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvbridge.connector.serve.demo.processes import free_port

REPO = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^<!-- run (?P<kind>[\w ]+) -->\n```bash\n(?P<body>.*?)^```", re.M | re.S)
_CURL_RETRY = ('curl() { command curl --retry 180 --retry-delay 1 --retry-connrefused '
               '--retry-all-errors --max-time 120 "$@"; }\n')


RUN_KINDS = ("serve", "serve vllm")  # the kinds a test runs (test_readme_*.py)
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
_SHELL_FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
_MARKER = re.compile(r"^<!-- (?:run (?P<kind>[\w ]+?)|not run: (?P<reason>.{12,}?)) -->$")


def unmarked_shell_blocks(path: Path) -> list[str]:
    """``"FILE:LINE"`` of every fenced shell block of ``path`` without a marker right before it:
    ``<!-- run KIND -->`` of a kind in ``RUN_KINDS`` (in the README: the tests read its blocks
    only), or ``<!-- not run: REASON -->`` (a reason of 12 characters or more)."""
    lines = path.read_text().splitlines()
    found, in_block = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if not in_block and _SHELL_FENCE.match(line):
                marker = _MARKER.match(lines[number - 2]) if number > 1 else None
                runs = marker and marker["kind"] in RUN_KINDS and path.name == "README.md"
                if not marker or (marker["kind"] and not runs):
                    found.append(f"{path.relative_to(REPO)}:{number}")
            in_block = not in_block
    return found


@dataclass(frozen=True)
class Block:
    kind: str  # "serve" or "serve vllm"
    body: str
    line: int  # where it starts in the README


def readme_blocks(kind: str, path: Path = REPO / "README.md") -> list[Block]:
    text = path.read_text()
    return [Block(m.group("kind").strip(), m.group("body"), text.count("\n", 0, m.start()) + 1)
            for m in _BLOCK.finditer(text) if m.group("kind").strip() == kind]


def run_block(block: Block, *, substitutions: dict[str, str], timeout_s: float,
              env: dict[str, str] | None = None,
              wait_for: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run ``block``; returns (its last JSON line, the whole output).

    ``wait_for``: strings the servers it left running must print before they are stopped
    (a server that announces itself after the block's curl answered, as a slow store does on a
    busy host); waited for until ``timeout_s`` from the start, then the block's output is
    returned as it is.

    Raises:
        AssertionError: the script failed or printed no completion (with its output).
    """
    script = block.body
    ports = sorted({int(p) for p in re.findall(r"(?<=[: ])(\d{4})\b", script)})
    for port in ports:
        script = re.sub(rf"(?<=[: ]){port}\b", str(free_port()), script)
    for word, value in substitutions.items():
        script = re.sub(rf"(?<![\w/-]){re.escape(word)}(?![\w-])", value, script)
    with tempfile.TemporaryFile("w+") as out:  # a pipe would stay open in the servers it left
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", _CURL_RETRY + script],
                                stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            proc.wait(timeout=timeout_s)
            # pread: the servers share the file's offset, which a seek here would move
            while time.monotonic() < deadline and not all(
                    word in os.pread(out.fileno(), 1 << 24, 0).decode(errors="replace")
                    for word in wait_for):
                time.sleep(0.2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the servers it left running
            time.sleep(1.0)  # let them go before the next test takes their ports' neighbours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        output = out.read()
    assert proc.returncode == 0, f"README block at line {block.line}:\n{output[-4000:]}"
    # curl prints no newline after its answer, so a server's next line may follow it directly
    decode = json.JSONDecoder().raw_decode
    answers = [decode(line)[0] for line in output.splitlines() if line.startswith('{"')]
    completions = [a for a in answers if "choices" in a]
    assert completions, (
        f"README block at line {block.line} printed no completion:\n{output[-4000:]}")
    return completions[-1], output
