"""Builders for P/D connector tests: a prefill node and a decode node over the in-process
loopback transport, whose keyword arguments name the scenario, plus the drivers that run one
request through each node and the end-of-test leak checks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from _engine_builders import TOKENIZER, tiny_model
from kvbridge.connector.factory import create_engine
from kvbridge.kvmanager import SamplingParams
from kvbridge.kvmanager.engine import Engine, EngineConfig, RequestOutput
from kvbridge.transport import LoopbackFaults, LoopbackNetwork

_LONG_TEXT = (
    "Prefill runs once over the whole prompt and writes every key and value into paged blocks; "
    "decode then reads them back one token at a time. When the two run on different nodes, "
    "the decode node allocates its blocks first, pulls the bytes into them, and only then "
    "publishes their hashes so that no other request can read a half-written block. "
)


def long_prompt(num_tokens: int, *, salt: str = "") -> list[int]:
    """Real English text cut to exactly ``num_tokens`` tokens (BOS + UTF-8 bytes)."""
    text = (salt + _LONG_TEXT) * (num_tokens // len(_LONG_TEXT) + 2)
    ids = TOKENIZER.encode(text)[:num_tokens]
    assert len(ids) == num_tokens
    return ids


@dataclass
class PDPair:
    """A prefill node ``p`` and a decode node ``d`` sharing one seeded model."""

    p: Engine
    d: Engine
    hybrid: bool
    p_faults: LoopbackFaults
    network: LoopbackNetwork
    others: list[Engine] = field(default_factory=list)

    def close(self) -> None:
        for engine in (self.p, self.d, *self.others):
            engine.shutdown()


def make_pd_pair(
    *,
    hybrid: bool = False,
    block_size: int = 16,
    d_block_size: int | None = None,
    num_blocks: int = 256,
    max_model_len: int = 256,
    lease_s: float = 30.0,
    heartbeat_interval_s: float = 0.05,
    load_timeout_s: float = 5.0,
    load_failure_policy: str = "recompute",
    d_max_num_seqs: int = 16,
    idle_pull_wait_s: float | None = None,
    idle_hold_wait_s: float | None = None,
    load_mode: str = "async",
    sync_load_timeout_s: float = 2.0,
    extra_config: dict | None = None,
    d_extra: dict[str, Any] | None = None,
) -> PDPair:
    """P (``kv_producer``) and D (``kv_consumer``) over one ``LoopbackNetwork``; P's holder
    faults are ``pair.p_faults`` (mutable); ``extra_config`` is merged into both nodes'
    ``kv_connector_extra_config``, ``d_extra`` into D's alone (after it)."""
    network = LoopbackNetwork()
    faults = LoopbackFaults()
    model = tiny_model(hybrid=hybrid)

    def node(
        engine_id: str, role: str, bs: int, max_num_seqs: int = 16, extra: dict | None = None
    ) -> Engine:
        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            num_blocks=num_blocks,
            block_size=bs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(512, max_model_len),
        )
        kv_transfer_config = {
            "kv_connector": "KVBridgeConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "transport": "loopback",
                "lease_s": lease_s,
                "heartbeat_interval_s": heartbeat_interval_s,
                "load_timeout_s": load_timeout_s,
                "load_failure_policy": load_failure_policy,
                "load_mode": load_mode,
                "sync_load_timeout_s": sync_load_timeout_s,
                **({} if idle_pull_wait_s is None else {"idle_pull_wait_s": idle_pull_wait_s}),
                **({} if idle_hold_wait_s is None else {"idle_hold_wait_s": idle_hold_wait_s}),
                **(extra_config or {}),
                **(extra or {}),
            },
        }
        return create_engine(
            model,
            config,
            kv_transfer_config,
            loopback_network=network,
            **({"loopback_faults": faults} if role == "kv_producer" else {}),
        )

    p = node("prefill-0", "kv_producer", block_size)
    d = node("decode-0", "kv_consumer", d_block_size or block_size, d_max_num_seqs, d_extra)
    return PDPair(p=p, d=d, hybrid=hybrid, p_faults=faults, network=network)


def run_to_completion(engine: Engine, request_id: str, *, timeout_s: float = 30.0) -> RequestOutput:
    """Step ``engine`` until ``request_id`` finishes; returns its final output."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
        time.sleep(0.001)
    raise AssertionError(f"request {request_id} did not finish within {timeout_s} s")


def prefill(
    pair: PDPair, request_id: str, prompt: list[int], *, step_after: bool = True
) -> dict[str, Any]:
    """(P) Run the prompt with ``do_remote_decode`` and max_tokens=1; returns the
    ``kv_transfer_params`` for D (``step_after``: P steps once more, as its serving loop would,
    which hands the lease to its worker half)."""
    pair.p.add_request(
        request_id,
        prompt,
        SamplingParams(max_tokens=1),
        kv_transfer_params={"do_remote_decode": True},
    )
    output = run_to_completion(pair.p, request_id)
    assert output.finish_reason == "length"
    assert output.kv_transfer_params is not None
    # P's serving loop steps again at once (its blocks are held); that step's metadata hands
    # the lease grant to P's worker half, which serves D's pull only from then on.
    if step_after:
        pair.p.step()
    return output.kv_transfer_params


def decode(
    pair: PDPair, request_id: str, prompt: list[int], params: dict[str, Any], max_tokens: int
) -> RequestOutput:
    """(D) Run the request with P's params until it finishes."""
    pair.d.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens), params)
    return run_to_completion(pair.d, request_id)


def drain(engine: Engine, *, timeout_s: float = 10.0) -> None:
    """Step until the scheduler holds nothing (delayed frees and loads settled)."""
    deadline = time.monotonic() + timeout_s
    while not engine.scheduler.is_empty():
        if time.monotonic() > deadline:
            raise AssertionError(
                "scheduler still holds requests: " + repr(engine.scheduler.held_req_ids)
            )
        engine.step()
        time.sleep(0.002)


def assert_node_empty(engine: Engine) -> None:
    """No request held, integrity holds, every block but the null block is free."""
    drain(engine)
    manager = engine.kv_cache_manager
    manager.check_integrity()
    num_free = manager.block_pool.get_num_free_blocks()
    assert num_free == engine.config.num_blocks - 1, (num_free, engine.config.num_blocks)


def assert_pair_empty(pair: PDPair) -> None:
    """The end of every P/D lifecycle test: D settled first (its completion notices release
    P's leases), then P; both empty, intact, every block free."""
    assert_node_empty(pair.d)
    assert_node_empty(pair.p)


def kv_bytes(engine: Engine, group_id: int, block_id: int) -> list[torch.Tensor]:
    """The KV rows of ``block_id`` in every layer of ``group_id`` (copies)."""
    group = engine.kv_cache_config.kv_cache_groups[group_id]
    return [engine.runner.kv_caches[name][block_id].clone() for name in group.layer_names]
