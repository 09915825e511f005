"""Every design reference in the code resolves to a heading of a file under ``docs/`` (issue 29,
part 3).

A reference is written ``docs/<file>.md, "<Section>"`` in a docstring or a comment (a section
name may wrap onto the next comment line); ``docs/<file>.md`` alone names a whole file. Each one
must name a file that exists and, when it names a section, a Markdown heading of that file with
exactly that text (any level; lines inside fenced code blocks are not headings). ``DESIGN.md``,
a file outside the repository that the code once cited, must not be mentioned any more.

Scanned: every ``*.py`` file of the repository (package, examples, benchmarks, tests),
``pyproject.toml`` and ``README.md``, as plain text (in Markdown the file name may stand in
backticks: ```docs/architecture.md`, "Layers"``). And the other way: every repository file that
the README or a page of ``docs/`` names (``examples/...py``, ``tests/...py``) exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"
SKIPPED_DIRS = {".git", ".pkg", ".venv", "venv", "build", "dist", "__pycache__", "node_modules"}
THIS_FILE = Path(__file__).resolve()

# ``docs/architecture.md, "Life of a P/D request"``; between the comma and the quote, and inside
# the quotes, a line break may be followed by a comment's ``#``.
_REFERENCE = re.compile(
    r"docs/(?P<file>[A-Za-z0-9_.-]+\.md)`?"
    r"(?:,\s*(?:#\s*)?\"(?P<section>[^\"]+)\")?"
)
_STALE = re.compile(r"\bDESIGN(?:\.md\b|'s\b|\b)")
_HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _scanned_files() -> list[Path]:
    files = [REPO_ROOT / "pyproject.toml", REPO_ROOT / "README.md"]
    for path in sorted(REPO_ROOT.rglob("*.py")):
        if SKIPPED_DIRS.isdisjoint(path.relative_to(REPO_ROOT).parts) and path != THIS_FILE:
            files.append(path)
    return files


def _normalise_section(raw: str) -> str:
    """The section name as written, with a wrapped comment's ``#`` and runs of white space
    between its words collapsed to one space."""
    return " ".join(re.sub(r"\n\s*#", " ", raw).split())


def headings(markdown: str) -> set[str]:
    """The texts of every Markdown heading outside fenced code blocks."""
    found: set[str] = set()
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if match:
            found.add(match.group("text"))
    return found


def references(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, file, section or None)`` of every ``docs/...md`` reference in ``text``."""
    return [
        (
            text.count("\n", 0, match.start()) + 1,
            match.group("file"),
            _normalise_section(match.group("section")) if match.group("section") else None,
        )
        for match in _REFERENCE.finditer(text)
    ]


def unresolved(text: str, docs: dict[str, set[str]]) -> list[str]:
    """Why each reference in ``text`` does not resolve against ``docs`` (file -> headings)."""
    problems = []
    for line, file, section in references(text):
        if file not in docs:
            problems.append(f"line {line}: docs/{file} does not exist")
        elif section is not None and section not in docs[file]:
            problems.append(f'line {line}: docs/{file} has no heading "{section}"')
    return problems


def _docs() -> dict[str, set[str]]:
    return {path.name: headings(path.read_text(encoding="utf-8")) for path in DOCS.glob("*.md")}


def test_every_docs_reference_names_an_existing_file_and_heading():
    docs = _docs()
    offenders = [
        f"{path.relative_to(REPO_ROOT)}: {problem}"
        for path in _scanned_files()
        for problem in unresolved(path.read_text(encoding="utf-8"), docs)
    ]
    assert not offenders, "references that do not resolve:\n" + "\n".join(offenders)


# ``examples/pd_in_process.py``, ``tests/vllm/make_venv.sh``: a file of the repository that the
# README or docs/ names (a command to run, a test to read), which must exist.
_REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:examples|tests|benchmarks|connector|kvmanager|kernels|transport|scripts)"
    r"/[\w/.-]*\.(?:py|sh))"
)


def test_every_repository_file_the_docs_name_exists():
    # issue 29: the servers moved from examples/ into the package; a page still saying
    # `python examples/node_server.py` tells a user to run a file that is gone
    named = [
        (path, text.count("\n", 0, match.start()) + 1, match.group(1))
        for path in [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
        for text in [path.read_text(encoding="utf-8")]
        for match in _REPO_PATH.finditer(text)
    ]
    assert len(named) >= 10, named  # guards against passing on nothing
    missing = [f"{path.name}:{line}: {name}" for path, line, name in named
               if not (REPO_ROOT / name).exists()]
    assert not missing, "files the docs name that do not exist:\n" + "\n".join(missing)


def test_the_code_cites_the_docs():
    # Guards the test above against passing on nothing: the code does cite sections.
    cited = [
        ref
        for path in _scanned_files()
        for ref in references(path.read_text(encoding="utf-8"))
        if ref[2] is not None
    ]
    assert len(cited) >= 40, f"only {len(cited)} section references found"


def test_nothing_cites_design_md():
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: "
        f"{match.group(0)}"
        for path in _scanned_files()
        for text in [path.read_text(encoding="utf-8")]
        for match in _STALE.finditer(text)
    ]
    assert not offenders, "mentions of DESIGN.md, a file outside the repository:\n" + "\n".join(
        offenders
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a docstring reference that wraps between the comma and the section
        ('see docs/architecture.md,\n"Layers" for it', []),
        # a comment whose section name wraps onto the next comment line
        ('# pairing (docs/architecture.md, "Pairing by\n    # position").', []),
        # a whole-file reference
        ("details in docs/operations.md.", []),
        # Markdown: the file name in backticks
        ('see `docs/architecture.md`, "Layers".', []),
        ('see `docs/architecture.md`, "Layer".', ['line 1: docs/architecture.md has no heading '
                                                 '"Layer"']),
        ('docs/architecture.md, "No such section"', ['line 1: docs/architecture.md has no '
                                                     'heading "No such section"']),
        ('x\ndocs/nowhere.md, "Layers"', ["line 2: docs/nowhere.md does not exist"]),
        # a heading inside a fenced code block is not a heading
        ('docs/operations.md, "host A"', ['line 1: docs/operations.md has no heading "host A"']),
    ],
)
def test_references_are_read_as_written(text, expected):
    docs = {
        "architecture.md": headings("# A\n## Layers\n### Pairing by position\n"),
        "operations.md": headings("# Ops\n```bash\n# host A\n```\n## Security\n"),
    }
    assert unresolved(text, docs) == expected


def test_stale_design_mentions_are_found():
    found = [m.group(0) for m in _STALE.finditer('DESIGN.md, "X"; DESIGN step 6; DESIGN\'s rule')]
    assert found == ["DESIGN.md", "DESIGN", "DESIGN's"]
