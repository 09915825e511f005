"""Checks of the store tier's settings against a vLLM engine (issue 31 part 4, issue 30 part 3),
read from vLLM's objects by attribute (no vLLM import, tested without vLLM)."""

from __future__ import annotations

from typing import Any

from ..config import KVTransferConfig
from ..errors import KVTransferConfigError

__all__ = ["check_store_tier"]


def check_store_tier(vllm_config: Any, config: KVTransferConfig) -> None:
    """Refuse ``store_url`` on an engine of several pipeline-parallel ranks: a rank holds some
    layers of a block only, and the store keeps whole blocks. Tensor-parallel engines are
    served: every rank writes its own KV heads of each block and the store holds a block once
    all its heads are written (docs/vllm-prefix-reuse.md, "Tensor-parallel engines and the
    store"). Reads ``vllm_config.parallel_config`` by attribute.

    Raises:
        KVTransferConfigError: naming ``store_url`` and ``pipeline_parallel_size``.
    """
    pipeline = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if config.store_url and pipeline != 1:
        raise KVTransferConfigError(
            f"kv_connector_extra_config.store_url: an engine of pipeline_parallel_size "
            f"{pipeline} is not supported with the store tier (a rank holds some layers of a "
            "block, the store keeps whole blocks); use pipeline_parallel_size 1"
        )
