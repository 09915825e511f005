"""The edge between vLLM's objects and kvbridge's: settings, KV cache config, requests, KV tensors.

Everything vLLM hands the adapter is translated here and nowhere else (docs/architecture.md,
"Inside vLLM"). Facts about vLLM 0.32.0 this relies on are measured in ``tests/vllm_probe``
(``VLLM_API_NOTES.md``): the CPU attention backend's per-layer cache is block-major
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K stored transposed in the first half
of each head's run); FlashAttention's (vllm/v1/attention/backends/flash_attn.py,
``get_kv_cache_shape``) is K/V-split ``[2, num_blocks, block_size, num_kv_heads, head_size]``,
allocated in its ``get_kv_cache_stride_order`` (``(0, 1, 2, 3, 4)`` for the "NHD" cache layout,
``(0, 1, 3, 2, 4)`` for "HND") and handed to the connector permuted back to that shape; a
request's ``kv_transfer_params`` is its ``SamplingParams.extra_args``
dict (the same object), and ``request.block_hashes`` lists one hash per full block.

This module imports nothing of vLLM: it reads vLLM's objects by attribute, so its functions are
tested without a vLLM install.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from kvbridge.kvmanager.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from ..config import KVTransferConfig
from ..errors import KVTransferConfigError

__all__ = [
    "NOT_IN_VLLM",
    "VLLM_MIN_REMOTE_HIT_TOKENS",
    "KVCacheRegions",
    "blocks_first_views",
    "config_from_vllm",
    "kv_cache_config_from_vllm",
    "kv_cache_regions",
    "kv_groups_name",
    "kv_layout_name",
    "refuse_unsupported_layout",
]


NOT_IN_VLLM = {
    "offload": (
        "offload 'write_through' copies every block vLLM computes; inside vLLM only 'evict' "
        "(blocks near the cold end of vLLM's free queue, before vLLM reuses them) is offered"
    ),
}
"""Extra-config values refused in vLLM, each with why (``config_from_vllm``). ``index_url``,
``store_url`` and ``offload: "evict"`` are accepted: the adapter follows vLLM's block pool
(``pool_follower.py``) and plans offloads over its free queue (``offload_pool.py``)."""

_ALLOWED_IN_VLLM = {"offload": (None, "off", "evict")}

VLLM_MIN_REMOTE_HIT_TOKENS = 256
"""``min_remote_hit_tokens`` of a vLLM engine unless its extra config says otherwise: a pull
costs the transfer and one more engine step before the request runs, about what prefilling
this many tokens costs on the suite's tiny model; below it, recomputing is as fast and moves
nothing (the measurements: ``docs/vllm-prefix-reuse.md``)."""


def config_from_vllm(
    kv_transfer_config: Any, *, model_name: str, model_revision: str = ""
) -> KVTransferConfig:
    """kvbridge's settings from vLLM's ``KVTransferConfig`` (``kv_role``, ``engine_id``,
    ``kv_connector_extra_config``); ``model_name`` (vLLM's served model) is the default of the
    extra key of that name, ``model_revision`` (``engine_identity.model_revision_of``) the
    value of that key (the extra config may name one only where vLLM knows none, e.g. a model
    from a local path).

    Raises:
        KVTransferConfigError: an unknown or bad key, a ``load_failure_policy`` or
            ``model_revision`` in the extra config that contradicts vLLM's own (vLLM applies
            its own; two answers to one question are refused), or a value refused inside
            vLLM (``NOT_IN_VLLM``: ``offload: "write_through"``).
    """
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    for key, value in extra.items():
        if key in NOT_IN_VLLM and value not in _ALLOWED_IN_VLLM[key]:
            raise KVTransferConfigError(
                f"kv_connector_extra_config.{key}={value!r}: not supported inside vLLM "
                f"({NOT_IN_VLLM[key]})"
            )
    vllm_policy = getattr(kv_transfer_config, "kv_load_failure_policy", None)
    ours = extra.get("load_failure_policy")
    if ours is not None and vllm_policy is not None and ours != vllm_policy:
        raise KVTransferConfigError(
            f"kv_connector_extra_config.load_failure_policy={ours!r} contradicts "
            f"kv_load_failure_policy={vllm_policy!r}: vLLM applies its own; set that one"
        )
    if vllm_policy is not None:
        extra["load_failure_policy"] = vllm_policy
    extra.setdefault("model_name", model_name)
    ours = extra.get("model_revision")
    if model_revision and ours not in (None, "", model_revision):
        raise KVTransferConfigError(
            f"kv_connector_extra_config.model_revision={ours!r} contradicts the revision vLLM "
            f"loaded, {model_revision!r}: leave it out (it is read from vLLM)"
        )
    if model_revision:
        extra["model_revision"] = model_revision
    extra.setdefault("min_remote_hit_tokens", VLLM_MIN_REMOTE_HIT_TOKENS)
    role = kv_transfer_config.kv_role
    return KVTransferConfig.from_dict(
        {
            "kv_connector": kv_transfer_config.kv_connector or "KVBridgeConnector",
            "kv_role": getattr(role, "value", role) or "kv_both",
            "engine_id": kv_transfer_config.engine_id or "vllm",
            "kv_connector_extra_config": extra,
        }
    )


def refuse_unsupported_layout(vllm_config: Any) -> None:
    """Refuse, naming the setting, a parallel layout the connector does not serve; the
    adapter calls it first thing, so a refused engine has no transport, thread or port of
    kvbridge's. Served: tensor parallelism (each rank moves the KV heads it holds). Refused:

    - ``pipeline_parallel_size`` > 1: a rank holds some layers only, and tickets name no
      pipeline stage;
    - ``data_parallel_size`` > 1: data-parallel engines would share one ``engine_id``;
    - ``decode_context_parallel_size`` / ``prefill_context_parallel_size`` > 1: a rank holds
      part of each block's tokens;
    - MLA models (``use_mla``): one latent KV replicated on every rank, which the head-sliced
      handoff does not model.

    Raises:
        KVTransferConfigError: one line naming the first refused setting and its value.
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in (
        "pipeline_parallel_size",
        "data_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        value = getattr(parallel, name, 1)
        if isinstance(value, int) and value > 1:
            raise KVTransferConfigError(
                f"{name}={value}: kvbridge moves KV between engines split by tensor parallelism "
                "only; run it with this setting at 1"
            )
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "use_mla", False) is True:
        raise KVTransferConfigError(
            "use_mla=True: kvbridge does not move an MLA model's latent KV yet; use a model "
            "with multi-head / grouped-query attention"
        )


