"""The connector in the engine: the runner calls the worker half's hooks in vLLM's order, two
engines hand KV from a prefill node to a decode node through an in-process test double of the
P/D plugin (tokens equal the no-cache reference), and refused ``kv_transfer_params`` reach the
connector. Every test ends with check_integrity and a free pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from _engine_assertions import MAX_TOKENS, _assert_all_blocks_free
from _engine_builders import BLOCK_SIZE, make_engine, reference_greedy, text_prompt, varied_prompts
from kvbridge.kernels import gather_blocks, scatter_blocks
from kvbridge.kvmanager import (
    Engine,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    MatchedTokens,
    NoOpConnector,
    RequestFinishedResult,
    RequestOutput,
    SamplingParams,
)


# ------------------------------------------------------------------ the connector in the engine
class _RecordingConnector(NoOpConnector):
    """No-op connector that records the worker-side calls of each step."""

    def __init__(self, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(role)
        self.calls: list[str] = []

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        self.calls.append(f"register_kv_caches({len(kv_caches)})")

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.calls.append("bind_connector_metadata")

    def start_load_kv(self, forward_context) -> None:
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append("wait_for_layer_load")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata) -> None:
        self.calls.append("save_kv_layer")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids):
        self.calls.append("get_finished")
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append("get_block_ids_with_load_errors")
        return set()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.calls.append("clear_connector_metadata")


def test_runner_calls_worker_connector_hooks_in_vllm_order():
    halves: dict[KVConnectorRole, _RecordingConnector] = {}

    def factory(role: KVConnectorRole, kv_cache_config) -> _RecordingConnector:
        halves[role] = _RecordingConnector(role)
        return halves[role]

    engine = make_engine(connector_factory=factory)
    worker = halves[KVConnectorRole.WORKER]
    assert worker.calls == ["register_kv_caches(4)"]  # once, every layer of the tiny model
    engine.generate([text_prompt(5)], max_tokens=1)
    # One forward; per-layer hooks bracket the whole forward (4 layers each).
    assert worker.calls[1:] == [
        "bind_connector_metadata",
        "start_load_kv",
        *["wait_for_layer_load"] * 4,
        *["save_kv_layer"] * 4,
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    del worker.calls[:]
    engine.step()  # nothing scheduled: the connector still progresses, without layer hooks
    assert worker.calls == [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    assert halves[KVConnectorRole.SCHEDULER].calls == []  # the worker half only gets these
    _assert_all_blocks_free(engine)


@dataclass
class _PullMetadata(KVConnectorMetadata):
    # request id -> (peer node, per group: (local block ids, remote block ids)), paired by position
    loads: dict[str, tuple[_Node, list[tuple[list[int], list[int]]]]] = field(default_factory=dict)


@dataclass
class _Node:
    """State one engine's two connector halves share (the in-process stand-in for a node)."""

    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)
    layer_name_to_group: dict[str, int] = field(default_factory=dict)
    done_sending: set[str] = field(default_factory=set)
    done_recving: set[str] = field(default_factory=set)
    num_pulled_blocks: dict[str, int] = field(default_factory=dict)  # group 0, per request


class _InProcessPDConnector(KVConnectorBase):
    """Test double of the P/D plugin (issue 5), to drive the scheduler's side of the protocol
    through real engines: D's worker pulls P's blocks with gather/scatter inside
    ``start_load_kv`` and reports the load one poll later; P frees on D's completion notice."""

    def __init__(self, role: KVConnectorRole, node: _Node, nodes: dict[str, _Node], name: str):
        super().__init__(role)
        self.node, self.nodes, self.name = node, nodes, name
        self._new_loads: dict[str, tuple[_Node, list[tuple[list[int], list[int]]]]] = {}

    # scheduler half
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return MatchedTokens(0, False)
        return MatchedTokens(params["remote_num_tokens"] - num_computed_tokens, True)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if not num_external_tokens:
            return
        params = request.kv_transfer_params
        # External tokens start at the (block aligned) local hit: pair blocks by position,
        # trimming the remote list from the front.
        first = self._local_hit_blocks(request, num_external_tokens)
        pairs = []
        for local_ids, remote_ids in zip(
            blocks.get_block_ids(), params["remote_block_ids"], strict=True
        ):
            last = -(-params["remote_num_tokens"] // BLOCK_SIZE)
            # A sliding-window group holds null blocks (id 0) before its window: nothing to pull.
            kept = [
                (local, remote)
                for local, remote in zip(local_ids[first:last], remote_ids[first:last], strict=True)
                if local != 0 and remote != 0
            ]
            pairs.append(([local for local, _ in kept], [remote for _, remote in kept]))
        self._new_loads[request.request_id] = (self.nodes[params["remote_engine_id"]], pairs)

    @staticmethod
    def _local_hit_blocks(request, num_external_tokens: int) -> int:
        return (request.kv_transfer_params["remote_num_tokens"] - num_external_tokens) // BLOCK_SIZE

    def build_connector_meta(self, scheduler_output):
        meta, self._new_loads = _PullMetadata(loads=self._new_loads), {}
        return meta

    def request_finished(self, request, block_ids):
        if not (request.kv_transfer_params or {}).get("do_remote_decode"):
            return RequestFinishedResult(False, None)
        return RequestFinishedResult(
            True,
            {
                "do_remote_prefill": True,
                "remote_engine_id": self.name,
                "remote_block_ids": [list(ids) for ids in block_ids],
                "remote_num_tokens": request.num_prompt_tokens,
            },
        )

    # worker half
    def register_kv_caches(self, kv_caches):
        self.node.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context):
        self.node.layer_name_to_group = dict(forward_context.layer_name_to_group)
        for req_id, (peer, pairs) in self._get_connector_metadata().loads.items():
            for group_id, (local_ids, remote_ids) in enumerate(pairs):
                if not local_ids:
                    continue
                names = [n for n, g in self.node.layer_name_to_group.items() if g == group_id]
                remote_caches = [peer.kv_caches[n] for n in names]
                staging = gather_blocks(remote_caches, torch.tensor(remote_ids))
                local_caches = [self.node.kv_caches[n] for n in names]
                scatter_blocks(staging, local_caches, torch.tensor(local_ids))
            self.node.num_pulled_blocks[req_id] = len(pairs[0][0])
            self.node.done_recving.add(req_id)
            peer.done_sending.add(req_id)

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        sending, self.node.done_sending = self.node.done_sending, set()
        recving, self.node.done_recving = self.node.done_recving, set()
        return sending or None, recving or None


