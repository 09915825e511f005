"""The vLLM edge without vLLM: settings, KV cache config, cache views and request views built
from stand-ins shaped like vLLM 0.32.0's objects (tests/vllm_probe/VLLM_API_NOTES.md)."""

from __future__ import annotations

import dataclasses
import enum
import random
from types import SimpleNamespace

import pytest
import torch
from kvbridge.connector import IndexNamespace, KVTransferConfigError
from kvbridge.connector.prompt_digest import prompt_digest
from kvbridge.connector.pull_plan import window_gap_groups
from kvbridge.connector.vllm.engine_identity import (
    XXHASH_ALGOS,
    engine_identity_fields,
    hash_root_id,
    kv_cache_dtype_of,
    local_weights_revision,
    model_revision_of,
    warn_unnamed_weights,
    weights_revision_of,
)
from kvbridge.connector.vllm.load_modes import load_mode_for
from kvbridge.connector.vllm.request_view import RequestView
from kvbridge.connector.vllm.store_tier import check_store_tier
from kvbridge.connector.vllm.translate import (
    VLLM_MIN_REMOTE_HIT_TOKENS,
    blocks_first_views,
    config_from_vllm,
    kv_cache_config_from_vllm,
    kv_cache_regions,
    kv_layout_name,
)
from kvbridge.kvmanager.request import RequestStatus
from kvbridge.transport import BlockIdentity, HandshakeError, NodeMetadata, check_compatible

BLOCK_SIZE, HEADS, HEAD_SIZE, NUM_BLOCKS = 32, 2, 32, 8


def _vllm_transfer_config(**extra):
    return SimpleNamespace(
        kv_connector="KVBridgeConnector",
        kv_role="kv_consumer",
        engine_id="decode-0",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="fail",
    )


class FullAttentionSpec(SimpleNamespace):
    """Stands in for vLLM's spec of that name (the translation reads the class name)."""


class MambaSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


def _vllm_cache_config(spec=None):
    spec = spec or FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    group = SimpleNamespace(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=spec)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[group])


