"""The node server's own logic, in process: request-body validation, role -> kv_transfer_config,
the HTTP app around a plain engine (served through httpx's ASGI transport, no sockets) and the
engine loop's counters. The proxy is in ``test_serve_proxy.py``, the trace expansion and the
main job in ``test_serve_demo.py``."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest
from _serve_builders import BLOCK_SIZE, _post_then_disconnect, _pull_ticket
from kvbridge.connector.serve.node.loop import EngineLoop
from kvbridge.connector.serve.node.server import (
    BadRequest,
    CompletionBody,
    build_app,
    kv_transfer_config_dict,
)
from kvbridge.kernels.model import ModelConfig
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams


def _args(**overrides) -> argparse.Namespace:
    fields = dict(role="both", port=8000, host="127.0.0.1", model="tiny", engine_id=None,
                  kv_transfer_config=None, index_url=None)
    fields.update(overrides)
    return argparse.Namespace(**fields)


def _plain_engine() -> Engine:
    return Engine(ModelConfig.tiny(), EngineConfig(num_blocks=64, block_size=BLOCK_SIZE,
                                                   max_model_len=256))


class _RecordedRejections:
    """Stands in for the connector's ``on_request_rejected``: the (params, reason) it got."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, str]] = []

    def __call__(self, kv_transfer_params: dict, reason: str) -> None:
        self.calls.append((kv_transfer_params, reason))


# ---------------------------------------------------------------------- body validation
def test_body_accepts_text_tokens_and_batch_of_one():
    assert CompletionBody.parse({"prompt": "hi"}).max_tokens == 16  # OpenAI's default
    assert CompletionBody.parse({"prompt": [1, 2], "max_tokens": 1}).prompt == [1, 2]
    assert CompletionBody.parse({"prompt": ["hi"]}).prompt == "hi"
    params = {"do_remote_decode": True}
    assert CompletionBody.parse({"prompt": "x", "kv_transfer_params": params}) \
        .kv_transfer_params == params


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body must be a JSON object"),
        ({}, "prompt: required"),
        ({"prompt": ""}, "prompt: must be non-empty"),
        ({"prompt": []}, "prompt: a token list"),
        ({"prompt": [1, "2"]}, "prompt: a token list"),
        ({"prompt": [1, True]}, "prompt: a token list"),  # bool is not a token id
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 65537}, "max_tokens"),  # one past the limit
        ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        ({"prompt": "x", "temperature": 0.7}, "temperature"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params"),
    ],
)
def test_body_rejects_with_the_field_named(body, field):
    with pytest.raises(BadRequest, match=field):
        CompletionBody.parse(body)


# ---------------------------------------------------------------------- roles
def test_roles_map_to_vllm_kv_roles():
    assert kv_transfer_config_dict(_args(role="both")) is None  # plain node, no connector
    prefill = kv_transfer_config_dict(_args(role="prefill", engine_id="p0"))
    assert prefill["kv_role"] == "kv_producer"
    assert prefill["engine_id"] == "p0"
    assert prefill["kv_connector_extra_config"]["model_name"] == "kvbridge-tiny"
    decode = kv_transfer_config_dict(_args(role="decode", index_url="redis://h:1/0"))
    assert decode["kv_role"] == "kv_consumer"
    assert decode["kv_connector_extra_config"]["index_url"] == "redis://h:1/0"
    store = kv_transfer_config_dict(_args(role="store"))
    assert store["kv_role"] == "kv_both"  # a StoreNode takes its host, index and model name


def test_role_contradicting_the_json_config_is_refused():
    with pytest.raises(ValueError, match="kv_role"):
        kv_transfer_config_dict(
            _args(role="prefill", kv_transfer_config=json.dumps({"kv_role": "kv_consumer"}))
        )


# ---------------------------------------------------------------------- the app, in process
async def test_app_rejects_bad_bodies_then_serves_and_counts():
    engine = _plain_engine()
    reference = _plain_engine()
    prompt = list(range(1, 40))
    expected = reference.generate([prompt], max_tokens=5)[0].token_ids
    loop = EngineLoop(engine)
    loop.start()
    app = build_app(loop, role="both", engine_id="t0", model_name="tiny")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            bad = await client.post("/v1/completions", content=b"{", timeout=30)
            assert bad.status_code == 400
            too_big = await client.post("/v1/completions", json={"prompt": [300]})
            assert too_big.status_code == 400  # refused by Engine.add_request
            assert "token id 300" in too_big.json()["error"]["message"]
            ok = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
            assert ok.status_code == 200
            body = ok.json()
            assert body["choices"][0]["token_ids"] == expected
            assert body["usage"] == {"prompt_tokens": 39, "completion_tokens": 5,
                                     "total_tokens": 44}
            streamed = await client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "stream": True}
            )
            events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data:")]
            assert events[-1] == "[DONE]"
            tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
            assert tokens == expected  # one chunk per step, same tokens
            metrics = (await client.get("/metrics")).text
            assert 'kvbridge_requests_rejected_total{engine_id="t0",role="both"} 1.0' in metrics
            assert 'kvbridge_requests_finished_total{engine_id="t0",role="both"} 2.0' in metrics
            assert (await client.get("/health")).json()["status"] == "ok"
    finally:
        loop.stop()
    engine.check_integrity()


