"""``import kvbridge`` and the vLLM adapter's package never import vLLM (docs/architecture.md,
"Inside vLLM"): only resolving ``KVBridgeConnector`` (``adapter.py``) does. Checked in a fresh
interpreter, since this test process may already hold modules other tests imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
import kvbridge
import kvbridge.connector
import kvbridge.connector.vllm
import kvbridge.connector.vllm.translate
print(json.dumps({
    "vllm_modules": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")),
    "adapter_loaded": "kvbridge.connector.vllm.adapter" in sys.modules,
    "package_file": kvbridge.connector.vllm.__file__,
}))
"""


def test_importing_kvbridge_and_its_vllm_package_does_not_import_vllm():
    # The interpreter that runs this suite (with kvbridge importable, the way the suite's is);
    # on the main suite's Python vLLM is not even installed, but the check holds either way.
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["vllm_modules"] == [], seen
    assert seen["adapter_loaded"] is False, seen  # the class is resolved lazily (__getattr__)


def test_asking_for_the_connector_class_without_vllm_names_the_missing_module():
    """Where vLLM is not installed, only the class lookup needs it, and says so."""
    probe = ("import importlib.util, sys\n"
             "if importlib.util.find_spec('vllm') is not None: sys.exit(3)\n"
             "import kvbridge.connector.vllm as m\n"
             "m.KVBridgeConnector\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode == 3:
        pytest.skip("vLLM is installed in this Python")
    assert done.returncode != 0
    assert "No module named 'vllm'" in done.stderr, done.stderr
