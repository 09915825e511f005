"""K/V-split caches (vLLM's FlashAttention layout) without a GPU: CPU tensors shaped and strided
as FlashAttention's ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (vLLM
vllm/v1/attention/backends/flash_attn.py, ``get_kv_cache_shape``; stride order ``(0, 1, 2, 3,
4)`` for the "NHD" cache layout, ``(0, 1, 3, 2, 4)`` for "HND": the memory is allocated in that
order and handed over permuted back to the logical shape).

(a) the regions alias the right memory; (b) a pull between two worker halves moves both halves
of exactly the requested blocks; (c) peers of another layout or geometry are refused by field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvbridge.connector import KVTransferConfig, KVTransferConfigError
from kvbridge.connector.loop_thread import get_loop_thread
from kvbridge.connector.vllm.translate import kv_cache_config_from_vllm, kv_cache_regions
from kvbridge.connector.worker_half import KVBridgeWorker
from kvbridge.transport import GroupRead, HandshakeError, LeaseRef, LoopbackNetwork

BLOCK_SIZE, HEADS, HEAD_SIZE, NUM_BLOCKS = 16, 2, 8, 10
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
_TIMEOUT_S = 20.0


class FullAttentionSpec(SimpleNamespace):
    """Stands in for vLLM's spec of that name (the translation reads the class name)."""


def _vllm_cache_config(*, num_layers: int = 2, block_size: int = BLOCK_SIZE, heads: int = HEADS):
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float32
    )
    group = SimpleNamespace(layer_names=LAYERS[:num_layers], kv_cache_spec=spec)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[group])


def _flash_cache(order: str = "NHD", *, block_size: int = BLOCK_SIZE, heads: int = HEADS):
    """One layer's FlashAttention cache, logical ``[2, blocks, block_size, heads, head_size]``,
    allocated in the stride order of vLLM's ``order`` cache layout; distinct values everywhere."""
    numel = 2 * NUM_BLOCKS * block_size * heads * HEAD_SIZE
    values = torch.arange(numel, dtype=torch.float32) + 1.0
    if order == "NHD":
        return values.view(2, NUM_BLOCKS, block_size, heads, HEAD_SIZE)
    physical = values.view(2, NUM_BLOCKS, heads, block_size, HEAD_SIZE)
    return physical.permute(0, 1, 3, 2, 4)  # HND: stride order (0, 1, 3, 2, 4)


def _cpu_cache():
    """vLLM's CPU attention cache of one layer: ``[blocks, heads, block_size, 2 * head_size]``."""
    return torch.randn(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)


