"""Checks of the store tier's settings against a vLLM engine (issue 31 part 4), read from vLLM's
objects by attribute (no vLLM import, tested without vLLM)."""

from __future__ import annotations

from typing import Any

from ..config import KVTransferConfig
from ..errors import KVTransferConfigError

__all__ = ["check_store_tier"]


def check_store_tier(vllm_config: Any, config: KVTransferConfig) -> None:
    """Refuse ``store_url`` on an engine of several tensor- or pipeline-parallel ranks: every
    rank holds its own share of a block's KV under the same block hash, and one store keeps one
    block per hash, so a restore would hand each rank another rank's bytes. Reads
    ``vllm_config.parallel_config`` by attribute.

    Raises:
        KVTransferConfigError: naming ``store_url`` and the parallel sizes.
    """
    parallel = vllm_config.parallel_config
    sizes = (int(getattr(parallel, "tensor_parallel_size", 1)),
             int(getattr(parallel, "pipeline_parallel_size", 1)))
    if config.store_url and sizes != (1, 1):
        raise KVTransferConfigError(
            f"kv_connector_extra_config.store_url: an engine of tensor_parallel_size {sizes[0]} "
            f"and pipeline_parallel_size {sizes[1]} is not supported with the store tier yet "
            "(one store keeps one copy of a block hash, each rank holds another part of it)"
        )
