"""The connector's two halves share nothing: a P/D pair whose halves speak only msgpack bytes,
the configuration contract the halves are built from, and the load-failure policy taken from
``kv_transfer_config`` alone."""

from __future__ import annotations

import gc
import types
from typing import Any

import msgpack
import msgspec
import pytest
import torch
from _engine_builders import reference_greedy, tiny_model
from _pd_builders import PDPair, assert_pair_empty, decode, long_prompt, prefill
from kvbridge.connector import KVBridgeConnector, KVTransferConfig, KVTransferConfigError
from kvbridge.connector.factory import create_engine
from kvbridge.connector.metadata import (
    METADATA_SCHEMA_VERSION,
    WorkerHandshake,
    decode_metadata,
    decode_worker_meta,
    encode_metadata,
    encode_worker_meta,
)
from kvbridge.connector.scheduler_half import KVBridgeScheduler
from kvbridge.connector.worker_half import KVBridgeWorker
from kvbridge.kvmanager.connector_interface import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvbridge.kvmanager.engine import EngineConfig
from kvbridge.kvmanager.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvbridge.transport import BlockIdentity, LoopbackFaults, LoopbackNetwork

MAX_TOKENS = 4


class _Bytes(KVConnectorMetadata):
    """A step's metadata as it crosses a process boundary: msgpack bytes, nothing else."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


class _OverTheWire(KVConnectorBase):
    """One half of a ``KVBridgeConnector`` whose messages to the other half are msgpack bytes:
    the metadata down, the worker report and the handshake up (what a multiprocess executor
    carries), each half built from its own decoded copy of the settings."""

    def __init__(self, role: KVConnectorRole, inner: KVBridgeConnector) -> None:
        super().__init__(role, inner.kv_role)
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # every hook not rewritten below
        return getattr(self.inner, name)

    # scheduler half
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return _Bytes(encode_metadata(self.inner.build_connector_meta(scheduler_output)))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        payload = connector_output.kv_connector_worker_meta
        self.inner.update_connector_output(
            KVConnectorOutput(
                finished_sending=connector_output.finished_sending,
                finished_recving=connector_output.finished_recving,
                invalid_block_ids=connector_output.invalid_block_ids,
                kv_connector_worker_meta=None if payload is None else decode_worker_meta(payload),
            )
        )

    def request_finished(self, request, block_ids):
        return self.inner.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata):
        import msgspec
        from kvbridge.connector.metadata import WorkerHandshake

        self.inner.set_xfer_handshake_metadata(
            {
                rank: msgspec.msgpack.decode(raw, type=WorkerHandshake)
                for rank, raw in metadata.items()
            }
        )

    def has_pending_orders(self) -> bool:
        return self.inner.has_pending_orders()

    def validate_kv_transfer_params(self, request_id, kv_transfer_params, num_prompt_tokens=None):
        self.inner.validate_kv_transfer_params(request_id, kv_transfer_params, num_prompt_tokens)

    def on_request_rejected(self, kv_transfer_params, reason):
        self.inner.on_request_rejected(kv_transfer_params, reason)

    def take_events(self):
        return self.inner.take_events()

    # worker half
    def register_kv_caches(self, kv_caches):
        self.inner.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        import msgspec

        return msgspec.msgpack.encode(self.inner.get_handshake_metadata())

    def bind_connector_metadata(self, connector_metadata):
        assert isinstance(connector_metadata, _Bytes)
        self.inner.bind_connector_metadata(decode_metadata(connector_metadata.payload))

    def clear_connector_metadata(self):
        self.inner.clear_connector_metadata()

    def start_load_kv(self, forward_context):
        self.inner.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name):
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata):
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self):
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids):
        return self.inner.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self.inner.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return encode_worker_meta(self.inner.build_connector_worker_meta())

    def shutdown(self):
        self.inner.shutdown()


def _wire_factory(raw_config: dict[str, Any], network: LoopbackNetwork, faults: LoopbackFaults):
    def build(role: KVConnectorRole, kv_cache_config) -> _OverTheWire:
        import copy

        inner = KVBridgeConnector(
            role,
            KVTransferConfig.from_dict(copy.deepcopy(raw_config)),  # each half its own copy
            copy.deepcopy(kv_cache_config),
            hash_fn_name="sha256_cbor",
            loopback_network=network if role is KVConnectorRole.WORKER else None,
            loopback_faults=faults if role is KVConnectorRole.WORKER else None,
        )
        return _OverTheWire(role, inner)

    return build


def _wire_pair() -> PDPair:
    from kvbridge.kvmanager.engine import Engine

    network, faults = LoopbackNetwork(), LoopbackFaults()
    model = tiny_model(hybrid=False)
    engines = []
    for engine_id, role in (("prefill-w", "kv_producer"), ("decode-w", "kv_consumer")):
        raw = {
            "kv_role": role,
            "engine_id": engine_id,
            "kv_connector_extra_config": {"transport": "loopback", "heartbeat_interval_s": 0.05},
        }
        config = EngineConfig(num_blocks=256, block_size=16, max_model_len=256)
        engine = Engine(model, config, connector_factory=_wire_factory(raw, network, faults))
        manager = engine.kv_cache_manager
        engine.scheduler.connector.inner.bind_block_pool(manager.block_pool, manager.take_events)
        engines.append(engine)
    return PDPair(p=engines[0], d=engines[1], hybrid=False, p_faults=faults, network=network)


_SHAREABLE = (
    str,
    bytes,
    int,
    float,
    bool,
    type(None),
    tuple,
    frozenset,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
)


def _reachable(root: object) -> dict[int, object]:
    """Every mutable object reachable from ``root`` (immutables, types and modules skipped)."""
    seen: dict[int, object] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SHAREABLE):
            continue
        seen[id(obj)] = obj
        stack.extend(gc.get_referents(obj))
    return seen


def _assert_halves_share_no_mutable_object(scheduler_half: object, worker_half: object) -> None:
    shared = set(_reachable(scheduler_half)) & set(_reachable(worker_half))
    kinds = sorted({type(_reachable(scheduler_half)[i]).__name__ for i in shared})
    assert not shared, f"the halves share {len(shared)} mutable object(s) of types {kinds}"


def test_pd_pair_whose_halves_speak_only_msgpack_bytes_gives_single_node_tokens():
    pair = _wire_pair()
    try:
        for node in (pair.p, pair.d):
            _assert_halves_share_no_mutable_object(
                node.scheduler.connector.inner.scheduler_half,
                node.runner.connector.inner.worker_half,
            )
        for i, num_tokens in enumerate([31, 32, 33, 100]):
            prompt = long_prompt(num_tokens, salt=f"wire {i}. ")
            params = prefill(pair, f"req-{i}", prompt)  # (1) P: ticket out
            output = decode(pair, f"req-{i}", prompt, params, MAX_TOKENS)  # (2) D: pull, decode
            assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
            assert output.num_cached_tokens == num_tokens - 1  # pulled; last token recomputed
        stats = pair.d.scheduler.connector.inner.stats.snapshot()
        # The worker's counters reached the scheduler half through the msgpack report.
        assert (stats["num_loads"], stats["num_failed_loads"]) == (4, 0)
        assert stats["bytes_received"] > 0
        assert_pair_empty(pair)
    finally:
        pair.close()


def test_the_index_namespace_is_the_block_identity_the_workers_handshake_announces():
    # Issue 28 item 7: the KV cache dtype and layout are known to the worker half alone (its
    # tensors; vLLM's fp8 caches are uint8 tensors); the scheduler half's index namespace is
    # the identity the worker's transport announces at handshake, across msgpack. Before, the
    # namespace was the scheduler's model name, block size and hash function only.
    config = KVTransferConfig(transport="loopback", index_url="memory", engine_id="node-id",
                              model_name="identity-halves", model_revision="5d0f2ab1")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.uint8)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    worker = KVBridgeWorker(config, kv_cache_config, hash_fn_name="sha256_cbor",
                            loopback_network=LoopbackNetwork())
    scheduler = KVBridgeScheduler(config, block_size=16, num_groups=1, hash_fn_name="sha256_cbor")
    try:
        worker.register_kv_caches({"l0": torch.zeros(8, 2, 16, 2, 8, dtype=torch.uint8)},
                                  kv_layout="vllm:cuda-attn:test", kv_cache_dtype="fp8_e5m2")
        handshake = worker.get_handshake_metadata()
        scheduler.set_xfer_handshake_metadata(
            msgspec.msgpack.decode(msgspec.msgpack.encode(handshake), type=WorkerHandshake)
        )
        assert scheduler.index_client is not None
        assert scheduler.index_client.index.namespace.identity == BlockIdentity(
            model_name="identity-halves", model_revision="5d0f2ab1", kv_cache_dtype="fp8_e5m2",
            kv_layout="vllm:cuda-attn:test", block_size=16, hash_fn_name="sha256_cbor",
        ) == worker.transport.metadata.identity
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_an_unknown_extra_config_key_is_refused_naming_it():
    with pytest.raises(KVTransferConfigError, match="lease_sec"):
        KVTransferConfig.from_dict(
            {"kv_role": "kv_consumer", "kv_connector_extra_config": {"lease_sec": 3.0}}
        )


def test_load_failure_policy_fail_given_only_in_kv_transfer_config_fails_the_request():
    network = LoopbackNetwork()
    faults = LoopbackFaults()
    model = tiny_model(hybrid=False)
    config = EngineConfig(num_blocks=256, block_size=16, max_model_len=256)  # default: recompute

    def node(engine_id: str, role: str, **extra: Any):
        return create_engine(
            model,
            config,
            {
                "kv_role": role,
                "engine_id": engine_id,
                "kv_connector_extra_config": {"transport": "loopback", **extra},
            },
            loopback_network=network,
            **({"loopback_faults": faults} if role == "kv_producer" else {}),
        )

    pair = PDPair(
        p=node("prefill-f", "kv_producer"),
        d=node("decode-f", "kv_consumer", load_failure_policy="fail"),
        hybrid=False,
        p_faults=faults,
        network=network,
    )
    try:
        prompt = long_prompt(64)
        params = prefill(pair, "req-0", prompt)
        faults.fail_block_ids = set(params["remote_block_ids"][0])  # every block fails
        output = decode(pair, "req-0", prompt, params, MAX_TOKENS)
        assert output.finish_reason == "error"
        assert_pair_empty(pair)
    finally:
        pair.close()


def test_a_report_of_another_schema_version_is_refused_naming_the_versions():
    # A version-1 report: its offload outcomes had 3 fields. Whatever fails to decode, the
    # error names the versions, not a field.
    for version in (1, METADATA_SCHEMA_VERSION + 1):
        payload = msgpack.packb({"version": version, "offload_outcomes": [[0, b"h" * 32, True]]})
        with pytest.raises(ValueError, match=f"schema version {version}, this node speaks"):
            decode_worker_meta(payload)
    # The same report at this node's version: the field is named.
    payload = msgpack.packb({"version": METADATA_SCHEMA_VERSION,
                             "offload_outcomes": [[0, b"h" * 32, True]]})
    with pytest.raises(msgspec.ValidationError, match="offload_outcomes"):
        decode_worker_meta(payload)


def test_offload_across_msgpack_halves_writes_evicted_blocks_and_restores_them(redis_url):
    """Offload's items go down and its outcomes come up as bytes, as in separate processes
    (KVBridgeWorkerMeta's schema carries each outcome's four fields)."""
    from _pd_builders import run_to_completion
    from _store_builders import make_store
    from kvbridge.connector.store import close_store_node
    from kvbridge.kvmanager import SamplingParams
    from kvbridge.kvmanager.engine import Engine

    network, faults = LoopbackNetwork(), LoopbackFaults()
    store = make_store(network, index_url=redis_url, capacity_blocks=64, engine_id="store-w")
    raw = {
        "kv_role": "kv_both",
        "engine_id": "node-w",
        "kv_connector_extra_config": {
            "transport": "loopback", "index_url": redis_url, "heartbeat_interval_s": 0.05,
            "store_url": store.store_url, "offload": "evict", "offload_blocks_per_step": 64,
        },
    }
    config = EngineConfig(num_blocks=24, block_size=16, max_model_len=360,
                          max_num_batched_tokens=512, enable_kv_cache_events=True)
    node = Engine(tiny_model(hybrid=False), config,
                  connector_factory=_wire_factory(raw, network, faults))
    manager = node.kv_cache_manager
    node.scheduler.connector.inner.bind_block_pool(manager.block_pool, manager.take_events)
    sender = node.runner.connector.inner.worker_half.offload_sender

    def serve(request_id: str, prompt: list[int]) -> Any:
        node.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
        output = run_to_completion(node, request_id)
        node.step()  # its freed blocks are planned, then snapshotted and written
        sender.wait_idle()
        node.step()  # the outcomes reach the scheduler half, as bytes
        return output

    try:
        doc_a = long_prompt(20 * 16 + 5)
        doc_b = long_prompt(20 * 16 + 5, salt="Another document entirely. ")
        serve("a-0", doc_a)
        serve("b-0", doc_b)  # evicts most of A's blocks from the 23-block pool
        output = serve("a-1", doc_a)  # A's evicted blocks come back from the store
        assert output.token_ids == reference_greedy(doc_a, MAX_TOKENS, hybrid=False)
        stats = node.scheduler.connector.inner.stats.snapshot()
        assert stats["num_offloaded_blocks"] >= 20 and stats["num_restored_blocks"] == 18
        assert stats["num_failed_loads"] == 0
        planner = node.scheduler.connector.inner.scheduler_half.offload_planner
        assert planner.num_in_flight == 0  # every item's outcome crossed back
        assert planner.store_incarnation == store.incarnation  # and which store answered
    finally:
        node.shutdown()
        close_store_node(store)