def _cpu_cache(num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """vLLM's CPU attention cache of one layer: ``[blocks, heads, block_size, 2 * head_size]``."""
    return torch.randn(num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)


def test_settings_take_vllm_role_engine_id_and_failure_policy():
    config = config_from_vllm(_vllm_transfer_config(cma=False), model_name="tiny")
    # vLLM applies its own kv_load_failure_policy ("fail" by default): kvbridge reports the same.
    assert (config.kv_role.value, config.engine_id, config.cma) == (
        "kv_consumer",
        "decode-0",
        False,
    )
    assert (config.load_failure_policy, config.model_name) == ("fail", "tiny")


def test_a_contradicting_failure_policy_and_unknown_keys_are_refused_by_name():
    with pytest.raises(KVTransferConfigError, match="load_failure_policy='recompute'"):
        config_from_vllm(_vllm_transfer_config(load_failure_policy="recompute"), model_name="m")
    with pytest.raises(KVTransferConfigError, match="lease_sec"):
        config_from_vllm(_vllm_transfer_config(lease_sec=3), model_name="m")


class _ResolvedRevision(str):
    """Stands in for ``huggingface_hub.ResolvedRevision``: the revision asked for as its
    string value, the commit it resolved to in ``resolved`` (vLLM's ``model_config.revision``
    for a model from the Hub)."""

    def __new__(cls, initial: str, resolved: str):
        revision = super().__new__(cls, initial)
        revision.resolved = resolved
        return revision


@pytest.mark.parametrize(
    ("revision", "expected"),
    [
        (_ResolvedRevision("main", "5d0f2ab1" * 5), "5d0f2ab1" * 5),  # the commit "main" is now
        ("v1.1", "v1.1"),  # not resolved (a local path, offline): as given
        (None, ""),  # a local path without --revision: unknown
    ],
)
def test_the_model_revision_is_the_commit_vllm_loaded(revision, expected):
    model_config = SimpleNamespace(revision=revision, code_revision="c", tokenizer_revision="t")
    assert model_revision_of(model_config) == expected
    config = config_from_vllm(_vllm_transfer_config(), model_name="m", model_revision=expected)
    assert config.model_revision == expected


def test_weights_from_a_local_path_get_a_revision_of_their_bytes(tmp_path):
    """Weights from a local path have no revision of their own (vLLM's is None): the engine
    names them by their ``config.json`` and bytes sampled over each weight file. Copies of one
    checkpoint agree; a fine-tune (other bytes over a run of 1/1024 of a file) or another
    config does not, so it never shares blocks with them under the same served model name (it
    did: both had revision "", and decoded over each other's KV)."""
    rng = random.Random(0)
    weights = rng.randbytes(8 << 20)

    def checkpoint(name: str, data: bytes, config: bytes = b'{"layers": 4}') -> str:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_bytes(config)
        (directory / "model.safetensors").write_bytes(data)
        (directory / "tokenizer.json").write_bytes(name.encode())  # not weights: not read
        return str(directory)

    revision = local_weights_revision(checkpoint("a", weights))
    assert revision.startswith("local-") and len(revision) == len("local-") + 16
    assert local_weights_revision(checkpoint("copy", weights)) == revision
    run = len(weights) // 1024
    for start in (0, 3_000_001, len(weights) - run):  # any run that long, anywhere
        tuned = bytearray(weights)
        tuned[start:start + run] = bytes(run)
        assert local_weights_revision(checkpoint(f"tuned-{start}", bytes(tuned))) != revision
    assert local_weights_revision(checkpoint("config", weights, b'{"layers": 5}')) != revision
    (tmp_path / "empty").mkdir()
    for nothing in ("org/hub-model", str(tmp_path / "missing"), str(tmp_path / "empty")):
        assert local_weights_revision(nothing) == ""
    # What the adapter gives config_from_vllm: vLLM's revision first, then the extra config's
    # (applied there), then the local bytes.
    local = SimpleNamespace(model=str(tmp_path / "a"), revision=None)
    assert weights_revision_of(local, _vllm_transfer_config()) == revision
    assert weights_revision_of(local, _vllm_transfer_config(model_revision="ckpt-7")) == ""
    assert weights_revision_of(SimpleNamespace(model=str(tmp_path / "a"), revision="v1.1"),
                               _vllm_transfer_config()) == "v1.1"


@pytest.mark.parametrize(
    ("extra", "revision", "warned"),
    [
        ({"index_url": "redis://h:6379/0"}, "", True),  # local weights, shared by name alone
        ({"index_url": "redis://h:6379/0", "model_revision": "ckpt-7"}, "", False),
        ({"index_url": "redis://h:6379/0"}, "5d0f2ab1" * 5, False),  # the commit vLLM loaded
        ({}, "", False),  # P/D only: its peer is named by its operator
    ],
)
def test_an_index_shared_by_model_name_alone_is_said_at_start(extra, revision, warned, caplog):
    """Weights without a revision on a shared index: engines are told apart by the served
    model name alone (a fine-tune under the same name would be served blocks its weights never
    computed), so the engine says so once, naming the setting that tells weights apart."""
    config = config_from_vllm(_vllm_transfer_config(**extra), model_name="m",
                              model_revision=revision)
    model_config = SimpleNamespace(model="/models/m")
    with caplog.at_level("WARNING", logger="kvbridge.connector.vllm.engine_identity"):
        assert warn_unnamed_weights(config, model_config) is warned
    assert ("kv_connector_extra_config.model_revision" in caplog.text) is warned
    assert ("'/models/m'" in caplog.text) is warned


def test_a_model_revision_vllm_does_not_know_may_be_set_and_one_it_knows_not_contradicted():
    # A local path has no revision vLLM knows: the operator may name one for the identity.
    config = config_from_vllm(_vllm_transfer_config(model_revision="v2"), model_name="m")
    assert config.model_revision == "v2"
    with pytest.raises(KVTransferConfigError, match="model_revision='v2' contradicts"):
        config_from_vllm(
            _vllm_transfer_config(model_revision="v2"), model_name="m", model_revision="5d0f2ab1"
        )


@pytest.mark.parametrize(
    ("cache_dtype", "skip_layers", "expected"),
    [
        ("auto", [], "bfloat16"),  # the model's dtype: the bytes of a cache set to "bfloat16"
        ("bfloat16", [], "bfloat16"),
        ("fp8_e4m3", [], "fp8_e4m3"),
        ("fp8_e5m2", [], "fp8_e5m2"),
        ("fp8", [], "fp8"),  # not merged with fp8_e4m3: its variant depends on the platform
        ("fp8_e4m3", ["sliding_window", "0"], "fp8_e4m3+skip:0,sliding_window"),
    ],
)
def test_the_kv_cache_dtype_is_vllms_cache_dtype_with_auto_resolved(
    cache_dtype, skip_layers, expected
):
    cache_config = SimpleNamespace(cache_dtype=cache_dtype, kv_cache_dtype_skip_layers=skip_layers)
    assert kv_cache_dtype_of(cache_config, SimpleNamespace(dtype=torch.bfloat16)) == expected


def test_fp8_variants_in_equal_uint8_tensors_are_two_identities():
    # Issue 28 item 7: vLLM keeps fp8_e4m3 and fp8_e5m2 caches in uint8 tensors of one shape,
    # so the layout name (backend, shape, dtype "uint8") is the same for both. Before, the
    # handshake compared nothing else and two such nodes exchanged blocks (each read the
    # other's bytes in its own fp8 format); now the identity names the cache dtype.
    config = kv_cache_config_from_vllm(_vllm_cache_config(FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.uint8)))
    cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.uint8)
    regions = kv_cache_regions({"model.layers.0.self_attn.attn": cache}, config, backend="cpu-attn")
    node_a, node_b = (
        NodeMetadata.from_kv_caches(
            engine_id=f"node-{fmt}",
            kv_caches_by_group=[list(regions.regions_by_layer["model.layers.0.self_attn.attn"])],
            model_name="m", hash_fn_name="sha256", kv_layout=regions.kv_layout,
            kv_cache_dtype=kv_cache_dtype_of(SimpleNamespace(cache_dtype=fmt), None),
        )
        for fmt in ("fp8_e4m3", "fp8_e5m2")
    )
    with pytest.raises(HandshakeError, match="kv_cache_dtype: local 'fp8_e4m3', remote 'fp8_e5m2'"):
        check_compatible(node_a, node_b)
    namespaces = {IndexNamespace(identity=n.identity).key_prefix for n in (node_a, node_b)}
    assert len(namespaces) == 2


