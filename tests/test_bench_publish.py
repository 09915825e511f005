"""benchmarks/bench_publish.py runs end to end on a short setting and reports every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_publish.py"


def test_the_publish_benchmark_reports_its_ratios_from_one_run() -> None:
    out = subprocess.run([sys.executable, str(_BENCH), "--repeats", "2", "--steps", "5",
                          "--requests", "2", "--blocks-per-request", "4"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["benchmark"] == "index_publish" and report["blocks_per_publish"] == 8
    for name in ("publish", "ping", "pipeline"):
        assert report[f"{name}_cpu_us"] > 0 and report[f"{name}_server_us"] >= 0
    for ratio in ("publish_cpu_over_ping", "publish_cpu_over_pipeline", "follow_cpu_over_publish"):
        assert report[ratio] > 0
    assert report["follow_cpu_us"] > 0 and "follow in the listed set" in out
    assert "publish (PUBLISH script)" in out
