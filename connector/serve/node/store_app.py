"""The HTTP face of a store node (``kvbridge-node --role store``).

A store node runs no model: it is a ``kvbridge.connector.store.StoreNode`` (offloaded blocks
in host memory, served to pullers over the same transport as any holder, written through a small
TCP write server, published to the block index as tier ``"store"``). This app gives it the same
management routes as a node:

- ``GET /health``: 200 with ``engine_id``, ``role`` = ``"store"`` and ``store_url`` (the write
  server's ``host:port``, ``[ipv6]:port`` for IPv6, which prefill and decode nodes take as
  ``store_url`` in their ``kv_connector_extra_config``);
- ``GET /metrics`` (Prometheus) and ``GET /v1/stats`` (JSON): the store's ``StoreStats``;
- ``POST /v1/completions``: 400, a store node serves no completions.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["build_store_app", "build_store_node"]

_GAUGES = ("capacity_blocks", "hit_ratio")


def build_store_node(args: argparse.Namespace, model_config: Any, config: dict[str, Any]) -> Any:
    """A started ``StoreNode`` for the CLI arguments and the node's ``kv_transfer_config``."""
    from kvbridge.connector import KVTransferConfig
    from kvbridge.connector.index.client import INDEX_SOCKET_TIMEOUT_S
    from kvbridge.connector.store import StoreNode, start_store_node

    extra = config.get("kv_connector_extra_config") or {}
    node = StoreNode(
        model_config,
        block_size=args.block_size,
        capacity_bytes=args.store_capacity_mb << 20,
        engine_id=str(config.get("engine_id", f"store-{args.port}")),
        model_name=str(extra.get("model_name", "kvbridge")),
        model_revision=str(extra.get("model_revision", "")),
        index_url=extra.get("index_url"),
        index_socket_timeout_s=float(extra.get("index_socket_timeout_s", INDEX_SOCKET_TIMEOUT_S)),
        host=str(extra.get("host", "127.0.0.1")),
        port=int(extra.get("port", 0)),
        write_host=str(extra.get("host", "127.0.0.1")),
        write_port=args.store_write_port,
        transport=extra.get("transport", "ucxx"),
        auth_key=KVTransferConfig(  # the cluster key, from the same keys as every node's
            auth_key=extra.get("auth_key"),
            auth_key_env=extra.get("auth_key_env"),
            auth_key_file=extra.get("auth_key_file"),
        ).auth_key_bytes(),
    )
    return start_store_node(node)


class _StoreCollector(Collector):
    def __init__(self, node: Any) -> None:
        self._node = node

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        labels = ["role", "engine_id"]
        values = ["store", self._node.engine_id]
        for key, value in self._node.stats.snapshot().items():
            if value is None:
                continue
            kind = GaugeMetricFamily if key in _GAUGES else CounterMetricFamily
            family = kind(f"kvbridge_store_{key}", f"store node {key}", labels=labels)
            family.add_metric(values, float(value))
            yield family


def build_store_app(node: Any, *, model_name: str) -> FastAPI:
    """The management app of a started store node."""
    app = FastAPI(title="kvbridge store node")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StoreCollector(node))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({
            "status": "ok",
            "role": "store",
            "engine_id": node.engine_id,
            "model": model_name,
            "block_size": node.block_size,
            "store_url": node.store_url,
        })

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        return JSONResponse({"role": "store", "engine_id": node.engine_id,
                             "store": node.stats.snapshot()})

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse(
            {"error": {"message": "a store node serves no completions; send them to a prefill "
                                  "or decode node", "type": "invalid_request_error",
                       "code": 400}},
            400,
        )

    return app