def _make_pd_pair(*, hybrid: bool) -> tuple[Engine, Engine]:
    nodes = {"P": _Node(), "D": _Node()}

    def factory_for(name: str):
        return lambda role, kv_cache_config: _InProcessPDConnector(role, nodes[name], nodes, name)

    return (
        make_engine(hybrid=hybrid, connector_factory=factory_for("P")),
        make_engine(hybrid=hybrid, connector_factory=factory_for("D")),
    )


def _run(engine: Engine) -> dict[str, RequestOutput]:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("warm_decode_node", [False, True], ids=["cold-D", "partial-local-hit"])
def test_prefill_node_hands_kv_to_decode_node(hybrid: bool, warm_decode_node: bool):
    prefill, decode = _make_pd_pair(hybrid=hybrid)
    prompts = varied_prompts()
    if warm_decode_node:
        # D already holds the 41-token shared prefix: it pulls only the blocks after its hit.
        decode.generate([text_prompt(41)], max_tokens=1)
    # (1) P prefills each prompt and makes its first token; request_finished delays the free.
    for i, prompt in enumerate(prompts):
        prefill.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=1),
            kv_transfer_params={"do_remote_decode": True},
        )
    handoff = _run(prefill)
    assert prefill.scheduler.held_req_ids == {f"r{i}" for i in range(len(prompts))}
    # (2) D loads the KV (WAITING_FOR_REMOTE_KVS), recomputes only the last prompt token, decodes.
    for i, prompt in enumerate(prompts):
        decode.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS),
            kv_transfer_params=handoff[f"r{i}"].kv_transfer_params,
        )
    results = _run(decode)
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=hybrid)
        # Every prompt token came from a cache (P's blocks, and D's own for a warm D).
        assert results[f"r{i}"].num_cached_tokens == len(prompt)
    # The two 53-token prompts span 7 blocks; a warm D hits 5 (40 tokens) and pulls 2.
    pulled = decode.runner.connector.node.num_pulled_blocks
    assert [pulled["r5"], pulled["r6"]] == ([2, 2] if warm_decode_node else [7, 7])
    # (3) D's pulls completed: P's next step receives finished_sending and frees every block.
    prefill.step()
    _assert_all_blocks_free(prefill)
    _assert_all_blocks_free(decode)


class _PickyConnector(NoOpConnector):
    """Refuses params without "ok" at admission and records release notices."""

    def __init__(self, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(role)
        self.rejected: list[str] = []

    def validate_kv_transfer_params(
        self, request_id, kv_transfer_params, num_prompt_tokens=None
    ) -> None:
        if not kv_transfer_params.get("ok"):
            raise ValueError("kv_transfer_params lacks 'ok'")

    def on_request_rejected(self, kv_transfer_params, reason: str) -> None:
        self.rejected.append(reason)


def test_refused_kv_transfer_params_notify_the_connector_but_a_duplicate_id_does_not():
    engine = make_engine(connector_factory=_PickyConnector)
    connector = engine.scheduler.connector
    with pytest.raises(ValueError, match="lacks 'ok'"):
        engine.add_request("r", text_prompt(5), kv_transfer_params={"bad": 1})
    assert connector.rejected == ["kv_transfer_params lacks 'ok'"]  # the peer may release
    engine.add_request("r", text_prompt(5), kv_transfer_params={"ok": True})
    # A second request with a live id is refused without a release: "r" still needs its KV.
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r", text_prompt(5), kv_transfer_params={"ok": True})
    assert connector.rejected == ["kv_transfer_params lacks 'ok'"]
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_blocks_free(engine)
