"""``pip install .`` into a fresh venv, away from the checkout, gives every console command
(issue 29, "What must hold"): each answers ``--help`` from the installed package.

The venv sees this Python's site-packages (``--system-site-packages``) for kvbridge's
dependencies, so nothing is downloaded; kvbridge itself is built from this checkout as a wheel
and installed into the venv, and the test checks that the commands import it from there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from test_console_commands import COMMANDS

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pip_install_gives_every_command_outside_the_checkout(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    source = tmp_path / "src"  # a copy: setuptools builds in the source tree (build/, egg-info)
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", ".pkg"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-build-isolation", str(source)],
                   check=True, capture_output=True, timeout=600, cwd=tmp_path)
    where = subprocess.run(
        [str(python), "-c", "import kvbridge.connector.serve as s; print(s.__file__)"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=True).stdout.strip()
    assert where.startswith(str(env_dir)), where  # the installed copy, not the checkout
    for name in COMMANDS:
        done = subprocess.run([str(env_dir / "bin" / name), "--help"], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.startswith(f"usage: {name} "), (
            name, done.stderr[-2000:])
