"""kvbridge.connector.vllm: the connector a stock vLLM loads.

    kv_transfer_config = {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.connector.vllm",
        "kv_role": "kv_producer",            # or "kv_consumer", "kv_both"
        "engine_id": "prefill-0",
        "kv_connector_extra_config": {...},  # the keys of kvbridge's own nodes
    }

vLLM's ``KVConnectorFactory`` imports this module and takes ``KVBridgeConnector`` from it; the
class (``adapter.py``) imports vLLM, so it is resolved lazily here: ``import kvbridge`` and the
translation helpers (``translate.py``) never need vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        from .adapter import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
