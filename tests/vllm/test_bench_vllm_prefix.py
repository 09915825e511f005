"""benchmarks/bench_vllm_prefix.py still runs: its ``--smoke`` form (the suite's tiny Llama, two
prompts of 512 tokens, bursts of 8) with the cross-instance, LMCache and scheduler rows; and
``_prefix_engines.spawned_engine``, which starts the LMCache row's engines, starts an engine
whose connector module imports ``numba`` (as LMCache's does) and decodes a plain vLLM's tokens.

Checked on its last line (one JSON object): B pulled every prefix A served through the index
(warm-up included) and decoded a plain vLLM's tokens (no mismatch, exit code 0); the three
first-token figures and the scheduler's are measured; the LMCache row is skipped, saying why,
when no LMCache venv is named; the replay row is off by default. The figures themselves are
not checked: this host's load moves them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm_prefix.py"
sys.path.insert(0, str(BENCH.parent))  # its sibling _prefix_engines, as when run as a script

from _prefix_engines import spawned_engine  # noqa: E402
from _prompts import N_NEW, PROMPTS  # noqa: E402


def test_the_smoke_run_pulls_every_prefix_with_a_plain_vllm_s_tokens_and_reports_each_row():
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_LMCACHE_PYTHON"}
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--rows", "cross", "lmcache",
                           "sched"], capture_output=True, text=True, timeout=400, env=env)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["mismatches"] == 0, tail
    assert report["b_index_hits"] == report["prompts"] + 1, tail  # prompt 0 warms up
    assert report["b_remote_hit_tokens"] == (report["prompts"] + 1) * report["tokens"]
    for case in ("cross", "recompute", "local"):
        assert report["ttft_p50_s"][case] > 0, case
    assert report["cross_over_recompute"] > 0 and report["cross_over_local"] > 0
    assert report["lmcache"].startswith("no LMCache venv named"), report["lmcache"]
    assert report["cross_over_lmcache"] is None
    assert report["restore"] == "not run: --rows"
    assert report["sched"]["index"]["index_lookups"] > 0  # the index was asked, nobody held
    assert report["sched"]["index"]["index_hits"] == 0
    assert report["sched_index_over_off"] > 0
    assert report["replay"] == "not run: --replay 0"


def test_an_engine_whose_connector_imports_numba_starts_spawned_and_decodes_plain_vllm_s_tokens(
        tiny_llama, log_dir, reference, tmp_path):
    # In process, vLLM 0.32.0 fails such an engine at start (its Triton-override scan trips on
    # llvmlite, loaded with the connector's module): the LMCache row never ran.
    connector = {"kv_connector": "NumbaImportingConnector",
                 "kv_connector_module_path": "_numba_connector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    node = spawned_engine("numba-connector", str(tiny_llama), log_dir, connector=connector)
    try:
        node.wait_ready()
        (out,) = node.generate([{"prompt_token_ids": PROMPTS["t64"], "max_tokens": N_NEW,
                                 "kv_transfer_params": None}])
    finally:
        node.stop()
    assert out["token_ids"] == reference["t64"]
