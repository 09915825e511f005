"""The P/D proxy: one OpenAI-style endpoint in front of prefill and decode nodes (xPyD).

    kvbridge-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000 [--index-url redis://127.0.0.1:6379/0]

An IPv6 node or index takes brackets (``--prefill http://[::1]:8100``, ``redis://[::1]:6379/0``);
a URL that is not ``http(s)://host[:port]`` is refused at start, in one line.

For each ``POST /v1/completions`` (docs/architecture.md, "Life of a P/D request"):

0. validate the client's body with the decode node's own parser
   (connector/serve/http_body.py): a body D would refuse is a 400 before anything is sent, so it
   never costs a prefill on P nor pins P's blocks under a lease (the P hop overrides
   ``max_tokens`` and ``stream``, so P alone would accept it);
1. choose a prefill node P: with ``--index-url``, the P that the block index says holds the
   longest prefix of the prompt (ties and misses: round-robin); otherwise round-robin;
2. send P the request with ``kv_transfer_params = {"do_remote_decode": true}``, ``max_tokens = 1``,
   ``stream = false``;
3. send a decode node D (round-robin) the original request with P's returned
   ``kv_transfer_params``, and stream D's answer back (or return it whole).

A P or D that answers an error is passed through with its status code; one that cannot be reached
answers 502. A client that disconnects, streaming or not, has the hop in flight cancelled, so P
or D aborts the request (connector/serve/http_disconnect.py). :class:`PDRouter` is the reusable part
(kvbridge-demo drives it directly).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvbridge.kernels.model import ByteTokenizer
from kvbridge.transport import check_host, parse_base_url

from .cli import CommandParser, serve_http
from .http_body import BadRequest, CompletionBody
from .http_disconnect import CLIENT_CLOSED_STATUS, ClientDisconnected, DisconnectWatch

if TYPE_CHECKING:
    from kvbridge.transport import BlockIdentity

__all__ = ["PDResult", "PDRouter", "PrefixLocator", "build_app", "main"]

logger = logging.getLogger("kvbridge.proxy")


class HopError(Exception):
    """A node answered an error or could not be reached; ``status`` is passed to the client."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


@dataclass(frozen=True, kw_only=True, slots=True)
class PDResult:
    """One disaggregated completion.

    Attributes:
        response: D's final JSON answer.
        prefill: P's JSON answer (its ``kv_transfer_params`` went to D).
        prefill_url, decode_url: the nodes used.
        prefill_hop_s: wall time of the request to P (queue + prefill + HTTP), seconds.
        decode_hop_s: wall time of the request to D, seconds.
    """

    response: dict[str, Any]
    prefill: dict[str, Any]
    prefill_url: str
    decode_url: str
    prefill_hop_s: float
    decode_hop_s: float


class PrefixLocator:
    """Which prefill node holds the longest prefix of a prompt, from the block index.

    Args:
        index_url: ``redis://...`` or ``redis-cluster://HOST:PORT[,...]`` of the index the
            nodes publish to.
        identity: the nodes' ``kvbridge.transport.BlockIdentity`` (model, revision, KV cache
            dtype, layout, block size, hash function): the index namespace, so every field
            must equal the nodes' or no lookup finds their blocks.
    """

    def __init__(self, index_url: str, *, identity: BlockIdentity) -> None:
        from kvbridge.connector.index import IndexNamespace, block_index_for_url
        from kvbridge.kvmanager import get_request_block_hasher

        self._index = block_index_for_url(
            index_url, IndexNamespace(identity=identity),
            meanwhile="routing each request round-robin meanwhile (no prefix-aware choice of P)")
        self._hasher = get_request_block_hasher(identity.block_size, identity.hash_fn_name)

    def holders(self, prompt_token_ids: Sequence[int]) -> list[tuple[str, int]]:
        """``(node_id, num_blocks)`` of every holder, longest first (empty: no hit or no index)."""
        from kvbridge.kvmanager import Request, SamplingParams

        probe = Request(
            "probe", list(prompt_token_ids), SamplingParams(max_tokens=1), block_hasher=self._hasher
        )
        hit = self._index.longest_prefix(probe.block_hashes)
        return [(h.node_id, h.num_blocks) for h in hit.holders]

    def close(self) -> None:
        self._index.close()


