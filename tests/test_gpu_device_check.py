"""``scripts/gpu_device_check.sh`` (issue 30, part 5) on this CPU host: without CUDA it says that
nothing GPU was run and exits 0; ``--cpu-dry-run`` runs every step of it (symlink tree, wheel
install, log under ``$OUT``) and every check of ``scripts/gpu_device_check.py`` on the CPU, so
the script the lead runs on a GPU machine cannot rot. The device-binding check must also fail
when a connector thread is not bound (checked here by unbinding the engine-loop thread)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_device_check.sh"
CHECKS = ("1. Triton kernels", "2. P/D", "4. UCX", "3. connector threads", "5. holder vouches")


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    wheels = tmp_path / "no-wheels"
    wheels.mkdir(exist_ok=True)
    full_env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "KVBRIDGE_GPU_WHEEL_DIR": str(wheels),  # this host's packages, none from .whl/
        "KVBRIDGE_GPU_SITE": str(tmp_path / "site"),
        **(env or {}),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=280
    )


def test_without_cuda_it_says_nothing_gpu_was_run_and_exits_0(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the script would run for real")
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing GPU was run" in done.stdout
    assert "PASS" not in done.stdout and "FAIL" not in done.stdout


@pytest.mark.timeout(300)
def test_cpu_dry_run_passes_every_check_and_writes_the_log(tmp_path):
    done = _run(tmp_path, "--cpu-dry-run")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for name in CHECKS:
        assert f"PASS {name}" in done.stdout, output
    assert f"{len(CHECKS)} passed, 0 failed" in done.stdout
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "PASS 3. connector threads bound to the KV device" in log
    assert "engine-loop" in log and "kvbridge-connector-loop" in log and "kvbridge-copy" in log


@pytest.mark.timeout(300)
def test_the_binding_check_fails_for_a_thread_that_is_not_bound(tmp_path):
    """The engine-loop thread started without ``device_binding.bound`` (through a
    ``sitecustomize`` that replaces it before the script imports it) fails check 3."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "from kvbridge.kernels import device_binding\n"
        "device_binding.bound = lambda device, fn: fn\n"
    )
    env = {"PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}"}
    done = _run(tmp_path, "--cpu-dry-run", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL 3. connector threads bound to the KV device" in done.stdout
    assert "engine-loop" in done.stdout.split("FAIL 3.")[1]
