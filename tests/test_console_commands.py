"""The console commands (``[project.scripts]``, ``kvbridge.connector.serve``) and the examples.

Each command is registered by the installed distribution, answers ``--help`` with exit code 0,
and refuses a bad argument with one line on stderr and exit code 2, before it starts anything.
The servers print one JSON line once serving and stop on SIGTERM with exit code 0. Each script
under ``examples/`` runs to completion with exit code 0 (they check their own results); those
that take an ``INDEX_URL`` run on the in-process index and on a real Redis.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "kvbridge-proxy": ["--prefill"],  # a flag without its value
    "kvbridge-store": ["--capacity-bytes", "many"],
    "kvbridge-node": ["--port", "eighty"],
    "kvbridge-demo": ["--no-such-flag"],
    "kvbridge-demo-vllm": ["--conversations", "x"],
    "kvbridge-replay": [],  # its trace path is required
}
_TIMEOUT_S = 120


def _command(name: str) -> list[str]:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    assert Path(path).exists(), f"{name} is not installed (pip install -e .)"
    return [path]


def test_every_command_is_registered_by_the_distribution():
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
               if ep.name.startswith("kvbridge-")}
    assert set(scripts) == set(COMMANDS), scripts
    assert all(v.startswith("kvbridge.connector.serve.commands:") for v in scripts.values())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_command_answers_help(name):
    done = subprocess.run([*_command(name), "--help"], capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {name} "), done.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_bad_argument_is_one_line_and_exit_code_2(name):
    done = subprocess.run([*_command(name), *COMMANDS[name]], capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), done.stderr
    assert done.stdout == ""


def test_a_store_socket_timeout_of_zero_is_one_line_and_exit_code_2():
    done = subprocess.run([*_command("kvbridge-store"), "--index-url", "redis://127.0.0.1:1/0",
                           "--capacity-bytes", "1048576", "--index-socket-timeout-s", "0"],
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "kvbridge-store: error:" in line]
    assert len(errors) == 1 and "index_socket_timeout_s must be > 0" in errors[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_node_configuration_it_cannot_serve_is_one_line_and_exit_code_2():
    # 64 blocks of 16 tokens cannot hold one 2,048-token request: refused before serving
    done = subprocess.run([*_command("kvbridge-node"), "--port", "0", "--num-blocks", "64"],
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "kvbridge-node: error:" in line]
    assert len(errors) == 1 and "max_model_len=2048" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""


def _serve_then_stop(argv: list[str]) -> tuple[dict, int]:
    """Start a server, read its JSON line, SIGTERM it: (the line, its exit code)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("{"), (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return json.loads(line), code


def test_the_proxy_announces_its_address_and_stops_on_sigterm():
    announced, code = _serve_then_stop([*_command("kvbridge-proxy"), "--port", "0",
                                        "--prefill", "http://127.0.0.1:9", "--decode",
                                        "http://127.0.0.1:10"])
    assert announced["url"].startswith("http://127.0.0.1:") and code == 0, announced
    assert announced["prefill"] == ["http://127.0.0.1:9"]


def test_the_node_server_announces_its_address_and_stops_on_sigterm():
    announced, code = _serve_then_stop([*_command("kvbridge-node"), "--port", "0",
                                        "--role", "both", "--max-model-len", "256"])
    assert announced["url"].startswith("http://127.0.0.1:") and code == 0, announced
    assert announced["role"] == "both"


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_an_example_runs_to_completion(script):
    done = subprocess.run([sys.executable, str(REPO / "examples" / script)], capture_output=True,
                          text=True, timeout=_TIMEOUT_S, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("script", ["offload_to_store.py", "prefix_reuse_index.py"])
def test_an_index_example_runs_on_redis(script, redis_url):
    done = subprocess.run([sys.executable, str(REPO / "examples" / script), redis_url],
                          capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"the index at {redis_url}" in done.stdout, done.stdout