class PDRouter:
    """Routes completions through a prefill node then a decode node.

    Args:
        prefill_urls, decode_urls: base URLs (``http://host:port``, ``http://[ipv6]:port``), at
            least one each; a trailing ``/`` is dropped. ValueError (one line) for one that is
            not such a URL (``kvbridge.transport.parse_base_url``).
        locator: optional index-aware choice of P.
        timeout_s: per-hop HTTP timeout (D's own load deadline should be shorter).
    """

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        *,
        locator: PrefixLocator | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("need at least one prefill URL and one decode URL")
        self.prefill_urls = [parse_base_url(u, what="prefill URL") for u in prefill_urls]
        self.decode_urls = [parse_base_url(u, what="decode URL") for u in decode_urls]
        self._next_p = itertools.cycle(range(len(self.prefill_urls)))
        self._next_d = itertools.cycle(range(len(self.decode_urls)))
        self._locator = locator
        self._engine_id_to_url: dict[str, str] = {}
        self._tokenizer = ByteTokenizer()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._locator is not None:
            self._locator.close()

    async def _learn_engine_ids(self) -> None:
        for url in self.prefill_urls:
            if url in self._engine_id_to_url.values():
                continue
            try:
                health = (await self.client.get(f"{url}/health")).json()
                self._engine_id_to_url[str(health["engine_id"])] = url
            except (httpx.HTTPError, ValueError, KeyError):
                continue

    async def choose_prefill(self, prompt: str | list[int]) -> str:
        """The P holding the longest indexed prefix of ``prompt``, else the next round-robin."""
        if self._locator is not None:
            await self._learn_engine_ids()
            token_ids = self._tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            for node_id, _num_blocks in self._locator.holders(token_ids):
                url = self._engine_id_to_url.get(node_id)
                if url is not None:
                    return url
        return self.prefill_urls[next(self._next_p)]

    def choose_decode(self) -> str:
        return self.decode_urls[next(self._next_d)]

    async def post(self, url: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """POST ``body`` to ``url``'s ``/v1/completions``; its JSON answer. Raises HopError
        (the node's status, or 502 when it cannot be reached)."""
        try:
            reply = await self.client.post(
                f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}
            )
        except httpx.HTTPError as exc:
            raise HopError(502, {"error": {"message": f"{url}: {exc!r}"}}) from exc
        try:
            data = reply.json()
        except ValueError:
            data = {"error": {"message": reply.text}}
        if reply.status_code != 200:
            raise HopError(reply.status_code, data)
        return data

    @staticmethod
    def check_body(body: Any) -> CompletionBody:
        """The client's body as the decode node will parse it.

        Raises:
            HopError: 400 naming the bad field (nothing was sent to any node).
        """
        try:
            return CompletionBody.parse(body)
        except BadRequest as exc:
            raise HopError(400, {"error": {"message": str(exc), "type": "invalid_request_error",
                                           "code": 400}}) from exc

    async def prefill(self, body: dict[str, Any], request_id: str) -> tuple[str, dict, float]:
        """Run the prefill hop; returns ``(P url, P's answer, seconds)``.

        Raises:
            HopError: P answered an error, could not be reached, or returned no params.
        """
        url = await self.choose_prefill(body.get("prompt", ""))
        p_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        start = time.perf_counter()
        answer = await self.post(url, p_body, request_id)
        elapsed = time.perf_counter() - start
        if not answer.get("kv_transfer_params"):
            reason = answer.get("choices", [{}])[0].get("finish_reason")
            raise HopError(502, {"error": {"message": f"{url} returned no kv_transfer_params "
                                                      f"(finish_reason {reason!r})"}})
        return url, answer, elapsed

    async def complete(self, body: dict[str, Any], request_id: str | None = None) -> PDResult:
        """A whole (non-streamed) disaggregated completion. Raises HopError (400 for a body the
        decode node would refuse, before P sees it)."""
        self.check_body(body)
        request_id = request_id or f"pd-{uuid.uuid4().hex}"
        p_url, p_answer, p_s = await self.prefill(body, request_id)
        d_url = self.choose_decode()
        d_body = {**body, "stream": False, "kv_transfer_params": p_answer["kv_transfer_params"]}
        start = time.perf_counter()
        d_answer = await self.post(d_url, d_body, request_id)
        d_s = time.perf_counter() - start
        return PDResult(
            response=d_answer,
            prefill=p_answer,
            prefill_url=p_url,
            decode_url=d_url,
            prefill_hop_s=p_s,
            decode_hop_s=d_s,
        )

    async def stream(self, body: dict[str, Any], request_id: str) -> AsyncIterator[bytes]:
        """D's server-sent events for a streamed completion (after the prefill hop). Raises
        HopError, as :meth:`complete`."""
        self.check_body(body)
        _, p_answer, _ = await self.prefill(body, request_id)
        d_url = self.choose_decode()
        d_body = {**body, "stream": True, "kv_transfer_params": p_answer["kv_transfer_params"]}
        async with self.client.stream(
            "POST", f"{d_url}/v1/completions", json=d_body, headers={"X-Request-Id": request_id}
        ) as reply:
            if reply.status_code != 200:
                raise HopError(reply.status_code, (await reply.aread()).decode())
            async for chunk in reply.aiter_raw():
                yield chunk


