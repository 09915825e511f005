"""The proxy in front of two ``vllm serve`` (issue 13, "What must hold", last item).

``kvbridge-demo-vllm`` is the main job on vLLM: a single ``vllm serve`` answers every
request first (the reference), then P and D (two ``vllm serve`` with the kvbridge connector)
answer the same requests through ``kvbridge-proxy``'s ``/v1/completions``, half of them
streamed. A short run of it is the test: every answer, streamed or not, carries the reference's
tokens, D pulled KV for them, and P holds no block at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_DEMO = "kvbridge.connector.serve.demo.vllm_pd"
_RUN_TIMEOUT_S = 900  # three engine start-ups (10-60 s each here) and 8 short requests


@pytest.mark.timeout(_RUN_TIMEOUT_S + 60)
def test_proxy_over_two_vllm_serve_answers_streamed_and_not_with_the_single_instance_tokens(
    tmp_path,
):
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", _DEMO, "--conversations", "4", "--turns", "2", "--max-tokens", "8",
         "--stream-every", "2", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=_RUN_TIMEOUT_S,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["mismatches"] == 0 and report["errors"] == 0, tail
    assert report["kv_tokens_pulled"] > 0
    assert not report["p_kv_cache_usage_after"]
    rows = [json.loads(line) for line in (workdir / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert {row["stream"] for row in rows} == {True, False}  # both kinds went through the proxy
    assert all(row["equal"] and row["error"] is None for row in rows), rows
