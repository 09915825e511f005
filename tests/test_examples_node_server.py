"""The examples' own logic, in process: request-body validation, role -> kv_transfer_config,
the HTTP app around a plain engine (served through httpx's ASGI transport, no sockets), the
proxy's checks in front of the prefill hop (nodes faked by httpx's mock transport), the trace
expansion, the main job's checks of its inputs and the report's percentile."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
from kvbridge.kernels.model import ModelConfig
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import pd_pair
import proxy
from node_loop import EngineLoop
from node_server import BadRequest, CompletionBody, build_app, kv_transfer_config_dict
from pd_processes import free_port
from pd_report import percentile
from pd_workload import trace_requests

BLOCK_SIZE = 16


def _args(**overrides) -> argparse.Namespace:
    fields = dict(role="both", port=8000, host="127.0.0.1", model="tiny", engine_id=None,
                  kv_transfer_config=None, index_url=None)
    fields.update(overrides)
    return argparse.Namespace(**fields)


def _plain_engine() -> Engine:
    return Engine(ModelConfig.tiny(), EngineConfig(num_blocks=64, block_size=BLOCK_SIZE,
                                                   max_model_len=256))


def _pull_ticket(*, remote_request_id: str = "p-req-1") -> dict:
    """The kv_transfer_params a prefill node hands out (the fields D's connector reads)."""
    return {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "127.0.0.1",
            "remote_port": 4000, "remote_request_id": remote_request_id,
            "remote_block_ids": [[1, 2]], "remote_num_tokens": 32}


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


async def _post_then_disconnect(app, body: dict, went_away: asyncio.Event) -> list[dict]:
    """POST ``body`` to ``app`` over raw ASGI; the client hangs up once ``went_away`` is set
    (uvicorn's ``http.disconnect``). Returns the ASGI messages the app sent."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "server": ("node", 80), "client": ("client", 5000)}
    messages = iter([{"type": "http.request", "body": raw, "more_body": False}])
    sent: list[dict] = []

    async def receive() -> dict:
        message = next(messages, None)
        if message is not None:
            return message
        await went_away.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


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


# ---------------------------------------------------------------------- the proxy, nodes faked
def _fake_nodes(seen: list[tuple[str, dict]]) -> httpx.MockTransport:
    """P answers a pull ticket, D a completion; every request is recorded as (url, body)."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((str(request.url), body))
        if request.url.host == "p":
            return httpx.Response(200, json={"choices": [{"token_ids": [7]}],
                                             "kv_transfer_params": _pull_ticket()})
        return httpx.Response(200, json={"choices": [{"token_ids": [7, 8]}],
                                         "kv_transfer_params": None})

    return httpx.MockTransport(handle)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": [1, 2, 3], "max_tokens": 0}, "max_tokens"),  # P's hop would say 1
        ({"prompt": [1, 2, 3], "stream": "yes"}, "stream"),  # P's hop would say false
        ({"prompt": [1, 2, 3], "temperature": 0.9}, "temperature"),
        ({"prompt": ""}, "prompt"),
        (["not", "an", "object"], "body must be a JSON object"),
    ],
)
async def test_proxy_refuses_a_body_decode_would_refuse_before_prefill_sees_it(body, field):
    seen: list[tuple[str, dict]] = []
    router = proxy.PDRouter(["http://p"], ["http://d"])
    router.client = httpx.AsyncClient(transport=_fake_nodes(seen))
    app = proxy.build_app(router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as client:
        reply = await client.post("/v1/completions", json=body)
    await router.aclose()
    assert reply.status_code == 400
    assert field in reply.json()["error"]["message"]
    assert seen == []  # neither P nor D was asked: no prefill spent, no blocks pinned


@pytest.mark.timeout(30)  # a regression waits on the hop forever: fail, never hang
async def test_proxy_cancels_the_hop_in_flight_when_the_client_disconnects():
    hop_started, hop_cancelled = asyncio.Event(), asyncio.Event()

    async def never_answers(request: httpx.Request) -> httpx.Response:
        hop_started.set()
        try:
            await asyncio.Event().wait()  # P is busy prefilling a long prompt
        except asyncio.CancelledError:
            hop_cancelled.set()  # the connection closes: a real P would abort the request
            raise
        raise AssertionError("unreachable")

    router = proxy.PDRouter(["http://p"], ["http://d"])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(never_answers))
    went_away = asyncio.Event()

    async def hang_up_once_the_hop_started() -> None:
        await hop_started.wait()
        went_away.set()

    for stream in (False, True):
        hop_started.clear()
        hop_cancelled.clear()
        went_away.clear()
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
        sent, _ = await asyncio.gather(
            _post_then_disconnect(proxy.build_app(router), body, went_away),
            hang_up_once_the_hop_started(),
        )
        assert sent[0]["status"] == 499, stream
        assert hop_cancelled.is_set(), stream
    await router.aclose()