def build_app(router: PDRouter) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.aclose()

    app = FastAPI(title="kvbridge P/D proxy", lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        states = {}
        for url in router.prefill_urls + router.decode_urls:
            try:
                states[url] = (await router.client.get(f"{url}/health")).status_code == 200
            except httpx.HTTPError:
                states[url] = False
        return JSONResponse({"status": "ok" if all(states.values()) else "degraded",
                             "nodes": states}, 200 if all(states.values()) else 503)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError as exc:
            return JSONResponse({"error": {"message": f"body is not valid JSON: {exc}"}}, 400)
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        try:
            # A client that goes away cancels the hop in flight: closing that connection makes
            # P or D abort the request (their own DisconnectWatch) instead of finishing it.
            async with DisconnectWatch(request) as watch:
                if router.check_body(body).stream:
                    stream = router.stream(body, request_id)
                    try:
                        # surfaces P's or D's error before the 200
                        first = await watch.wait(anext(stream))
                    except ClientDisconnected:
                        await stream.aclose()
                        raise

                    async def chained() -> AsyncIterator[bytes]:
                        yield first
                        async for chunk in stream:
                            yield chunk

                    return StreamingResponse(chained(), media_type="text/event-stream")
                result = await watch.wait(router.complete(body, request_id))
        except HopError as exc:
            return JSONResponse(exc.body, exc.status)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return JSONResponse(result.response)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="kvbridge-proxy", description="kvbridge P/D proxy (xPyD)")
    parser.add_argument("--prefill", action="append", required=True, help="P base URL")
    parser.add_argument("--decode", action="append", required=True, help="D base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--index-url", default=None,
        help="redis://... or redis-cluster://HOST:PORT[,...] for index-aware P choice",
    )
    # The nodes' block identity (kvbridge.transport.BlockIdentity), the index namespace; the
    # defaults are kvbridge-node's with --model tiny.
    parser.add_argument("--model-name", default="kvbridge-tiny", help="the nodes' model_name")
    parser.add_argument("--model-revision", default="", help="the nodes' model_revision")
    parser.add_argument("--kv-cache-dtype", default="float32", help="the nodes' KV cache dtype")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-fn", default="sha256_cbor")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per hop is too much
    locator = None
    try:  # a bad address is refused here, in one line, before anything connects
        check_host(args.host, what="--host")
        for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
            for url in urls:
                parse_base_url(url, what=flag)
        if args.index_url:
            from kvbridge.transport import BlockIdentity

            identity = BlockIdentity(
                model_name=args.model_name,
                model_revision=args.model_revision,
                kv_cache_dtype=args.kv_cache_dtype,
                block_size=args.block_size,
                hash_fn_name=args.hash_fn,
            )
            locator = PrefixLocator(args.index_url, identity=identity)
    except ValueError as exc:
        parser.error(str(exc))
    router = PDRouter(args.prefill, args.decode, locator=locator)
    serve_http(build_app(router), host=args.host, port=args.port,
               announce_fields={"prefill": args.prefill, "decode": args.decode})
    return 0


if __name__ == "__main__":
    sys.exit(main())
