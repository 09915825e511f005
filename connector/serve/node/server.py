"""One kvbridge node over an OpenAI-style HTTP API (FastAPI + uvicorn).

    kvbridge-node --role prefill --port 8100 --index-url redis://127.0.0.1:6379/0
    kvbridge-node --role decode  --port 8200 --index-url redis://127.0.0.1:6379/0

Routes:

- ``POST /v1/completions``: ``{"prompt": str | [int], "max_tokens": int, "stream": bool,
  "kv_transfer_params": {...} | null, "ignore_eos": bool}`` (vLLM's proxy puts
  ``kv_transfer_params`` in the body). Answers an OpenAI ``text_completion`` with
  ``choices[0].token_ids``, the top-level ``kv_transfer_params`` for the next hop (a prefill node's
  pull ticket for the decode node), and ``kvbridge`` (this node's timings and cache hit). With
  ``"stream": true`` it answers server-sent events, one chunk per step, ending ``data: [DONE]``.
  A client that disconnects, streaming or not, has its request aborted
  (connector/serve/http_disconnect.py).
  A malformed body (connector/serve/http_body.py), or a request the engine refuses at admission
  (``Engine.add_request`` raises ``ValueError``: bad token ids, a prompt too long, malformed
  ``kv_transfer_params``), is a 400 with the message; the node keeps serving. Either way, a
  refused body that carries a pull ticket (``"do_remote_prefill": true``) has the connector
  tell that prefill node to release its blocks (``on_request_rejected``), so a refused request
  never pins them for the whole lease.
- ``GET /health``: 200 ``{"status": "ok", "role", "engine_id", ...}``; 503 once the engine loop
  died.
- ``GET /metrics``: Prometheus text (``metrics``); ``GET /v1/stats``: the same as JSON.

Roles map onto vLLM's ``kv_role``: ``prefill`` -> ``kv_producer``, ``decode`` -> ``kv_consumer``,
``both`` -> ``kv_both``. ``store`` runs no model: it serves a ``StoreNode`` (the remote store
tier, kvbridge.connector.store.node: offloaded blocks in host memory, pulled like any holder's,
published to the index as tier ``"store"``) with /health (which names its ``store_url``), /metrics
and /v1/stats (connector/serve/node/store_app.py). ``both`` without ``--kv-transfer-config`` and
``--index-url`` is a plain node without a connector.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from kvbridge.kernels.model import ModelConfig, ReferenceDecoder
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams
from kvbridge.transport import check_host, format_host_port
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..cli import CommandParser, serve_http
from ..http_body import BadRequest, CompletionBody, remote_prefill_ticket
from ..http_disconnect import CLIENT_CLOSED_STATUS, ClientDisconnected, DisconnectWatch
from .loop import EngineLoop, RequestRejected
from .metrics import make_registry, node_stats

__all__ = ["ROLE_TO_KV_ROLE", "BadRequest", "CompletionBody", "build_app", "build_engine", "main"]

logger = logging.getLogger("kvbridge.node")

ROLE_TO_KV_ROLE = {
    "prefill": "kv_producer",
    "decode": "kv_consumer",
    "both": "kv_both",
    "store": "kv_both",
}
# ``--host`` that listens everywhere: the transport advertises the loopback of its family.
_LOOPBACK_OF_WILDCARD = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


# ---------------------------------------------------------------------- engine construction
def load_model(name: str) -> ReferenceDecoder:
    """``tiny`` / ``tiny_hybrid`` / ``small`` (seeded weights, identical in every process) or
    an HF dir."""
    if name == "tiny":
        return ReferenceDecoder(ModelConfig.tiny())
    if name == "small":
        return ReferenceDecoder(ModelConfig.small())
    if name == "tiny_hybrid":
        return ReferenceDecoder(ModelConfig.tiny_hybrid())
    if Path(name).is_dir():
        return ReferenceDecoder.from_pretrained(name)
    raise ValueError(
        f"--model must be tiny, tiny_hybrid, small or a model directory, got {name!r}"
    )


def kv_transfer_config_dict(args: argparse.Namespace) -> dict[str, Any] | None:
    """The node's vLLM-shaped ``kv_transfer_config`` from ``--kv-transfer-config``, ``--role``,
    ``--index-url`` and ``--engine-id`` (None: a plain node without a connector).

    Raises:
        ValueError: bad JSON, or a ``kv_role`` in the JSON that contradicts ``--role``.
    """
    raw = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
    if raw is None and args.index_url is None and args.role == "both":
        return None
    config = dict(raw or {})
    kv_role = ROLE_TO_KV_ROLE[args.role]
    if config.setdefault("kv_role", kv_role) != kv_role:
        raise ValueError(
            f"--role {args.role} means kv_role {kv_role!r}, but --kv-transfer-config says "
            f"{config['kv_role']!r}"
        )
    config.setdefault("kv_connector", "KVBridgeConnector")
    default_id = f"{args.role}-{args.port}-{uuid.uuid4().hex[:6]}"
    config.setdefault("engine_id", args.engine_id or default_id)
    extra = dict(config.get("kv_connector_extra_config") or {})
    if args.index_url is not None:
        extra["index_url"] = args.index_url
    extra.setdefault("host", _LOOPBACK_OF_WILDCARD.get(args.host, args.host))
    extra.setdefault("model_name", f"kvbridge-{args.model}")
    config["kv_connector_extra_config"] = extra
    return config


def build_engine(args: argparse.Namespace) -> tuple[Engine, str]:
    """The node's ``Engine`` and engine id from the CLI arguments."""
    model = load_model(args.model)
    config = kv_transfer_config_dict(args)
    engine_config = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.block_size),
        enable_kv_cache_events=config is not None,
    )
    if config is None:
        return Engine(model, engine_config), args.engine_id or f"{args.role}-{args.port}"
    from kvbridge.connector import create_engine

    engine = create_engine(model, engine_config, config)
    return engine, str(config["engine_id"])


