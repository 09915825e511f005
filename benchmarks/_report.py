"""How every benchmark ends: its figures as one JSON line on stdout, and, with ``--markdown PATH``,
the same figures written as its own section of a Markdown file (``docs/benchmarks.md``).

A section sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; a run replaces its
own section and leaves every other one as it was, so the page always shows each benchmark's
latest run, with the command, the date and the commit it was measured on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["add_markdown_option", "finish", "markdown_section"]

REPO = Path(__file__).resolve().parent.parent


def add_markdown_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                        help="also write the figures as this benchmark's section of PATH "
                             "(docs/benchmarks.md)")


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def _rows(report: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in report.items():
        if key == "targets":
            continue
        if isinstance(value, Mapping):
            rows.extend(_rows(value, f"{prefix}{key}."))
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def markdown_section(name: str, title: str, report: Mapping[str, Any], *,
                     command: str, when: datetime.datetime, commit: str) -> str:
    """The section's text, markers included (``report["targets"]``, when present, adds a
    target column)."""
    targets = report.get("targets") or {}
    lines = [f"<!-- bench:{name} -->", f"### {title}", "",
             f"`{command}` — {when:%Y-%m-%d %H:%M} UTC, commit `{commit}`, "
             f"{os.cpu_count()} CPU cores.", "",
             "| figure | value | target |", "| --- | --- | --- |"]
    for key, value in _rows(report):
        shown = json.dumps(value) if isinstance(value, list | tuple | bool) or value is None \
            else value
        lines.append(f"| `{key}` | {shown} | {targets.get(key, '')} |")
    lines.append(f"<!-- /bench:{name} -->")
    return "\n".join(lines)


def finish(report: Mapping[str, Any], *, name: str, title: str,
           markdown: Path | None) -> None:
    """Print ``report`` as the run's last line (one JSON object); with ``markdown``, replace
    (or append) this benchmark's section there."""
    print(json.dumps(report), flush=True)
    if markdown is None:
        return
    command = "python " + " ".join(
        [str(Path(sys.argv[0]).resolve().relative_to(REPO)) if Path(sys.argv[0]).is_file()
         else sys.argv[0], *[a for a in sys.argv[1:] if a != "--markdown" and
                             not a.endswith(".md")]])
    section = markdown_section(name, title, report, command=command,
                               when=datetime.datetime.now(datetime.UTC), commit=_commit())
    text = markdown.read_text() if markdown.exists() else ""
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->",
                         re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else \
        text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    markdown.write_text(text)
