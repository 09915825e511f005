"""The P/D main job's inputs and report, in process: the trace expansion, ``pd_pair``'s checks of
its inputs (one-line errors, no silent fallback) and the report's percentile."""

from __future__ import annotations

import json

import pytest
from _serve_builders import BLOCK_SIZE
from kvbridge.connector.serve.demo import pd_pair
from kvbridge.connector.serve.demo.processes import free_port
from kvbridge.connector.serve.demo.report import percentile
from kvbridge.connector.serve.demo.workload import trace_requests


# ---------------------------------------------------------------------- workload and report
def test_trace_expansion_keeps_shared_prefixes_and_scales_lengths(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 40, "hash_ids": [7, 8]},
        {"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [7, 9]},
        {"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [7]},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    out = list(trace_requests(trace, block_size=BLOCK_SIZE, limit=10, max_output_tokens=16,
                              max_prompt_tokens=1000))
    # 1024 tokens at 512 per block = 2 blocks -> 32 tokens; 1000 -> ceil(31.25) = 32; 1 -> 1.
    assert [len(r.prompt_token_ids) for r in out] == [32, 32, 1]
    assert [r.output_tokens for r in out] == [16, 3, 1]  # capped by max_output_tokens
    # Hash id 7 expands to the same 16 tokens everywhere; 8 and 9 differ.
    assert out[0].prompt_token_ids[:16] == out[1].prompt_token_ids[:16]
    assert out[0].prompt_token_ids[16:] != out[1].prompt_token_ids[16:]
    assert out[2].prompt_token_ids == out[0].prompt_token_ids[:1]
    assert len(list(trace_requests(trace, block_size=BLOCK_SIZE, limit=1, max_output_tokens=4,
                                   max_prompt_tokens=100))) == 1


# ---------------------------------------------------------------------- pd_pair's inputs
def _run_pd_pair(capsys, *argv: str) -> tuple[int, list[str], str]:
    """``pd_pair.run`` in process: (exit code, stderr lines, last stdout line)."""
    code = pd_pair.run(pd_pair.parse_args(["--no-progress", *argv]))
    out, err = capsys.readouterr()
    return code, err.splitlines(), out.splitlines()[-1]


def test_pd_pair_missing_trace_is_one_line_naming_the_source(capsys, tmp_path):
    missing = tmp_path / "conversation_trace.jsonl"
    code, err, last = _run_pd_pair(capsys, "--trace", str(missing), "--workdir", str(tmp_path))
    assert code == 2  # nothing was started
    assert err == [f"ERROR: --trace {missing}: no such file (the trace comes from the Mooncake "
                   "FAST'25 trace release: conversation_trace.jsonl in github.com/kvcache-ai/"
                   "Mooncake, folder FAST25-release/traces)"]
    assert json.loads(last)["usage_error"].startswith(f"--trace {missing}: no such file")


def test_pd_pair_trace_that_is_not_a_trace_is_one_line(capsys, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_length": 16}\n')  # no output_length, no hash_ids
    code, err, _ = _run_pd_pair(capsys, "--trace", str(trace), "--workdir", str(tmp_path))
    assert code == 2
    assert len(err) == 1
    assert err[0].startswith(f"ERROR: --trace {trace}: {trace}:1: not a Mooncake trace line")


def test_pd_pair_unreachable_redis_url_is_an_error_not_a_silent_fallback(capsys, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    code, err, last = _run_pd_pair(capsys, "--redis-url", url, "--workdir", str(tmp_path))
    assert code == 2
    assert len(err) == 1
    assert err[0].startswith(f"ERROR: --redis-url {url}: no Redis answered PING (")
    assert err[0].endswith("or pass --no-redis")
    assert list(tmp_path.iterdir()) == []  # no child was started, so no log was written
    assert json.loads(last)["errors"] == 1


def test_pd_pair_redis_url_and_no_redis_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pd_pair.parse_args(["--redis-url", "redis://127.0.0.1:6379/0", "--no-redis"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# ---------------------------------------------------------------------- the report
def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.5) is None