# ---------------------------------------------------------------------- HTTP
def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def build_app(loop: EngineLoop, *, role: str, engine_id: str, model_name: str) -> FastAPI:
    """The FastAPI app of one node around a started ``EngineLoop``."""
    app = FastAPI(title=f"kvbridge node ({role})")
    registry = make_registry(loop, role=role, engine_id=engine_id)
    started_at = time.time()

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {
            "status": "ok" if loop.alive else "error",
            "role": role,
            "engine_id": engine_id,
            "model": model_name,
            "block_size": loop.engine.config.block_size,
            "started_at": started_at,
        }
        if not loop.alive:
            body["error"] = repr(loop.error)
        return JSONResponse(body, 200 if loop.alive else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(node_stats(loop, role=role, engine_id=engine_id))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        try:
            raw = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"body is not valid JSON: {exc}")
        try:
            body = CompletionBody.parse(raw)
        except BadRequest as exc:
            ticket = remote_prefill_ticket(raw)
            if ticket is not None:
                # The prefill node holds blocks under a lease for this ticket: release them now.
                loop.release_remote(ticket, str(exc))
            return _error(400, str(exc))
        request_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        if not loop.alive:
            return _error(503, f"engine loop stopped: {loop.error!r}", "server_error")
        params = SamplingParams(max_tokens=body.max_tokens, ignore_eos=body.ignore_eos)
        results = loop.submit(request_id, body.prompt, params, body.kv_transfer_params)
        try:
            async with DisconnectWatch(request) as watch:
                # A client that goes away, before its first output (a decode node may wait
                # for its KV) or while a whole answer is generated, is aborted: the engine
                # frees its blocks rather than generating for nobody.
                first = await watch.wait(results.get())
                if isinstance(first, RequestRejected):
                    return _error(400, first.message)
                if body.stream:  # leaves the watch: StreamingResponse watches on its own
                    return StreamingResponse(
                        _stream(loop, request_id, first, results, model_name),
                        media_type="text/event-stream",
                    )
                item = await watch.wait(_final_output(first, results))
        except ClientDisconnected:
            loop.abort(request_id)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except asyncio.CancelledError:
            loop.abort(request_id)
            raise
        if isinstance(item, RequestRejected):
            return _error(500, item.message, "server_error")
        return JSONResponse(_completion_json(request_id, model_name, *item, final=True))

    return app