def test_kv_cache_config_keeps_blocks_layers_and_page_size():
    ours = kv_cache_config_from_vllm(_vllm_cache_config())
    spec = ours.kv_cache_groups[0].kv_cache_spec
    assert ours.num_blocks == NUM_BLOCKS
    assert ours.kv_cache_groups[0].layer_names == ["model.layers.0.self_attn.attn"]
    # 2 (K, V) x 32 tokens x 2 heads x 32 dims x 4 bytes: vLLM's page_size_bytes for this spec.
    assert spec.page_size_bytes == 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * 4 == 16384


def test_a_group_kvbridge_cannot_move_is_refused_naming_it():
    with pytest.raises(KVTransferConfigError, match="group 0 is MambaSpec"):
        kv_cache_config_from_vllm(_vllm_cache_config(MambaSpec(block_size=32)))


def test_views_share_memory_and_block_bytes():
    config = kv_cache_config_from_vllm(_vllm_cache_config())
    cache = _cpu_cache()
    view = blocks_first_views({"model.layers.0.self_attn.attn": cache}, config)[
        "model.layers.0.self_attn.attn"
    ]
    assert view.shape == (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE)
    assert view.data_ptr() == cache.data_ptr()
    # Block 5 of the view is block 5 of vLLM's cache, byte for byte.
    assert torch.equal(view[5].reshape(-1), cache[5].reshape(-1))


@pytest.mark.parametrize(
    ("cache", "fragment"),
    [
        (torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), "not block-major"),  # K|V split
        (_cpu_cache().transpose(1, 2), "not block-major"),  # not contiguous
        (torch.randn(NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE), "worth of elements"),
    ],
    ids=["kv-first", "strided", "half-a-block"],
)
def test_layouts_that_are_not_block_major_are_refused(cache, fragment):
    config = kv_cache_config_from_vllm(_vllm_cache_config())
    with pytest.raises(KVTransferConfigError, match=fragment):
        blocks_first_views({"model.layers.0.self_attn.attn": cache}, config)


def _metadata(kv_layout: str) -> NodeMetadata:
    config = kv_cache_config_from_vllm(_vllm_cache_config())
    views = blocks_first_views({"model.layers.0.self_attn.attn": _cpu_cache()}, config)
    return NodeMetadata.from_kv_caches(
        engine_id="e",
        kv_caches_by_group=[list(views.values())],
        model_name="m",
        hash_fn_name="sha256",
        kv_layout=kv_layout,
    )


