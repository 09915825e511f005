"""Builders shared by the examples' tests (``test_serve_*.py``): the block size of their
engines, the pull ticket a prefill node hands out, and a raw-ASGI POST whose client hangs up.
"""

from __future__ import annotations

import asyncio
import json

BLOCK_SIZE = 16


def _pull_ticket(*, remote_request_id: str = "p-req-1") -> dict:
    """The kv_transfer_params a prefill node hands out (the fields D's connector reads)."""
    return {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "127.0.0.1",
            "remote_port": 4000, "remote_request_id": remote_request_id,
            "remote_block_ids": [[1, 2]], "remote_num_tokens": 32}


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