async def _final_output(first: Any, results: asyncio.Queue) -> Any:
    """The last item of a request's queue: its finished ``(RequestOutput, RequestTimings)``, or
    a ``RequestRejected`` when the engine loop died under it."""
    item = first
    while not item[0].finished:
        item = await results.get()
        if isinstance(item, RequestRejected):
            return item
    return item


def _completion_json(
    request_id: str, model_name: str, output: Any, timings: Any, *, final: bool
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": output.text if final else "",
        "token_ids": list(output.token_ids if final else output.new_token_ids),
        "finish_reason": output.finish_reason if output.finished else None,
    }
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "kv_transfer_params": output.kv_transfer_params,
    }
    if final:
        num_prompt = len(output.prompt_token_ids)
        body["usage"] = {
            "prompt_tokens": num_prompt,
            "completion_tokens": len(output.token_ids),
            "total_tokens": num_prompt + len(output.token_ids),
        }
        body["kvbridge"] = {"num_cached_tokens": output.num_cached_tokens, **timings.to_dict()}
    return body


async def _stream(
    loop: EngineLoop, request_id: str, first: Any, results: asyncio.Queue, model_name: str
) -> AsyncIterator[bytes]:
    item = first
    try:
        while True:
            if isinstance(item, RequestRejected):
                error = {"error": {"message": item.message, "type": "server_error"}}
                yield f"data: {json.dumps(error)}\n\n".encode()
                break
            output, timings = item
            chunk = _completion_json(request_id, model_name, output, timings, final=False)
            chunk["choices"][0]["text"] = loop.engine.tokenizer.decode(output.new_token_ids)
            if output.finished:
                chunk["usage"] = _completion_json(
                    request_id, model_name, output, timings, final=True
                )["usage"]
                chunk["kvbridge"] = {
                    "num_cached_tokens": output.num_cached_tokens,
                    **timings.to_dict(),
                }
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if output.finished:
                break
            item = await results.get()
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        loop.abort(request_id)
        raise


# ---------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="kvbridge-node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=sorted(ROLE_TO_KV_ROLE), default="both")
    parser.add_argument("--host", default="127.0.0.1", help="a hostname or an IP (IPv6: '::1')")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="tiny", help="tiny, tiny_hybrid, small or an HF dir")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks incl. null block")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-transfer-config", default=None, help="vLLM-shaped JSON")
    parser.add_argument(
        "--index-url", default=None,
        help="redis://host:port/db, redis-cluster://HOST:PORT[,HOST:PORT...] or memory",
    )
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--store-capacity-mb", type=int, default=256, help="store role only")
    parser.add_argument("--store-write-port", type=int, default=0, help="store role only")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.host:
        try:
            check_host(args.host, what="--host")
        except ValueError as exc:
            parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(args.torch_threads)
    if args.role == "store":
        return _serve_store(args)
    try:
        engine, engine_id = build_engine(args)
    except ValueError as exc:  # a configuration it cannot serve (KVTransferConfigError too)
        sys.stderr.write(f"kvbridge-node: error: {exc}\n")
        return 2
    loop = EngineLoop(engine)
    loop.start()
    app = build_app(loop, role=args.role, engine_id=engine_id, model_name=args.model)
    logger.info("node %s (%s) serving on http://%s", engine_id, args.role,
                format_host_port(args.host, args.port))
    worker = engine.runner.connector
    handshake = worker.get_handshake_metadata() if worker is not None else None
    try:
        serve_http(app, host=args.host, port=args.port, announce_fields={
            "engine_id": engine_id, "role": args.role,
            **({} if handshake is None else {"transport": [handshake.host, handshake.port]}),
        })
    finally:
        loop.stop()
    return 0


def _serve_store(args: argparse.Namespace) -> int:
    from kvbridge.connector.store import close_store_node

    from .store_app import build_store_app, build_store_node

    config = kv_transfer_config_dict(args) or {}
    node = build_store_node(args, load_model(args.model).config, config)
    app = build_store_app(node, model_name=args.model)
    logger.info("store node %s serving on http://%s, writes on %s", node.engine_id,
                format_host_port(args.host, args.port), node.store_url)
    try:
        serve_http(app, host=args.host, port=args.port, announce_fields={
            "engine_id": node.engine_id, "role": "store",
            "store_url": node.store_url,
        })
    finally:
        close_store_node(node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
