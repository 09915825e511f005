"""The README tells the truth (issue 29, parts 2 and 4): its runnable blocks run, its settings
table is the one the config definitions make, and its ratios are docs/benchmarks.md's.

The vLLM block runs in the vLLM suite (``tests/vllm/test_readme_vllm.py``). Every other shell
block of the README and ``docs/`` says why it is not run (``<!-- not run: REASON -->``, checked
here). The decision for the README's first block, ``make demo`` / ``make test``: ``make test`` is
the command CI itself runs, so a test of it would run the suite inside the suite; ``make demo`` in
full (``pip install`` into this Python, then about 36 requests) is too slow for every run, so its
job runs here in short form, ``kvbridge-demo --conversations 2 --turns 2`` (the same processes:
a Redis, P and D, the proxy; the same checks, token for token against a single node). The
``pip install`` lines are run by ``tests/test_install_fresh_venv.py`` (a fresh venv, the checkout
installed as a user would); multi-host and ``/etc`` blocks of docs/operations.md name hosts a test
does not have.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _readme_blocks import DOCS, REPO, readme_blocks, run_block, unmarked_shell_blocks
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


def test_every_shell_block_of_the_docs_is_run_or_says_why_not():
    # a block a reader copies is run by a test (<!-- run serve -->, <!-- run serve vllm -->) or
    # says why not (<!-- not run: REASON -->): none is left to rot unnoticed
    assert len(DOCS) >= 5  # README.md and docs/*.md, found
    unmarked = [where for path in DOCS for where in unmarked_shell_blocks(path)]
    assert not unmarked, f"no <!-- run KIND --> or <!-- not run: REASON --> before: {unmarked}"


@pytest.mark.parametrize("block", readme_blocks("serve"), ids=lambda b: f"line{b.line}")
def test_a_readme_deployment_answers_its_curl(block):
    completion, output = run_block(
        block, substitutions={"redis-server": server_binary().path}, timeout_s=240,
        wait_for=('"store_url"',))
    tokens = completion["choices"][0]["token_ids"]
    assert len(tokens) == 16, completion
    assert '"store_url"' in output  # the store announced itself


def test_make_demo_runs_in_short_form(tmp_path):
    command = shutil.which("kvbridge-demo") or str(Path(sys.executable).parent / "kvbridge-demo")
    done = subprocess.run(
        [command, "--conversations", "2", "--turns", "2", "--no-progress",
         "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["completed"] == report["requests"] == 4, report
    assert (report["errors"], report["mismatches"], report["failed_loads"]) == (0, 0, 0), report