def _torch_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype).removeprefix("torch."))


def kv_cache_config_from_vllm(kv_cache_config: Any) -> KVCacheConfig:
    """kvbridge's ``KVCacheConfig`` for vLLM's: the same block count, groups, layer names and
    per-layer block geometry (``page_size_bytes`` agrees with vLLM's for attention specs).

    Raises:
        KVTransferConfigError: a group whose spec is not (sliding-window) attention (Mamba,
            cross-attention and others are not transferred yet).
    """
    groups = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if not hasattr(spec, "num_kv_heads") or "Mamba" in kind or "Cross" in kind:
            raise KVTransferConfigError(
                f"KV cache group {group_id} is {kind}: kvbridge moves attention KV only"
            )
        geometry = {
            "block_size": int(spec.block_size),
            "num_kv_heads": int(spec.num_kv_heads),
            "head_size": int(spec.head_size),
            "dtype": _torch_dtype(spec.dtype),
        }
        window = getattr(spec, "sliding_window", None)
        ours = (
            SlidingWindowSpec(**geometry, sliding_window=int(window))
            if "SlidingWindow" in kind
            else FullAttentionSpec(**geometry)
        )
        groups.append(KVCacheGroupSpec(list(group.layer_names), ours))
    return KVCacheConfig(num_blocks=int(kv_cache_config.num_blocks), kv_cache_groups=groups)


def kv_layout_name(
    backend: str, tensor: torch.Tensor, total_num_kv_heads: int | None = None
) -> str:
    """The handshake's name of a vLLM cache layout: the attention backend and the per-block
    shape, so two engines whose bytes are arranged differently refuse each other. With
    ``total_num_kv_heads``, a head-major block (``[num_blocks, heads, ...]``, the CPU
    backend's) names the model's heads in place of the rank's, so ranks of engines of
    different tensor-parallel sizes name one layout."""
    shape = [int(s) for s in tensor.shape[1:]]
    if total_num_kv_heads is not None and _heads_first(tensor):
        shape[0] = total_num_kv_heads
    block_shape = ",".join(map(str, shape))
    return f"vllm:{backend}:blocks_first[{block_shape}]:{str(tensor.dtype).removeprefix('torch.')}"


def _heads_first(tensor: torch.Tensor) -> bool:
    """A block-major ``[num_blocks, heads, block_size, 2 * head_size]`` cache (the CPU
    backend's, ``VLLM_API_NOTES.md``): each head's run is one byte range of a block."""
    return tensor.dim() == 4