def test_peers_whose_cache_layouts_differ_are_refused_naming_the_layout():
    cache = _cpu_cache()
    cpu = _metadata(kv_layout_name("cpu-attn", cache))
    other = _metadata(kv_layout_name("flash-attn", cache))
    check_compatible(cpu, _metadata(kv_layout_name("cpu-attn", cache)))  # same: accepted
    with pytest.raises(HandshakeError, match="kv_layout"):
        check_compatible(cpu, other)


def _hybrid_cache_config(window: int = 64):
    """vLLM's hybrid allocator for four layers, sliding-window and full taking turns: two
    groups, sliding first, sharing the block pool."""
    geometry = dict(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                    dtype=torch.float32)
    layer = "model.layers.{}.self_attn.attn".format
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=[layer(0), layer(2)],
                        kv_cache_spec=SlidingWindowSpec(**geometry, sliding_window=window)),
        SimpleNamespace(layer_names=[layer(1), layer(3)],
                        kv_cache_spec=FullAttentionSpec(**geometry)),
    ])


def test_hybrid_groups_share_tensors_and_name_their_kinds_in_the_layout():
    """vLLM's CPU runner binds layer i of each group to one shared tensor (a block id belongs
    to one group at a time): each layer's region is that tensor, and the layout name ends
    with the groups' kinds; a single group's name is the one it always was."""
    config = kv_cache_config_from_vllm(_hybrid_cache_config())
    assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == [
        "SlidingWindowSpec", "FullAttentionSpec"]
    shared = [_cpu_cache(), _cpu_cache()]
    caches = {f"model.layers.{i}.self_attn.attn": shared[i // 2] for i in range(4)}
    regions = kv_cache_regions(caches, config, backend="cpu-attn")
    (r0,), (r1,) = (regions.regions_by_layer[f"model.layers.{i}.self_attn.attn"] for i in (0, 1))
    assert r0.data_ptr() == r1.data_ptr() == shared[0].data_ptr()
    plain = kv_layout_name("cpu-attn", shared[0])
    assert regions.kv_layout == plain + "|groups=sw64:2,full:2"
    single = kv_cache_config_from_vllm(_vllm_cache_config())
    one = {"model.layers.0.self_attn.attn": shared[0]}
    assert kv_cache_regions(one, single, backend="cpu-attn").kv_layout == plain
    other = kv_cache_regions(caches, kv_cache_config_from_vllm(_hybrid_cache_config(128)),
                             backend="cpu-attn")
    with pytest.raises(HandshakeError, match="kv_layout"):
        check_compatible(_metadata(regions.kv_layout), _metadata(other.kv_layout))


# window 64, block 32: D computing token e - 1 next keeps sliding blocks from (e - 64) // 32
@pytest.mark.parametrize(
    ("num_prompt_tokens", "sliding", "gaps"),
    [
        (300, [0] * 7 + [7, 8, 9], []),  # D needs blocks 7-9 (positions 235..298): P has them
        (319, [0] * 8 + [8, 9], [0]),  # D needs block 7 (position 255); P dropped it
        (320, [0] * 8 + [8, 9], []),  # D needs positions 256..318: blocks 8-9
        (40, [1, 2], []),  # inside the window: every block, none null
    ],
)
def test_window_gap_groups_finds_a_window_start_p_dropped(num_prompt_tokens, sliding, gaps):
    n_blocks = -(-num_prompt_tokens // BLOCK_SIZE)
    full = list(range(50, 50 + n_blocks))
    assert window_gap_groups(
        remote_block_ids=[sliding, full],
        sliding_windows=[64, None],
        num_computed_tokens=num_prompt_tokens - 1,  # the last token is recomputed on D
        num_remote_tokens=num_prompt_tokens,
        start_block=0,
        block_size=BLOCK_SIZE,
    ) == gaps


def test_window_gap_groups_ignores_positions_before_a_local_hit():
    # D's own prefix cache covers blocks 0-7: the null at 7 is not pulled
    assert window_gap_groups(remote_block_ids=[[0] * 8 + [8, 9]], sliding_windows=[64],
                             num_computed_tokens=318, num_remote_tokens=319, start_block=8,
                             block_size=32) == []


@pytest.mark.parametrize(
    ("remote_block_ids", "sliding_windows"),
    [
        # a full-attention group keeps every block on P: any null D needs is wrong
        ([[1, 0, 3], [0, 0, 3]], [None, 64]),
        ([[0, 2, 3]], [None]),
        # window 64, 91 tokens on P: P keeps positions 28.. (block 0 on): block 1 must be real
        ([[1, 2, 3], [1, 0, 3]], [None, 64]),
        # window 32, 91 tokens: P keeps positions 60.. (block 1 on); block 0 may be null
        # (a gap), but block 2's null is wrong, and a wrong null outranks a gap
        ([[1, 2, 3], [0, 2, 0]], [None, 32]),
    ],
)
def test_window_gap_groups_reports_no_gap_for_a_null_p_must_not_have(
    remote_block_ids, sliding_windows
):
    # a null where P must hold a real block is a wrong ticket: no gap (D would compute it
    # itself and hide the error); plan_group_pulls makes it a load error instead
    assert window_gap_groups(remote_block_ids=remote_block_ids, sliding_windows=sliding_windows,
                             num_computed_tokens=90, num_remote_tokens=91, start_block=0,
                             block_size=32) == []


def test_window_gap_groups_keeps_a_gap_before_ps_own_window():
    # window 32, D computes 90 tokens (keeps positions 59..: blocks 1-2), P computed 91 (keeps
    # 60..: blocks 1-2 too): nothing to report; with window 60 D keeps 31.. (block 0) and P
    # 32.. (block 1): P may have dropped block 0, which D needs, a gap in group 1
    assert window_gap_groups(remote_block_ids=[[1, 2, 3], [0, 2, 3]], sliding_windows=[None, 32],
                             num_computed_tokens=90, num_remote_tokens=91, start_block=0,
                             block_size=32) == []
    assert window_gap_groups(remote_block_ids=[[1, 2, 3], [0, 2, 3]], sliding_windows=[None, 60],
                             num_computed_tokens=90, num_remote_tokens=91, start_block=0,
                             block_size=32) == [1]


class _VllmStatus(enum.Enum):
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_REPETITION = 2  # a vLLM status kvbridge does not have


def test_request_view_reads_vllm_fields_and_maps_status_by_name():
    params = {"do_remote_decode": True}
    request = SimpleNamespace(
        request_id="0-abc",
        kv_transfer_params=params,
        num_prompt_tokens=70,
        num_tokens=71,
        block_hashes=[b"h0", b"h1"],
        status=_VllmStatus.FINISHED_LENGTH_CAPPED,
    )
    view = RequestView.of(request)
    assert view.kv_transfer_params is params  # the same dict: a used ticket is marked in it
    assert (view.num_prompt_tokens, view.num_tokens, view.skip_reading_prefix_cache) == (
        70,
        71,
        False,
    )
    assert view.status is RequestStatus.FINISHED_LENGTH_CAPPED
    request.status = _VllmStatus.FINISHED_REPETITION
    assert RequestView.of(request).status is RequestStatus.FINISHED_ERROR  # nothing handed over


def test_offload_on_eviction_to_a_store_is_accepted_in_vllm_and_write_through_refused():
    extra = {"index_url": "redis://127.0.0.1:6379/0", "store_url": "127.0.0.1:7000"}
    config = config_from_vllm(_vllm_transfer_config(**extra, offload="evict"), model_name="tiny")
    assert (config.store_url, config.offload) == ("127.0.0.1:7000", "evict")
    # Every computed block copied out: what users of offload connectors complain about.
    with pytest.raises(KVTransferConfigError, match=r"offload='write_through': not supported"):
        config_from_vllm(_vllm_transfer_config(**extra, offload="write_through"),
                         model_name="tiny")
    # A store's blocks are found (and their parents learnt) through the index: both needed.
    with pytest.raises(KVTransferConfigError, match=r"needs store_url .* and index_url"):
        config_from_vllm(_vllm_transfer_config(store_url="127.0.0.1:7000", offload="evict"),
                         model_name="tiny")
    config_from_vllm(_vllm_transfer_config(offload="off", index_url=None), model_name="tiny")


@pytest.mark.parametrize("tp", [1, 2])
def test_the_store_tier_is_refused_with_pipeline_parallel_and_served_with_tensor_parallel(tp):
    extra = {"index_url": "redis://127.0.0.1:6379/0", "store_url": "127.0.0.1:7000",
             "offload": "evict"}
    config = config_from_vllm(_vllm_transfer_config(**extra), model_name="tiny")

    def engine(pp: int) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                               pipeline_parallel_size=pp))

    with pytest.raises(KVTransferConfigError, match=r"store_url: .*pipeline_parallel_size 2"):
        check_store_tier(engine(2), config)
    check_store_tier(engine(1), config)  # each rank writes its own KV heads of a block
    no_store = config_from_vllm(_vllm_transfer_config(index_url=extra["index_url"]),
                                model_name="tiny")
    check_store_tier(engine(2), no_store)  # the index alone: the ranks' own business


@pytest.mark.parametrize("async_scheduling", [False, True, None])
@pytest.mark.parametrize("load_mode", ["auto", "async", "sync"])
@pytest.mark.parametrize("num_groups", [1, 2])
def test_a_load_mode_vllm_cannot_recover_from_is_refused_and_auto_turns_async(
        async_scheduling, load_mode, num_groups):
    # A failed in-step load reaches vLLM only as invalid_block_ids: refused for several groups,
    # and under async scheduling the failed request would never finish (load_modes.py).
    engine = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    config = config_from_vllm(_vllm_transfer_config(load_mode=load_mode), model_name="tiny")
    if load_mode == "sync" and (async_scheduling or num_groups > 1):
        fix = "--no-async-scheduling" if num_groups == 1 else "several KV cache groups"
        with pytest.raises(KVTransferConfigError, match=f"load_mode='sync'.*{fix}"):
            load_mode_for(engine, config, num_groups=num_groups)
        return
    ran = load_mode_for(engine, config, num_groups=num_groups)
    expected = "async" if async_scheduling and load_mode == "auto" else load_mode
    assert ran.load_mode == expected and config.load_mode == load_mode
    assert ran == dataclasses.replace(config, load_mode=expected)  # nothing else changed


def test_request_view_gives_the_prompt_digest_its_inputs_and_only_token_ids():
    """A ticket's ``remote_prompt_digest`` reads the prompt's token ids, LoRA name and cache
    salt through the view; a prompt with embeddings or multimodal features shows no token ids
    (their bytes are not in them), so it gets no digest and D leaves the check to P."""
    request = SimpleNamespace(
        request_id="0-abc", kv_transfer_params=None, num_prompt_tokens=3, num_tokens=3,
        block_hashes=[], status=_VllmStatus.FINISHED_LENGTH_CAPPED, prompt_token_ids=[5, 6, 7],
        prompt_embeds=None, mm_features=[], lora_request=SimpleNamespace(lora_name="ada"),
        cache_salt="s",
    )
    view = RequestView.of(request)
    assert (list(view.prompt_token_ids), view.lora_name, view.cache_salt) == ([5, 6, 7], "ada", "s")
    assert prompt_digest(view, 3, BLOCK_SIZE) != ""
    for extra in ({"mm_features": [object()]}, {"prompt_embeds": object()}):
        other = RequestView.of(SimpleNamespace(**{**vars(request), **extra}))
        assert other.prompt_token_ids is None and prompt_digest(other, 3, BLOCK_SIZE) == ""
    bare = SimpleNamespace(**{k: v for k, v in vars(request).items()
                              if k not in ("prompt_token_ids", "lora_request", "cache_salt")})
    assert RequestView.of(bare).prompt_token_ids is None  # an older vLLM: no digest, no error


def test_the_block_index_is_accepted_in_vllm():
    config = config_from_vllm(
        _vllm_transfer_config(index_url="redis://127.0.0.1:6379/0"), model_name="tiny")
    assert config.index_url == "redis://127.0.0.1:6379/0"
    # A hit must beat recompute: vLLM's default minimum, unless the extra config sets one.
    assert config.min_remote_hit_tokens == VLLM_MIN_REMOTE_HIT_TOKENS == 256
    own = config_from_vllm(_vllm_transfer_config(min_remote_hit_tokens=0), model_name="tiny")
    assert own.min_remote_hit_tokens == 0


# ------------------------------------------------------------------ the index's hash domain
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED


@pytest.mark.parametrize("algo", sorted(XXHASH_ALGOS))
def test_xxhash_without_pythonhashseed_refuses_the_index_in_one_line_naming_the_fix(algo):
    with pytest.raises(KVTransferConfigError) as info:
        hash_root_id(algo, python_hash_seed=None, default_seed=VLLM_DEFAULT_SEED)
    message = str(info.value)
    assert "\n" not in message
    assert "index_url" in message and "PYTHONHASHSEED" in message and "sha256" in message
    # With the seed set, every engine derives the same root: accepted.
    assert hash_root_id(algo, python_hash_seed="0", default_seed=VLLM_DEFAULT_SEED)


def test_the_hash_root_id_names_algorithm_and_seed_without_revealing_the_seed():
    root = hash_root_id("sha256", python_hash_seed=None, default_seed=VLLM_DEFAULT_SEED)
    assert root == hash_root_id("sha256", python_hash_seed=None, default_seed=VLLM_DEFAULT_SEED)
    # PYTHONHASHSEED equal to vLLM's default seed is the same root; any other seed is not.
    assert root == hash_root_id("sha256", python_hash_seed=VLLM_DEFAULT_SEED,
                                default_seed=VLLM_DEFAULT_SEED)
    others = {
        hash_root_id("sha256", python_hash_seed="0", default_seed=VLLM_DEFAULT_SEED),
        hash_root_id("sha256", python_hash_seed="1", default_seed=VLLM_DEFAULT_SEED),
        hash_root_id("sha256_cbor", python_hash_seed=None, default_seed=VLLM_DEFAULT_SEED),
        hash_root_id("xxhash", python_hash_seed="0", default_seed=VLLM_DEFAULT_SEED),
    }
    assert root not in others and len(others) == 4
    secret = "a-secret-seed-1234"
    assert secret not in hash_root_id("xxhash", python_hash_seed=secret,
                                      default_seed=VLLM_DEFAULT_SEED)
    assert len(root) == 16 and int(root, 16) >= 0


def _engine_namespace(**changes):
    """The index namespace of a vLLM engine (``IndexNamespace`` of the ``BlockIdentity`` its
    worker announces) as read from stand-ins of its config; ``changes`` (dotted names) spoil
    one fact of it."""
    values = {
        "model.revision": None, "model.quantization": None, "model.dtype": torch.bfloat16,
        "cache.cache_dtype": "fp8_e4m3", "cache.prefix_caching_hash_algo": "sha256",
        "seed": None,
    }
    values.update(changes)
    part = {"model": {}, "cache": {}}
    for dotted, value in values.items():
        if "." in dotted:
            owner, attr = dotted.split(".")
            part[owner][attr] = value
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(**part["model"]),
                                  cache_config=SimpleNamespace(**part["cache"]))
    fields = engine_identity_fields(vllm_config, python_hash_seed=values["seed"],
                                    default_seed=VLLM_DEFAULT_SEED, shared=True)
    identity = BlockIdentity(
        model_name="tiny", model_revision=model_revision_of(vllm_config.model_config),
        block_size=BLOCK_SIZE, hash_fn_name=part["cache"]["prefix_caching_hash_algo"], **fields)
    return IndexNamespace(identity=identity)


