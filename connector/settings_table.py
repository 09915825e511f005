"""The settings of ``kv_connector_extra_config`` as a Markdown table, made from their definitions.

Each key's default comes from ``KVTransferConfig`` itself and its meaning from the table in
``kvbridge.connector.config``'s docstring, so the README's table (between ``<!-- settings -->``
and ``<!-- /settings -->``) is generated, never written by hand, and a test keeps it equal to
what this module prints::

    python -m kvbridge.connector.settings_table            # print the table
    python -m kvbridge.connector.settings_table README.md  # rewrite the README's table
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

from . import config as config_module
from .config import KVTransferConfig

__all__ = ["Setting", "documented_settings", "markdown_table", "rewrite"]

_OUTER = frozenset({"kv_connector", "kv_role", "engine_id"})
_BEGIN, _END = "<!-- settings -->", "<!-- /settings -->"


class Setting(NamedTuple):
    name: str
    default: str  # as JSON, from the dataclass
    meaning: str  # from the config module's docstring table


def _docstring_rows() -> dict[str, str]:
    """``key -> meaning`` from the reStructuredText table of ``config``'s docstring (rows begin
    with a ````key```` in the first column; continuation lines carry on the meaning)."""
    lines = (config_module.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    if len(rules) < 3:
        raise RuntimeError("kvbridge.connector.config's docstring has no settings table")
    meaning_col = lines[rules[0]].rindex(" ") + 1  # the last column's start
    rows: dict[str, list[str]] = {}
    key = None
    for line in lines[rules[1] + 1:rules[2]]:
        found = re.match(r"``(\w+)``", line)
        if found:
            key = found.group(1)
            rows[key] = []
        if key is not None and line[meaning_col:].strip():
            rows[key].append(line[meaning_col:].strip())
    return {k: " ".join(v) for k, v in rows.items()}


def documented_settings() -> list[Setting]:
    """Every extra-config key in definition order.

    Raises:
        RuntimeError: a dataclass field without a docstring row, or a row naming no field.
    """
    fields = [f for f in dataclasses.fields(KVTransferConfig) if f.name not in _OUTER]
    meanings = _docstring_rows()
    missing = [f.name for f in fields if f.name not in meanings]
    extra = sorted(set(meanings) - {f.name for f in fields})
    if missing or extra:
        raise RuntimeError(f"config docstring table: undocumented {missing}, unknown {extra}")
    return [Setting(f.name, json.dumps(f.default), meanings[f.name]) for f in fields]


def markdown_table() -> str:
    rows = ["| setting | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{s.name}` | `{s.default}` | "
             f"{s.meaning.replace('``', '`').replace('|', '/')} |" for s in documented_settings()]
    return "\n".join(rows)


def rewrite(path: Path) -> bool:
    """Put the current table between the markers of ``path``; True when it changed."""
    text = path.read_text()
    begin, end = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
    new = text[:begin] + "\n" + markdown_table() + "\n" + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print("rewritten" if rewrite(Path(sys.argv[1])) else "up to date")
    else:
        print(markdown_table())