def blocks_first_views(
    kv_caches: Mapping[str, torch.Tensor], config: KVCacheConfig
) -> dict[str, torch.Tensor]:
    """Each layer's cache as the ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` view
    kvbridge's transport moves (the same memory: a block's bytes are copied whole, never
    interpreted, so the view only has to agree on a block's size).

    A K/V-split cache (FlashAttention's ``[2, num_blocks, ...]``) has no such view: it is two
    regions per layer (``kv_cache_regions``).

    Raises:
        KVTransferConfigError: a layer that is not block-major and contiguous, or whose block
            holds another number of elements than its spec says.
    """
    views: dict[str, torch.Tensor] = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            tensor = kv_caches[name]
            if tensor.shape[0] != config.num_blocks or not tensor.is_contiguous():
                raise KVTransferConfigError(
                    f"layer {name}: cache of shape {tuple(tensor.shape)} is not block-major and "
                    f"contiguous over {config.num_blocks} blocks; this layout is not supported"
                )
            shape = (config.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
            if tensor[0].numel() != 2 * spec.block_size * spec.num_kv_heads * spec.head_size:
                raise KVTransferConfigError(
                    f"layer {name}: a block of {tuple(tensor.shape[1:])} is not "
                    f"{shape[1:]} worth of elements"
                )
            views[name] = tensor.view(shape)
    return views


_IN_BLOCK_AXES = "NHD"  # a K/V half's block axes after the block id: token, head, head dim


class KVCacheRegions(NamedTuple):
    """vLLM's KV tensors as kvbridge's worker half registers them.

    Attributes:
        regions_by_layer: layer name -> that layer's block-major regions, each
            ``[num_blocks, 2, block_size, num_kv_heads, n]`` over vLLM's own memory, so that row
            ``b`` of a region is one contiguous run of block ``b``'s bytes: one region for a
            block-major layer (``blocks_first_views``), two for a K/V-split one (K, then V;
            there axis 1 is not K/V and ``n = head_size / 2``: the shape only carries a half
            block's element count and the block size to the transport, which moves rows whole
            and never interprets them).
        kv_layout: the handshake's name of the bytes' real arrangement (backend, kind, per-block
            geometry, in-block axis order, dtype); two engines whose names differ refuse each
            other naming ``kv_layout``. With the model's KV head count given, the name counts
            the model's heads, not the rank's (the same on every rank of any TP size).
        heads_sliceable: a run of the rank's KV heads is one byte range of each region row
            (heads outermost in a block: the CPU backend's ``[heads, block_size, ...]``, a
            K/V-split "HND" cache; or a single head), so a read may move part of a row.
    """

    regions_by_layer: dict[str, tuple[torch.Tensor, ...]]
    kv_layout: str
    heads_sliceable: bool = False


def kv_cache_regions(
    kv_caches: Mapping[str, torch.Tensor], config: KVCacheConfig, *, backend: str,
    total_num_kv_heads: int | None = None,
) -> KVCacheRegions:
    """The regions and layout name of vLLM's per-layer caches, for ``register_kv_caches``.

    Two layouts are moved, one per node (every layer has the first layer's):

    - block-major: ``[num_blocks, ...]`` contiguous (the CPU backend), exactly as
      ``blocks_first_views`` (a cache whose first axis is both ``2`` and ``num_blocks`` reads
      as block-major);
    - K/V-split: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (FlashAttention),
      whose K half and V half are each block-major with every block one dense run of bytes, in
      any order of the in-block axes (vLLM's "NHD" and "HND" stride orders both qualify; the
      order is part of the name). The half ``[i, b]`` is row ``b`` of region ``i``::

          tensor[0] (K): | block 0 | block 1 | ... |   -> region 0, row b = K of block b
          tensor[1] (V): | block 0 | block 1 | ... |   -> region 1, row b = V of block b

    Raises:
        KVTransferConfigError: naming the layer and its shape: a cache in neither layout (a
            half whose blocks are not dense runs, a permuted order with the block axis
            inside), a geometry other than the spec's, or layers of different layouts.
    """
    first_name = config.kv_cache_groups[0].layer_names[0]
    first = kv_caches[first_name]
    groups = kv_groups_name(config)
    num_kv_heads = config.kv_cache_groups[0].kv_cache_spec.num_kv_heads
    if not _is_kv_split(first, config.num_blocks):
        views = blocks_first_views(kv_caches, config)
        heads_first = _heads_first(first) and int(first.shape[1]) == num_kv_heads
        return KVCacheRegions(
            {name: (view,) for name, view in views.items()},
            kv_layout_name(backend, first, total_num_kv_heads if heads_first else None) + groups,
            heads_sliceable=heads_first or num_kv_heads == 1,
        )
    regions: dict[str, tuple[torch.Tensor, ...]] = {}
    first_order = None
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            tensor = kv_caches[name]
            if not _is_kv_split(tensor, config.num_blocks):
                raise KVTransferConfigError(
                    f"layer {name}: cache of shape {tuple(tensor.shape)} is not K/V-split like "
                    f"layer {first_name} {tuple(first.shape)}: one node moves one layout"
                )
            regions[name], order = _kv_split_halves(name, tensor, group.kv_cache_spec)
            first_order = order if first_order is None else first_order
            if order != first_order:
                raise KVTransferConfigError(
                    f"layer {name}: cache of shape {tuple(tensor.shape)} orders a block "
                    f"{order}, layer {first_name} {first_order}: one node moves one layout"
                )
    shape = [int(s) for s in first.shape[2:]]  # (block_size, heads, head_size)
    if total_num_kv_heads is not None:
        shape[1] = total_num_kv_heads
    block_shape = ",".join(map(str, shape))
    dtype = str(first.dtype).removeprefix("torch.")
    assert first_order is not None
    return KVCacheRegions(
        regions, f"vllm:{backend}:kv_split[{block_shape}]:{first_order}:{dtype}{groups}",
        heads_sliceable=num_kv_heads == 1 or first_order.startswith("H"),
    )


def kv_groups_name(config: KVCacheConfig) -> str:
    """The handshake's name of a hybrid node's KV cache groups, appended to its ``kv_layout``:
    ``"|groups=sw64:2,full:2"`` (each group's attention kind, window and number of layers, in
    group order), so that two nodes whose group ``g`` holds different layers' kinds refuse
    each other; ``""`` for one group (the name a single-group node always had).

    Several groups are vLLM's hybrid allocator, whose layers of different groups may share one
    tensor (``KVCacheConfig.kv_cache_tensors``: one tensor per layer position, shared by a
    layer of each group). That is safe to move per group: a block id belongs to one group at
    a time, and a read of group ``g``'s block ``b`` moves row ``b`` of ``g``'s layers only.
    """
    if len(config.kv_cache_groups) < 2:
        return ""
    kinds = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = "full" if window is None else f"sw{window}"
        kinds.append(f"{kind}:{len(group.layer_names)}")
    return "|groups=" + ",".join(kinds)


def _is_kv_split(tensor: torch.Tensor, num_blocks: int) -> bool:
    """A ``[2, num_blocks, ...]`` 5-d cache that is not also a contiguous block-major one."""
    block_major = tensor.shape[0] == num_blocks and tensor.is_contiguous()
    return tensor.dim() == 5 and tuple(tensor.shape[:2]) == (2, num_blocks) and not block_major


def _kv_split_halves(
    name: str, tensor: torch.Tensor, spec: Any
) -> tuple[tuple[torch.Tensor, torch.Tensor], str]:
    """The K and V regions of one K/V-split layer and its in-block axis order (e.g. ``"NHD"``;
    axes of size 1 are left out: they do not move bytes)."""
    num_blocks = tensor.shape[1]
    geometry = (spec.block_size, spec.num_kv_heads, spec.head_size)
    if tuple(tensor.shape[2:]) != geometry or spec.head_size % 2:
        raise KVTransferConfigError(
            f"layer {name}: K/V-split cache of shape {tuple(tensor.shape)} is not "
            f"(2, {num_blocks}, *{geometry}) with an even head_size; not supported"
        )
    halves = []
    for half in (tensor[0], tensor[1]):
        # In-block axes by falling stride (ties keep their order): dense iff this permutation
        # is contiguous, which also puts the block axis outermost with no gap between blocks.
        axes = sorted((1, 2, 3), key=lambda axis: -half.stride(axis))
        dense = half.permute(0, *axes)
        if not dense.is_contiguous():
            raise KVTransferConfigError(
                f"layer {name}: K/V-split cache of shape {tuple(tensor.shape)} with strides "
                f"{tensor.stride()}: a half's blocks are not dense block-major runs; "
                "this layout is not supported"
            )
        halves.append(dense.view(num_blocks, 2, spec.block_size, spec.num_kv_heads, -1))
    order = "".join(_IN_BLOCK_AXES[axis - 1] for axis in axes if tensor.shape[axis + 1] > 1)
    return (halves[0], halves[1]), order
