"""No docstring or comment of the package quotes a benchmark figure (issue 29, part 3).

Figures measured on one host go stale with every change; a docstring states its contract and
its reason in words and cites ``docs/architecture.md, "Design measurements"`` for the numbers.
Read with ``ast`` (every string statement: module, class, function and attribute docstrings)
and ``tokenize`` (every comment) in ``connector/``, ``transport/``, ``kernels/`` and
``kvmanager/``.

What counts as a figure is a fixed set of forms, each of which a contract never needs:

- a bandwidth: a number followed by ``GB/s``, ``MiB/s``, ``Gbit/s`` ...;
- a ratio to a Redis PING: ``1.4 x PING``, ``2 PINGs``;
- a before/after: ``16.2 -> 13.2 ms``, ``~25 -> ~10``, ``0.45 -> 0.66`` (a decimal, ``~`` or a
  unit before the arrow: ``ref_cnt 0 -> 1`` is a state change, not a figure);
- ``measured`` followed, in the same clause, by a number with a unit;
- an approximate or ranged duration: ``about 0.3 ms``, ``~20 us``, ``4-7 ms``, ``0.2-1.4``;
- a timing verb with a figure: ``took 12 ms``, ``costs 2 us``, ``ran at 6 GB/s``;
- ``8 ms instead of 0.1 ms``, ``12 ms, 8.5 ms``, ``12 ms against 3``;
- a speed-up factor: ``4x slower``, ``about ten times its gather``, ``twice the rate``,
  ``half the bandwidth``.

Exact contract values (``waits 1 ms``, ``5 KB for 625 blocks``, ``the first 80 %``) are none of
these forms.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("connector", "transport", "kernels", "kvmanager")

_NUM = r"\d[\d.,]*"
_TIME = r"(?:ms|us|µs|ns)"
FIGURE_FORMS: dict[str, re.Pattern[str]] = {
    "bandwidth": re.compile(rf"{_NUM}\s*(?:[KMGT]i?B|[KMG]bit)/s"),
    "ratio to PING": re.compile(rf"{_NUM}\s*(?:x\s+(?:a\s+|one\s+)?PING|PINGs?\b)"),
    "before/after": re.compile(
        rf"(?:~\s*{_NUM}|\d[\d,]*\.\d+|{_NUM}\s*(?:{_TIME}|%|x))\s*->\s*~?\d"
    ),
    "measured figure": re.compile(
        rf"[Mm]easured\b[^.;]{{0,120}}?{_NUM}\s*(?:{_TIME}|GB/s|%|x)\b"
    ),
    "approximate duration": re.compile(rf"(?:about|~|roughly|around)\s*{_NUM}\s*{_TIME}\b"),
    "duration range": re.compile(rf"\d[\d.]*\s*-\s*\d[\d.]*\s*{_TIME}\b"),
    "decimal range": re.compile(r"\b\d*\.\d+\s*-\s*\d*\.\d+\b"),
    "timing verb": re.compile(
        rf"\b(?:took|takes|costs?|ran at)\s+(?:about\s+|~)?{_NUM}"
        rf"(?:\s*-\s*\d[\d.]*)?\s*(?:{_TIME}|GB/s)\b"
    ),
    "instead of": re.compile(rf"\d[\d.]*\s*{_TIME}?\s+instead of\s+(?:about\s+)?\d"),
    "paired durations": re.compile(rf"\d[\d.]*\s*{_TIME}\s*(?:,|against|vs\.?|versus)\s*\d"),
    "speed-up factor": re.compile(
        r"\b\d+(?:\.\d+)?x\b"
        r"|\b(?:two|three|four|five|ten|\d+) times (?:its|as|more|less|slower|faster)"
        r"|\b(?:twice|half)\s+(?:the\s+)?(?:rate|bandwidth|speed|throughput|time)\b"
    ),
}


def figures_in(text: str) -> list[str]:
    """``form: quoted text`` for every figure in ``text`` (white space collapsed first, so a
    figure split over two lines is found)."""
    flat = " ".join(text.split())
    return [
        f"{form}: {match.group(0)!r}"
        for form, pattern in FIGURE_FORMS.items()
        for match in pattern.finditer(flat)
    ]


def prose_of(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every string statement (docstrings) and every comment."""
    found = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    found += [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    return found


def _package_files() -> list[Path]:
    return [
        path
        for folder in PACKAGE_DIRS
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def test_no_docstring_or_comment_quotes_a_benchmark_figure():
    files = _package_files()
    assert len(files) > 100, "the package folders were not found"
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {figure}"
        for path in files
        for line, text in prose_of(path.read_text(encoding="utf-8"))
        for figure in figures_in(text)
    ]
    assert not offenders, (
        "benchmark figures in docstrings or comments (state the contract in words and cite "
        'docs/architecture.md, "Design measurements"):\n' + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "text",
    [
        "moved 16-19 GB/s from numpy buffers",
        "a lookup costs 1.4 x PING",
        "D's first token 16.2 -> 13.2 ms",
        "in vLLM ~25 -> ~10 ms",
        "from 0.45 -> 0.66 of a contiguous copy",
        "(measured here: 4-7 ms per step)",
        "in about 0.3 ms here",
        "a tick (0.2-1.4 ms) late",
        "against 0.5-0.57 for index_copy_",
        "building it costs 2 us a call",
        "a 1 MiB scatter took 8 ms\n    instead of 0.1 ms",
        "paged read 12 ms, 8.5 ms without",
        "made allocate+free 4x slower",
        "costs about ten times its gather",
        "moved at about twice the rate of thread",
    ],
)
def test_each_figure_form_is_caught(text):
    assert figures_in(text), text


@pytest.mark.parametrize(
    "text",
    [
        "waits 1 ms, doubled at each further idle step",
        "the prompt's lookup keys, 5 KB for 625 blocks",
        "pops a block, ref_cnt 0 -> 1",
        "ARGV: P, node, inc, ttl_ms -> 1 registered",
        "measured from committed ``num_computed_tokens``",
        "moments uniform in the first 80 % of the requests",
        "the worker thread copies at most 4 MiB (``AUTO_SYNC_MAX_BYTES``)",
        "raise RuntimeError when called twice",
    ],
)
def test_contract_values_are_not_figures(text):
    assert figures_in(text) == [], text
