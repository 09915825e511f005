"""The ``StoreProfile`` of kvbridge's own nodes of a model (``kernels.model.ModelConfig``): the
store of ``kvbridge-node`` engines fixed up front (``kvbridge-store --model``, ``StoreNode(model,
...)``), and host tensors laid out like theirs."""

from __future__ import annotations

import torch
from kvbridge.kernels.model import ModelConfig
from kvbridge.kvmanager.model_runner import make_kv_cache_config
from kvbridge.transport import BlockIdentity

from .profile import GroupGeometry, StoreProfile

__all__ = ["model_profile", "store_kv_caches"]


def model_profile(
    model_config: ModelConfig, *, block_size: int, model_name: str = "kvbridge",
    model_revision: str = "", hash_fn_name: str = "sha256_cbor",
) -> StoreProfile:
    """The ``StoreProfile`` of kvbridge's own nodes of ``model_config`` (their handshake's
    identity and geometry): per group, layers of ``[2, block_size, num_kv_heads, head_dim]``
    blocks of the model's dtype, in kvbridge's layout."""
    config = make_kv_cache_config(model_config, num_blocks=1, block_size=block_size)
    dtype = str(model_config.dtype).removeprefix("torch.")
    shape = (2, block_size, model_config.num_kv_heads, model_config.head_dim)
    return StoreProfile(
        identity=BlockIdentity(model_name=model_name, model_revision=model_revision,
                               kv_cache_dtype=dtype, block_size=block_size,
                               hash_fn_name=hash_fn_name),
        groups=tuple(GroupGeometry(num_layers=len(g.layer_names), block_shape=shape,
                                   dtype=dtype)  # type: ignore[arg-type]
                     for g in config.kv_cache_groups),
    )


def store_kv_caches(
    model_config: ModelConfig, *, block_size: int, capacity_bytes: int
) -> tuple[list[list[torch.Tensor]], int]:
    """Host KV tensors for a store of ``capacity_bytes`` of kvbridge's nodes of
    ``model_config`` (``model_profile``; ``StoreProfile.kv_caches``). Raises ValueError when
    the capacity holds no block."""
    return model_profile(model_config, block_size=block_size).kv_caches(capacity_bytes)
