"""A KV connector whose module imports ``numba`` at the top, as LMCache 0.5.6's
``LMCacheMPConnector`` does (its ``token_hasher``): vLLM's ``ExampleConnector`` under another
name, loaded by ``kv_connector_module_path``. For test_bench_vllm_prefix.py's check that
``_prefix_engines.spawned_engine`` starts such an engine; never used by kvbridge.
"""

from __future__ import annotations

import numba  # noqa: F401 - the point: llvmlite is loaded before vLLM builds its worker
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class NumbaImportingConnector(ExampleConnector):
    """``ExampleConnector`` (``shared_storage_path`` in its extra config), from this module."""