# ---------------------------------------------------------------- (a) regions alias the cache
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_split_layer_registers_a_k_region_and_a_v_region_over_vllm_memory(order):
    config = kv_cache_config_from_vllm(_vllm_cache_config(num_layers=1))
    cache = _flash_cache(order)
    regions = kv_cache_regions({LAYERS[0]: cache}, config, backend="cuda-attn")
    k_region, v_region = regions.regions_by_layer[LAYERS[0]]
    # A half block is 16 tokens x 2 heads x 8 dims; the transport sees it as (2, 16, 2, 4).
    assert k_region.shape == v_region.shape == (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE // 2)
    assert k_region.is_contiguous() and v_region.is_contiguous()
    assert (k_region.data_ptr(), v_region.data_ptr()) == (cache[0].data_ptr(), cache[1].data_ptr())
    assert regions.kv_layout == f"vllm:cuda-attn:kv_split[16,2,8]:{order}:float32"


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_writing_block_through_the_regions_changes_exactly_that_blocks_k_and_v(order):
    config = kv_cache_config_from_vllm(_vllm_cache_config(num_layers=1))
    cache = _flash_cache(order)
    before = cache.clone()
    k_region, v_region = kv_cache_regions({LAYERS[0]: cache}, config, backend="cuda-attn")[0][
        LAYERS[0]
    ]
    k_region[5].fill_(-1.0)
    v_region[5].fill_(-2.0)
    expected = before.clone()
    expected[0, 5] = -1.0  # K of block 5, every token, head and dim
    expected[1, 5] = -2.0  # V of block 5
    assert torch.equal(cache, expected)  # and nothing else: blocks 4 and 6, other halves intact


def test_block_major_cpu_cache_keeps_its_single_view_and_name():
    config = kv_cache_config_from_vllm(_vllm_cache_config(num_layers=1))
    cache = _cpu_cache()
    regions = kv_cache_regions({LAYERS[0]: cache}, config, backend="cpu-attn")
    (view,) = regions.regions_by_layer[LAYERS[0]]
    assert view.shape == (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE)
    assert view.data_ptr() == cache.data_ptr()
    assert regions.kv_layout == "vllm:cpu-attn:blocks_first[2,16,16]:float32"  # as before


_CASES = {
    # a padded page: each half's blocks are 10-dim runs read 8 at a time, not dense
    "padded-half": (
        torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE + 2)[..., :HEAD_SIZE],
        "not dense block-major",
    ),
    # block axis inside a block's tokens: block b is not one run of bytes
    "block-axis-inside": (
        torch.zeros(2, BLOCK_SIZE, NUM_BLOCKS, HEADS, HEAD_SIZE).permute(0, 2, 1, 3, 4),
        "not dense block-major",
    ),
    # K/V axis inside the block (physically [blocks, 2, ...]) presented as [2, blocks, ...]
    "kv-axis-inside": (
        torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE).transpose(0, 1),
        "not dense block-major",
    ),
    "other-geometry": (torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE // 2), "is not"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_unsupported_split_layouts_are_refused_naming_layer_and_shape(case):
    cache, fragment = _CASES[case]
    config = kv_cache_config_from_vllm(_vllm_cache_config(num_layers=1))
    with pytest.raises(KVTransferConfigError, match=fragment) as refused:
        kv_cache_regions({LAYERS[0]: cache}, config, backend="cuda-attn")
    assert LAYERS[0] in str(refused.value) and str(tuple(cache.shape)) in str(refused.value)


def test_layers_of_different_layouts_are_refused_naming_the_layer():
    config = kv_cache_config_from_vllm(_vllm_cache_config())
    mixed = {LAYERS[0]: _flash_cache("NHD"), LAYERS[1]: _flash_cache("HND")}
    with pytest.raises(KVTransferConfigError, match=f"layer {LAYERS[1]}.*orders a block HND"):
        kv_cache_regions(mixed, config, backend="cuda-attn")
    mixed = {LAYERS[0]: _flash_cache(), LAYERS[1]: _cpu_cache()}
    with pytest.raises(KVTransferConfigError, match=f"layer {LAYERS[1]}.*not K/V-split"):
        kv_cache_regions(mixed, config, backend="cuda-attn")


# ---------------------------------------------------------------- (b) a pull over two halves
def _worker(engine_id, network, caches, *, backend="cuda-attn", **geometry):
    """A worker half over the loopback ``network`` with ``caches`` registered as vLLM's
    adapter does (``kv_cache_regions``)."""
    config = KVTransferConfig.from_dict(
        {
            "engine_id": engine_id,
            "kv_connector_extra_config": {"transport": "loopback", "model_name": "tiny"},
        }
    )
    ours = kv_cache_config_from_vllm(_vllm_cache_config(num_layers=len(caches), **geometry))
    worker = KVBridgeWorker(config, ours, hash_fn_name="sha256", loopback_network=network)
    regions = kv_cache_regions(dict(zip(LAYERS, caches, strict=False)), ours, backend=backend)
    worker.register_kv_caches(regions.regions_by_layer, kv_layout=regions.kv_layout)
    return worker


@pytest.fixture
def workers():
    built = []

    def build(*args, **kwargs):
        built.append(_worker(*args, **kwargs))
        return built[-1]

    yield build
    for worker in built:
        worker.shutdown()


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_pull_moves_k_and_v_of_exactly_the_requested_blocks(workers, order):
    network = LoopbackNetwork()
    p_caches = [_flash_cache(order), _flash_cache(order) * -1.0]  # layers differ
    d_caches = [torch.zeros_like(c) for c in p_caches]
    d_before = [c.clone() for c in d_caches]
    p = workers("prefill-0", network, p_caches)
    d = workers("decode-0", network, d_caches)
    remote_ids, local_ids = [3, 5, 6], [7, 1, 4]  # paired by position
    # P serves only blocks a hash or a lease vouches for: a lease on the three, no hashes.
    p.leases.grant("r1", [remote_ids], (), "tok-r1")
    read = GroupRead(
        group_id=0, remote_block_ids=remote_ids, local_block_ids=local_ids,
        expected_hashes=[b""] * len(remote_ids),
    )
    lease = LeaseRef(request_id="r1", token="tok-r1")
    result = get_loop_thread().run(
        d.transport.read_blocks(
            p.transport.address, "r1", [read], deadline_s=_TIMEOUT_S, lease=lease
        ),
        _TIMEOUT_S,
    )
    # 3 blocks x 2 layers x (K + V) x 16 tokens x 2 heads x 8 dims x 4 bytes
    assert (result.num_blocks_landed, result.num_bytes_landed, result.ok) == (3, 12288, True)
    for layer, (p_cache, d_cache) in enumerate(zip(p_caches, d_caches, strict=True)):
        expected = d_before[layer].clone()
        expected[:, local_ids] = p_cache[:, remote_ids]  # both halves of each pulled block
        assert torch.equal(d_cache, expected), f"layer {layer}"  # and no other block touched
    assert torch.equal(p_caches[0], _flash_cache(order))  # the holder's cache is only read


# ---------------------------------------------------------------- (c) handshake refusals
@pytest.mark.parametrize(
    ("peer", "field"),
    [
        (dict(caches=[_cpu_cache(), _cpu_cache()], backend="cpu-attn"), "kv_layout"),
        (dict(caches=[_flash_cache("HND"), _flash_cache("HND")]), "kv_layout"),
        (dict(caches=[_flash_cache(heads=4)] * 2, heads=4), "kv_layout"),  # head geometry
        (dict(caches=[_flash_cache(block_size=32)] * 2, block_size=32), "block_size"),
        (dict(caches=[_flash_cache()]), r"groups\[0\]\.num_layers"),
    ],
    ids=["block-major", "other-order", "heads", "block-size", "layer-count"],
)
def test_split_peer_of_another_layout_or_geometry_is_refused_naming_the_field(workers, peer, field):
    network = LoopbackNetwork()
    d = workers("decode-0", network, [_flash_cache(), _flash_cache()])
    caches = peer.pop("caches")
    p = workers("prefill-0", network, caches, **peer)
    with pytest.raises(HandshakeError, match=f"{field}: local"):
        get_loop_thread().run(d.transport.connect(p.transport.address), _TIMEOUT_S)
    same = workers("prefill-1", network, [_flash_cache(), _flash_cache()])
    get_loop_thread().run(d.transport.connect(same.transport.address), _TIMEOUT_S)  # accepted


# ---------------------------------------------------------------- tensor-parallel ranks
def test_a_cpu_rank_names_the_models_heads_and_is_sliceable():
    """A rank of a TP=2 engine holds 1 of the model's 2 heads: its layout name counts the
    model's 2, the same as a TP=1 engine's (so they pair), and a head run is a byte range."""
    config = kv_cache_config_from_vllm(_vllm_cache_config(num_layers=1, heads=1))
    rank = torch.randn(NUM_BLOCKS, 1, BLOCK_SIZE, 2 * HEAD_SIZE)
    regions = kv_cache_regions({LAYERS[0]: rank}, config, backend="cpu-attn",
                               total_num_kv_heads=HEADS)
    whole = kv_cache_regions({LAYERS[0]: _cpu_cache()},
                             kv_cache_config_from_vllm(_vllm_cache_config(num_layers=1)),
                             backend="cpu-attn", total_num_kv_heads=HEADS)
    assert regions.kv_layout == whole.kv_layout == "vllm:cpu-attn:blocks_first[2,16,16]:float32"
    assert regions.heads_sliceable and whole.heads_sliceable


@pytest.mark.parametrize(("order", "heads", "sliceable"), [
    ("NHD", 2, False),  # a head's run strides over the tokens: whole rows only
    ("HND", 2, True),  # heads outermost in each half: a run of heads is one byte range
    ("NHD", 1, True),  # one head: a row is that head
])
def test_a_split_cache_is_sliceable_when_heads_are_outermost(order, heads, sliceable):
    config = kv_cache_config_from_vllm(_vllm_cache_config(num_layers=1, heads=heads))
    cache = _flash_cache(order, heads=heads)
    regions = kv_cache_regions({LAYERS[0]: cache}, config, backend="cuda-attn",
                               total_num_kv_heads=4)
    assert regions.heads_sliceable is sliceable
    assert regions.kv_layout.startswith("vllm:cuda-attn:kv_split[16,4,8]:")  # the model's 4
