"""The proxy's checks in front of the prefill hop, in process (nodes faked by httpx's mock
transport): a body decode would refuse never reaches prefill, a client that hangs up cancels the
hop in flight, a valid body goes to prefill then decode with P's ticket."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from _serve_builders import _post_then_disconnect, _pull_ticket
from kvbridge.connector.serve import proxy


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
