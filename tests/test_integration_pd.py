"""Integration: real node processes on 127.0.0.1 with KV moving over UCX, a real Redis (the
``redis_server`` fixture), the pd_pair main job, and the failure cases of issue 8 part 6.

The module starts one prefill node P and one decode node D (kvbridge-node) and runs, in
file order: a short pd_pair run (its own P and D), a malformed request body, P restarted, P
frozen mid-transfer then killed. Every completion is compared with a local single-node run of the
same seeded model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from kvbridge.connector.serve.demo.processes import ManagedProcess, ProcessGroup
from kvbridge.kernels.model import ByteTokenizer, ModelConfig
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE = 16
LOAD_TIMEOUT_S = 3.0
MAX_TOKENS = 6
# 9 full blocks and a partial tenth: D pulls 9 blocks' worth of KV, recomputes the last token.
PROMPT = ByteTokenizer().encode(
    "Return a new partial object which when called will behave like func called with the "
    "positional arguments args and keyword arguments keywords."
)[:150]
NODE_ARGS = [
    "--block-size", str(BLOCK_SIZE),
    "--num-blocks", "256",
    "--max-model-len", "512",
    "--kv-transfer-config",
    json.dumps({"kv_connector_extra_config": {
        "load_timeout_s": LOAD_TIMEOUT_S, "lease_s": 10.0, "heartbeat_interval_s": 1.0,
    }}),
]


def _reference(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a single local node without a connector or prefix caching."""
    engine = Engine(
        ModelConfig.tiny(),
        EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=512,
                     enable_prefix_caching=False),
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("ref", prompt, params)
    while True:
        for output in engine.step():
            if output.finished:
                return list(output.token_ids)


def _complete(url: str, body: dict, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def _prefill(url: str, prompt: list[int]) -> dict:
    reply = _complete(url, {"prompt": prompt, "max_tokens": 1,
                            "kv_transfer_params": {"do_remote_decode": True}})
    assert reply.status_code == 200, reply.text
    params = reply.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return params


def _decode_stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=10.0).json()


