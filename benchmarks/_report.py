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

__all__ = ["add_markdown_option", "finish", "markdown_section", "ratios_table",
           "rewrite_readme_ratios"]

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
    readme = REPO / "README.md"
    if markdown.resolve() == (REPO / "docs" / "benchmarks.md").resolve() and readme.exists():
        rewrite_readme_ratios(readme, markdown)


KEY_RATIOS: dict[str, list[tuple[str, str, str]]] = {
    # benchmark -> (figure, what it compares, target)
    "transport": [
        ("host_transfer_vs_memcpy", "64 MiB between two processes, same host / memcpy", ">= 1.0"),
        ("paged_vs_contiguous", "2,048 random 16 KiB blocks / the same bytes contiguous",
         ">= 0.9"),
        ("ucx_host_transfer_vs_memcpy", "64 MiB over UCX / memcpy", ">= 0.6"),
        ("ucx_paged_vs_contiguous", "paged / contiguous over UCX", ">= 0.7"),
    ],
    "kernels": [("gather_ratio_16k", "gather of 16 KiB blocks / a contiguous copy", ">= 0.9")],
    "index": [("lookup_over_ping", "longest prefix of 625 hashes / one Redis PING", "<= 1.5")],
    "store": [("restore_vs_recompute", "restore a 4,096-token prefix from the store / recompute",
               "< 0.2")],
    "vllm_pd": [("kvbridge_over_nixl", "vLLM D's first token, kvbridge / NixlConnector", "<= 0.5"),
                ("wrong_ticket_over_recompute",
                 "vLLM first token after a wrong ticket / a plain recompute", "<= 1.2")],
    "vllm_prefix": [
        ("cross_over_recompute", "vLLM first token, a prefix from another engine / recompute",
         "<= 0.25"),
        ("cross_over_lmcache", "the same, kvbridge / LMCache (engines spawned alike)", "<= 0.5"),
        ("restore_over_recompute", "vLLM first token, a prefix restored from the store / recompute",
         "<= 0.3"),
        ("sched_index_over_off", "vLLM schedule() per step, index on / no connector", "<= 1.05"),
        ("sched_null_over_off", "the same, a connector doing nothing / no connector", "(floor)"),
        ("replay_hit_over_unbounded", "trace replay, 3 engines: cached tokens / unbounded caches",
         ">= 0.85"),
    ],
}


def _sections(text: str) -> dict[str, tuple[str, dict[str, str]]]:
    """``name -> (its "measured" line, figure -> value)`` of every section of the page."""
    found = {}
    for match in re.finditer(r"<!-- bench:(\w+) -->\n(.*?)<!-- /bench:\1 -->", text, re.S):
        body = match.group(2)
        when = re.search(r"— (\d{4}-\d\d-\d\d) [\d:]+ UTC, commit `([^`]+)`", body)
        rows = dict(re.findall(r"^\| `([^`]+)` \| ([^|]*) \|", body, re.M))
        found[match.group(1)] = (f"{when.group(1)}, `{when.group(2)}`" if when else "?",
                                 {k: v.strip() for k, v in rows.items()})
    return found


def ratios_table(benchmarks_md: str) -> str:
    """The README's table of key ratios, read from ``docs/benchmarks.md``'s sections (a figure
    not measured yet shows as "not run")."""
    sections = _sections(benchmarks_md)
    lines = ["| ratio | value | target | measured |", "| --- | --- | --- | --- |"]
    for name, figures in KEY_RATIOS.items():
        measured, rows = sections.get(name, ("not run", {}))
        for key, what, target in figures:
            lines.append(f"| {what} | {rows.get(key, 'not run')} | {target} | {measured} |")
    return "\n".join(lines)


def rewrite_readme_ratios(readme: Path, benchmarks_md: Path) -> bool:
    """Put ``ratios_table`` between README's ``<!-- ratios -->`` markers; True when it changed."""
    text = readme.read_text()
    begin, end = text.index("<!-- ratios -->") + len("<!-- ratios -->"), \
        text.index("<!-- /ratios -->")
    new = text[:begin] + "\n" + ratios_table(benchmarks_md.read_text()) + "\n" + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text


if __name__ == "__main__":  # python benchmarks/_report.py: README's ratios from docs/benchmarks.md
    changed = rewrite_readme_ratios(REPO / "README.md", REPO / "docs" / "benchmarks.md")
    print("README ratios rewritten" if changed else "README ratios up to date")