async def test_refused_body_with_a_pull_ticket_releases_the_prefill_nodes_blocks():
    engine = _plain_engine()
    rejections = _RecordedRejections()
    engine.scheduler.connector.on_request_rejected = rejections  # the connector's release hook
    loop = EngineLoop(engine)
    loop.start()
    app = build_app(loop, role="decode", engine_id="d0", model_name="tiny")
    ticket = _pull_ticket()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://node") as client:
            # (1) refused by the body parser, ticket attached: P must be told to release.
            for body in (
                {"prompt": [1, 2, 3], "max_tokens": 0, "kv_transfer_params": ticket},
                {"prompt": [1, 2, 3], "temperature": 0.5, "kv_transfer_params": ticket},
            ):
                reply = await client.post("/v1/completions", json=body)
                assert reply.status_code == 400, reply.text
            # (2) refused, but nothing held on a peer for it: no release notice.
            no_ticket = [
                {"prompt": [1, 2, 3], "max_tokens": 0},
                {"prompt": [1, 2, 3], "max_tokens": 0,
                 "kv_transfer_params": {"do_remote_decode": True}},
                {"prompt": [1, 2, 3], "max_tokens": 0,
                 "kv_transfer_params": {**ticket, "do_remote_prefill": "yes"}},  # not true
            ]
            for body in no_ticket:
                reply = await client.post("/v1/completions", json=body)
                assert reply.status_code == 400, reply.text
            # (3) a served request: the loop thread handles its inbox in order, so every
            # release queued above has run once this answer is back.
            ok = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
            assert ok.status_code == 200, ok.text
    finally:
        loop.stop()
    assert rejections.calls == [
        (ticket, "max_tokens: must be an int in [1, 65536]"),
        (ticket, "temperature: this node samples greedily; use 0"),
    ]
    engine.check_integrity()


@pytest.mark.timeout(60)  # a regression generates all 2,000 tokens: fail, never hang
async def test_non_streaming_client_that_disconnects_is_aborted():
    engine = _long_engine()
    loop = EngineLoop(engine)
    loop.start()
    app = build_app(loop, role="both", engine_id="t0", model_name="tiny")
    went_away = asyncio.Event()

    async def hang_up_once_running() -> None:
        while loop.counters.snapshot()["num_running_reqs"] == 0:
            await asyncio.sleep(0.005)
        went_away.set()

    try:
        body = {"prompt": list(range(1, 33)), "max_tokens": 2000, "ignore_eos": True}
        sent, _ = await asyncio.gather(_post_then_disconnect(app, body, went_away),
                                       hang_up_once_running())
        assert sent[0]["status"] == 499  # nobody reads it; nginx's "client closed request"
        # The abort is queued before this request, and the loop takes its inbox in order.
        after = await loop.submit("r2", [1, 2, 3], SamplingParams(max_tokens=1), None).get()
        assert after[0].finished
        counters = loop.counters.snapshot()
        assert counters["requests_aborted"] == 1  # not run to 2,000 tokens for nobody
        assert counters["requests_finished"] == 1  # r2
        assert counters["generation_tokens"] < 2000 + 1
    finally:
        loop.stop()
    assert engine.scheduler.is_empty()
    engine.check_integrity()


# ---------------------------------------------------------------------- the engine loop
def _long_engine() -> Engine:
    """Room for one long generation: 2,048 tokens in 16-token blocks = 128 blocks (+ null)."""
    return Engine(ModelConfig.tiny(), EngineConfig(num_blocks=160, block_size=BLOCK_SIZE,
                                                   max_model_len=2048))


async def test_counters_are_current_before_the_first_step():
    loop = EngineLoop(_plain_engine())
    snapshot = loop.counters.snapshot()
    # Nothing ran yet, but /metrics must already show the scheduler's figures, not omit them.
    assert (snapshot["num_running_reqs"], snapshot["num_held_reqs"]) == (0, 0)
    assert snapshot["kv_cache_usage"] == 0.0
    assert snapshot["steps"] == 0


async def test_abort_mid_generation_refreshes_the_counters():
    engine = _long_engine()
    loop = EngineLoop(engine)
    loop.start()
    try:
        # 2,000 tokens to generate: the abort below lands long before the last one.
        results = loop.submit("r1", list(range(1, 33)),
                              SamplingParams(max_tokens=2000, ignore_eos=True), None)
        output, _ = await results.get()
        assert not output.finished
        running = loop.counters.snapshot()
        assert running["num_running_reqs"] == 1
        assert running["kv_cache_usage"] > 0.0
        loop.abort("r1")  # what the HTTP layer does when the client goes away
        while not output.finished:
            output, _ = await results.get()
        assert output.finish_reason == "abort"
        # No step has to run for the abort to show: the loop refreshed the figures before it
        # delivered the abort, and an idle loop would not step again.
        after = loop.counters.snapshot()
        assert (after["num_running_reqs"], after["num_waiting_reqs"]) == (0, 0)
        assert after["kv_cache_usage"] == 0.0  # every block back on the free queue
        assert after["requests_aborted"] == 1
        assert after["requests_finished"] == 0
    finally:
        loop.stop()
    assert engine.scheduler.is_empty()
    engine.check_integrity()
