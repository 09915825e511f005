"""What one vLLM worker rank registers: its KV caches as kvbridge's regions, with the attention
backends' names in the layout, and its place among the tensor-parallel ranks (``TPLayout``: the
KV heads its cache holds). Called from ``KVBridgeConnector.register_kv_caches`` on the worker
thread; reads vLLM's config and parallel state, mutates nothing."""

from __future__ import annotations

from typing import Any

import torch
from kvbridge.kvmanager.kv_cache_spec import KVCacheConfig

from ..tp_layout import TPLayout
from .translate import KVCacheRegions, kv_cache_regions

__all__ = ["rank_regions"]


def rank_regions(
    vllm_config: Any, kv_caches: dict[str, torch.Tensor], ours: KVCacheConfig
) -> tuple[KVCacheRegions, TPLayout]:
    """The caches as regions (``translate.kv_cache_regions``), named with the device and vLLM's
    attention backends of the layers (as vLLM's NIXL connector: two backends are two layouts,
    shapes alike or not), and this rank's ``TPLayout``. Raises as ``kv_cache_regions``."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    first = next(iter(kv_caches.values()))
    names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    backend = f"{first.device.type}-{'+'.join(names)}"
    total = int(vllm_config.model_config.get_total_num_kv_heads())
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    tp_rank = 0
    if tp_size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = int(get_tensor_model_parallel_rank())
    regions = kv_cache_regions(kv_caches, ours, backend=backend, total_num_kv_heads=total)
    layout = TPLayout(tp_rank=tp_rank, tp_size=tp_size, total_num_kv_heads=total,
                      heads_sliceable=regions.heads_sliceable)
    return regions, layout