def _wait_for_stats(url: str, done, timeout_s: float = 10.0) -> dict:
    """Poll ``url``'s /v1/stats until ``done(stats)`` (a notice crosses processes); the last
    stats either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _decode_stats(url)
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture(scope="module")
def nodes(redis_server, tmp_path_factory) -> Iterator[dict[str, ManagedProcess | ProcessGroup]]:
    group = ProcessGroup(tmp_path_factory.mktemp("pd-nodes"))
    args = [*NODE_ARGS, "--index-url", redis_server.url]
    try:
        prefill = group.start_node("prefill", "prefill", [*args, "--engine-id", "it-prefill"])
        decode = group.start_node("decode", "decode", [*args, "--engine-id", "it-decode"])
        group.wait_healthy([prefill, decode])
        yield {"group": group, "prefill": prefill, "decode": decode, "args": args}
    finally:
        group.stop_all()


def test_pd_pair_short_run_has_no_mismatch(redis_server, tmp_path):
    # (1) the main job end to end, small: 2 conversations x 2 turns, 4 output tokens each.
    completed = subprocess.run(
        [sys.executable, "-m", "kvbridge.connector.serve.demo.pd_pair",
         "--redis-url", redis_server.url,
         "--conversations", "2", "--turns", "2", "--max-tokens", "4", "--no-progress",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=110, env={**os.environ},
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["mismatches"] == 0
    assert report["errors"] == 0
    assert report["completed"] == 4  # 2 conversations x 2 turns
    assert report["output_tokens"] == 16  # 4 requests x 4 tokens (ignore_eos)
    assert report["kv_bytes_moved"] > 0  # the decode node pulled KV from the prefill node
    assert report["kv_same_host_fraction"] == 1.0  # P and D share this host: no byte over UCX


def _metric(url: str, name: str) -> float:
    """The value of ``name``'s one series in ``url``'s /metrics (Prometheus text)."""
    for line in httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def test_malformed_body_is_400_and_node_keeps_serving(nodes):
    url = nodes["decode"].url
    rejected_before = _metric(url, "kvbridge_kv_rejected_params_total")
    bad_bodies = [
        (b"not json", "body is not valid JSON"),
        (json.dumps({"prompt": 5}).encode(), "prompt: required"),
        (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"prompt": [1, 2, 999]}).encode(), "token id 999"),
        # a pull ticket without its fields: refused at admission by the connector
        (json.dumps({"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True}})
         .encode(), "kv_transfer_params"),
    ]
    for raw, expected in bad_bodies:
        reply = httpx.post(f"{url}/v1/completions", content=raw, timeout=30.0,
                           headers={"content-type": "application/json"})
        assert reply.status_code == 400, (raw, reply.text)
        assert expected in reply.json()["error"]["message"], reply.text
    # Only the pull ticket without its fields is bad kv_transfer_params (the other bodies are
    # refused before the connector sees them): counted once, at admission.
    assert _metric(url, "kvbridge_kv_rejected_params_total") == rejected_before + 1
    # The node still serves: a plain request on D computes locally and matches the reference.
    reply = _complete(url, {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == _reference(PROMPT, MAX_TOKENS)
    assert httpx.get(f"{url}/health", timeout=5.0).status_code == 200


def test_body_refused_by_decode_releases_the_prefill_lease(nodes):
    prefill, decode = nodes["prefill"], nodes["decode"]
    prompt = [*PROMPT[:-3], ord("#")]
    released_before = _decode_stats(prefill.url)["transfer"]["num_released_leases"]
    ticket = _prefill(prefill.url, prompt)
    assert _decode_stats(prefill.url)["counters"]["num_held_reqs"] == 1  # kept for D's pull
    # (1) D refuses the body itself (max_tokens 0) before its engine sees the ticket.
    reply = _complete(decode.url, {"prompt": prompt, "max_tokens": 0,
                                   "kv_transfer_params": ticket})
    assert reply.status_code == 400, reply.text
    # (2) D's connector sent P a release notice: P frees the blocks now, not in lease_s (10 s).
    stats = _wait_for_stats(
        prefill.url, lambda s: s["transfer"]["num_released_leases"] > released_before
    )
    assert stats["transfer"]["num_released_leases"] == released_before + 1
    stats = _wait_for_stats(prefill.url, lambda s: s["counters"]["num_held_reqs"] == 0)
    assert stats["counters"]["num_held_reqs"] == 0
    assert stats["transfer"]["num_expired_leases"] == 0  # released, not timed out


async def test_proxy_routes_through_prefill_then_decode(nodes, redis_server):
    from kvbridge.connector.serve.proxy import PDRouter, PrefixLocator, build_app
    from kvbridge.transport import BlockIdentity

    locator = PrefixLocator(redis_server.url, identity=BlockIdentity(
        model_name="kvbridge-tiny", kv_cache_dtype="float32", block_size=BLOCK_SIZE,
        hash_fn_name="sha256_cbor"))
    router = PDRouter([nodes["prefill"].url], [nodes["decode"].url], locator=locator)
    prompt = [*PROMPT[:-2], ord("?"), ord("?")]
    expected = _reference(prompt, MAX_TOKENS)
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        # (1) whole answer: D's tokens, D pulled from P (its KV wait was measured)
        reply = await client.post("/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected
        assert reply.json()["kvbridge"]["kv_load_s"] is not None
        # (2) streamed: D's chunks come through the proxy
        reply = await client.post("/v1/completions", json={**body, "stream": True}, timeout=60)
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        assert [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] \
            == expected
        # (3) the index now names P as a holder of the prompt's prefix
        assert any(holder == "it-prefill" for holder, _ in locator.holders(prompt))
    await router.aclose()


def test_prefill_restart_old_ticket_recomputes_and_index_drops_old_entries(nodes, redis_server):
    from kvbridge.connector.index.protocol import IndexNamespace
    from kvbridge.connector.index.redis_index import RedisBlockIndex
    from kvbridge.kvmanager import Request, get_request_block_hasher
    from kvbridge.transport import BlockIdentity

    group, old = nodes["group"], nodes["prefill"]
    ticket = _prefill(old.url, PROMPT)
    index = RedisBlockIndex(
        IndexNamespace(identity=BlockIdentity(model_name="kvbridge-tiny", kv_cache_dtype="float32",
                                              block_size=BLOCK_SIZE, hash_fn_name="sha256_cbor")),
        redis_server.url,
    )
    probe = Request("probe", PROMPT, SamplingParams(max_tokens=1),
                    block_hasher=get_request_block_hasher(BLOCK_SIZE, "sha256_cbor"))
    before = index.longest_prefix(probe.block_hashes)
    # (1) restart P under the same engine id (a new incarnation)
    old.kill()
    new = group.start_node("prefill-2", "prefill", [*nodes["args"], "--engine-id", "it-prefill"])
    group.wait_healthy([new])
    nodes["prefill"] = new
    # (2) the old ticket names blocks of the dead incarnation: D's pull is refused or fails,
    # the policy (recompute) computes the prompt locally, and the output is still right.
    start = time.monotonic()
    reply = _complete(nodes["decode"].url, {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                            "ignore_eos": True, "kv_transfer_params": ticket})
    assert reply.status_code == 200, reply.text
    assert time.monotonic() - start < LOAD_TIMEOUT_S + 10.0
    assert reply.json()["choices"][0]["token_ids"] == _reference(PROMPT, MAX_TOKENS)
    # (3) the index: the restarted node's old entries are gone.
    after = index.longest_prefix(probe.block_hashes)
    index.close()
    assert any(h.node_id == "it-prefill" for h in before.holders)  # P published its blocks
    old_incarnation = next(h.incarnation for h in before.holders if h.node_id == "it-prefill")
    assert all(h.incarnation != old_incarnation for h in after.holders)


def test_prefill_frozen_mid_transfer_decode_ends_by_deadline_and_keeps_serving(nodes):
    prefill, decode = nodes["prefill"], nodes["decode"]
    prompt = [*PROMPT[:-1], ord("!")]  # not in D's prefix cache from the earlier tests
    ticket = _prefill(prefill.url, prompt)
    failed_before = _decode_stats(decode.url)["transfer"]["num_failed_loads"]
    # (1) P stops answering (SIGSTOP) right after handing out the ticket, so D's pull starts
    # against a peer that never completes it: the request can only end by D's load deadline.
    # (A kill at a random instant inside a ~20 ms pull would not reliably land mid-transfer.)
    os.kill(prefill.popen.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        reply = _complete(decode.url, {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                       "ignore_eos": True, "kv_transfer_params": ticket})
        elapsed = time.monotonic() - start
    finally:
        prefill.kill()  # SIGKILL works on a stopped process
    # (2) policy "recompute": the request ends normally with the right tokens, in time.
    assert reply.status_code == 200, reply.text
    assert elapsed < LOAD_TIMEOUT_S + 10.0
    assert reply.json()["choices"][0]["token_ids"] == _reference(prompt, MAX_TOKENS)
    assert _decode_stats(decode.url)["transfer"]["num_failed_loads"] == failed_before + 1
    # (3) D keeps serving.
    reply = _complete(decode.url, {"prompt": "still here?", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    metrics = httpx.get(f"{decode.url}/metrics", timeout=5.0).text
    assert "kvbridge_kv_failed_loads_total" in metrics