async def test_proxy_sends_a_valid_body_to_prefill_then_decode():
    seen: list[tuple[str, dict]] = []
    router = proxy.PDRouter(["http://p"], ["http://d"])
    router.client = httpx.AsyncClient(transport=_fake_nodes(seen))
    app = proxy.build_app(router)
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as client:
        reply = await client.post("/v1/completions", json=body)
    await router.aclose()
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == [7, 8]  # D's answer
    assert [url for url, _ in seen] == ["http://p/v1/completions", "http://d/v1/completions"]
    # P's hop: one token, not streamed, asked to keep the KV for D; D's hop carries P's ticket.
    assert seen[0][1] == {**body, "max_tokens": 1, "stream": False,
                          "kv_transfer_params": {"do_remote_decode": True}}
    assert seen[1][1] == {**body, "stream": False, "kv_transfer_params": _pull_ticket()}


# ---------------------------------------------------------------------- workload and report
def test_trace_expansion_keeps_shared_prefixes_and_scales_lengths(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 40, "hash_ids": [7, 8]},
        {"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [7, 9]},
        {"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [7]},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    out = list(trace_requests(trace, block_size=BLOCK_SIZE, limit=10, max_output_tokens=16,
                              max_prompt_tokens=1000))
    # 1024 tokens at 512 per block = 2 blocks -> 32 tokens; 1000 -> ceil(31.25) = 32; 1 -> 1.
    assert [len(r.prompt_token_ids) for r in out] == [32, 32, 1]
    assert [r.output_tokens for r in out] == [16, 3, 1]  # capped by max_output_tokens
    # Hash id 7 expands to the same 16 tokens everywhere; 8 and 9 differ.
    assert out[0].prompt_token_ids[:16] == out[1].prompt_token_ids[:16]
    assert out[0].prompt_token_ids[16:] != out[1].prompt_token_ids[16:]
    assert out[2].prompt_token_ids == out[0].prompt_token_ids[:1]
    assert len(list(trace_requests(trace, block_size=BLOCK_SIZE, limit=1, max_output_tokens=4,
                                   max_prompt_tokens=100))) == 1


# ---------------------------------------------------------------------- pd_pair's inputs
def _run_pd_pair(capsys, *argv: str) -> tuple[int, list[str], str]:
    """``pd_pair.run`` in process: (exit code, stderr lines, last stdout line)."""
    code = pd_pair.run(pd_pair.parse_args(["--no-progress", *argv]))
    out, err = capsys.readouterr()
    return code, err.splitlines(), out.splitlines()[-1]


def test_pd_pair_missing_trace_is_one_line_naming_the_source(capsys, tmp_path):
    missing = tmp_path / "conversation_trace.jsonl"
    code, err, last = _run_pd_pair(capsys, "--trace", str(missing), "--workdir", str(tmp_path))
    assert code == 2  # nothing was started
    assert err == [f"ERROR: --trace {missing}: no such file (the trace comes from the Mooncake "
                   "FAST'25 trace release: conversation_trace.jsonl in github.com/kvcache-ai/"
                   "Mooncake, folder FAST25-release/traces)"]
    assert json.loads(last)["usage_error"].startswith(f"--trace {missing}: no such file")


def test_pd_pair_trace_that_is_not_a_trace_is_one_line(capsys, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_length": 16}\n')  # no output_length, no hash_ids
    code, err, _ = _run_pd_pair(capsys, "--trace", str(trace), "--workdir", str(tmp_path))
    assert code == 2
    assert len(err) == 1
    assert err[0].startswith(f"ERROR: --trace {trace}: {trace}:1: not a Mooncake trace line")


def test_pd_pair_unreachable_redis_url_is_an_error_not_a_silent_fallback(capsys, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    code, err, last = _run_pd_pair(capsys, "--redis-url", url, "--workdir", str(tmp_path))
    assert code == 2
    assert len(err) == 1
    assert err[0].startswith(f"ERROR: --redis-url {url}: no Redis answered PING (")
    assert err[0].endswith("or pass --no-redis")
    assert list(tmp_path.iterdir()) == []  # no child was started, so no log was written
    assert json.loads(last)["errors"] == 1


def test_pd_pair_redis_url_and_no_redis_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pd_pair.parse_args(["--redis-url", "redis://127.0.0.1:6379/0", "--no-redis"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.5) is None
