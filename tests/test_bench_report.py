"""benchmarks/_report.py: a benchmark's ``--markdown`` run replaces its own section of the page
and leaves every other section as it was."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _report import finish


def test_a_run_replaces_its_own_section_and_keeps_the_others(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_x.py", "--markdown", "page.md"])
    page = tmp_path / "page.md"
    page.write_text("# Benchmarks\n\nintro\n")
    finish({"a_over_b": 0.5, "targets": {"a_over_b": 0.9}}, name="x", title="X", markdown=page)
    finish({"c": 1, "nested": {"d": 2}}, name="y", title="Y", markdown=page)
    finish({"a_over_b": 0.7, "targets": {"a_over_b": 0.9}}, name="x", title="X", markdown=page)
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n")
    assert text.count("<!-- bench:x -->") == text.count("<!-- /bench:x -->") == 1
    assert "| `a_over_b` | 0.7 | 0.9 |" in text and "| `a_over_b` | 0.5 |" not in text
    assert "| `nested.d` | 2 |" in text and "| `c` | 1 |" in text
    assert text.index("bench:x") < text.index("bench:y")  # replaced in place, not moved
    lines = capsys.readouterr().out.splitlines()
    assert lines == ['{"a_over_b": 0.5, "targets": {"a_over_b": 0.9}}',
                     '{"c": 1, "nested": {"d": 2}}',
                     '{"a_over_b": 0.7, "targets": {"a_over_b": 0.9}}']
