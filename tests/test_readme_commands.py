"""The README tells the truth (issue 29, parts 2 and 4): its runnable blocks run, its settings
table is the one the config definitions make, and its ratios are docs/benchmarks.md's.

The vLLM block runs in the vLLM suite (``tests/vllm/test_readme_vllm.py``)."""

from __future__ import annotations

import sys

import pytest
from _readme_blocks import REPO, readme_blocks, run_block
from _redis_fixture import server_binary
from kvbridge.connector.settings_table import markdown_table

sys.path.insert(0, str(REPO / "benchmarks"))

from _report import ratios_table


def _between(text: str, marker: str) -> str:
    begin = text.index(f"<!-- {marker} -->") + len(f"<!-- {marker} -->")
    return text[begin:text.index(f"<!-- /{marker} -->")].strip()


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_settings_table_is_made_from_the_config_definitions():
    # a stale table: python -m kvbridge.connector.settings_table README.md
    assert _between((REPO / "README.md").read_text(), "settings") == markdown_table()


def test_the_ratios_are_the_latest_benchmark_runs():
    # stale: python benchmarks/_report.py (or any benchmark run with --markdown docs/benchmarks.md)
    assert _between((REPO / "README.md").read_text(), "ratios") == ratios_table(
        (REPO / "docs" / "benchmarks.md").read_text())


@pytest.mark.parametrize("block", readme_blocks("serve"), ids=lambda b: f"line{b.line}")
def test_a_readme_deployment_answers_its_curl(block):
    completion, output = run_block(
        block, substitutions={"redis-server": server_binary().path}, timeout_s=240,
        wait_for=('"store_url"',))
    tokens = completion["choices"][0]["token_ids"]
    assert len(tokens) == 16, completion
    assert '"store_url"' in output  # the store announced itself