@pytest.mark.parametrize("change", [
    {"model.revision": "v2"}, {"model.quantization": "fp8"}, {"model.dtype": torch.float16},
    {"cache.cache_dtype": "fp8_e5m2"}, {"cache.prefix_caching_hash_algo": "sha256_cbor"},
    {"seed": "0"},
])
def test_every_engine_fact_that_changes_kv_bytes_changes_the_index_namespace(change):
    # Issue 31 part 1, the facts vLLM's config holds (the tensors' geometry is in the layout
    # name, kv_cache_regions; the TP split in the namespace's kv_heads_layout): an fp8
    # cache of a float16 model, of a quantized model or hashed from another root holds other
    # bytes (or other hashes) for one token prefix, so the two engines share no key prefix.
    base = _engine_namespace().key_prefix
    assert base == _engine_namespace().key_prefix  # the same engine: the same namespace
    assert _engine_namespace(**change).key_prefix != base


def test_an_unshared_hash_root_is_named_apart_from_every_other_engine():
    # A P/D engine on xxhash without PYTHONHASHSEED keeps serving (no index_url), but its root
    # is its own: no other engine's identity equals it, so a peer's handshake names
    # hash_root instead of every pull failing its hash checks.
    names = {hash_root_id("xxhash", python_hash_seed=None, default_seed=VLLM_DEFAULT_SEED,
                          shared=False) for _ in range(3)}
    assert len(names) == 3
    assert hash_root_id("sha256", python_hash_seed=None, default_seed=VLLM_DEFAULT_SEED,
                        shared=False) == hash_root_id("sha256", python_hash_seed=None,
                                                      default_seed=VLLM_DEFAULT_SEED)
