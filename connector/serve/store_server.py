"""Run a store node (issue 7) as its own process.

    kvbridge-store --index-url redis://127.0.0.1:6379/0 --capacity-bytes 1073741824 \
        --host 127.0.0.1 --write-port 7600

Nodes point at it with ``kv_connector_extra_config = {"store_url": "<host>:<write port>",
"offload": "evict", "index_url": <same index>}`` (``"[<ipv6>]:<write port>"`` for an IPv6
``--host`` such as ``::1``: the JSON line prints it so); restores find it through the index.
Prints one JSON line with its addresses once serving, then serves until interrupted (Ctrl-C /
SIGTERM).

The store learns block geometries (block identity, KV layout and shapes, index namespace) from
the writers' hellos: kvbridge's own nodes and vLLM engines alike, no model named here. It keeps
each geometry on a shelf of its own (its blocks, its pull address, its index namespace), at most
``--max-shelves`` of them, each with ``--capacity-bytes // --max-shelves`` bytes; a writer of
one more geometry is refused, naming the first shelf's and its own (docs/operations.md,
"Several block geometries in one store"). To fix the first up front: ``--profile '<json>'`` (the
JSON a writer logs, ``store/profile.py``), or ``--model tiny|tiny_hybrid`` with
``--block-size``, ``--model-name``, ``--model-revision`` and ``--hash-fn`` for kvbridge's own
models. The JSON line's ``pull_address`` and ``capacity_blocks`` are the first shelf's, null
until there is one (the store logs each shelf as it opens). The last line, as it stops, is
``{"stats": <totals>, "shelves": [{"profile", "pull_address", "stats"}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvbridge.connector.index.client import INDEX_SOCKET_TIMEOUT_S
from kvbridge.connector.store import StoreNode, close_store_node, start_store_node
from kvbridge.connector.store.profile import StoreProfile
from kvbridge.kernels.model import ModelConfig

from .cli import CommandParser, announce, wait_for_stop

__all__ = ["DEFAULT_MAX_SHELVES", "main"]

DEFAULT_MAX_SHELVES = 1
"""One geometry with all of ``--capacity-bytes`` unless the operator asks for more shelves:
shelves take fixed equal shares, so a default of several would leave a one-model fleet a
fraction of the memory it gave the store."""


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="kvbridge-store", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address for pulls and writes")
    parser.add_argument("--port", type=int, default=0, help="transport (pull) port; 0: any")
    parser.add_argument("--write-port", type=int, default=0, help="write server port; 0: any")
    parser.add_argument("--capacity-bytes", type=int, required=True,
                        help="host memory for blocks, all shelves together")
    parser.add_argument("--max-shelves", type=int, default=DEFAULT_MAX_SHELVES,
                        help="block geometries kept at most, each in capacity-bytes / "
                        "max-shelves (default 1: one geometry with all of it)")
    parser.add_argument("--index-url", required=True, help="redis://host:port/db")
    parser.add_argument("--engine-id", default="store-0")
    parser.add_argument("--read-guard-s", type=float, default=30.0)
    parser.add_argument("--index-socket-timeout-s", type=float, default=INDEX_SOCKET_TIMEOUT_S,
                        help="a Redis call of the index not answered this long counts as an "
                        "outage (the engines' index_socket_timeout_s)")
    parser.add_argument("--profile", help="fix the block geometry up front: the store profile "
                        "JSON a writer logs ('kvbridge-store --profile ...'); default: the "
                        "first writer's")
    parser.add_argument("--model", choices=("tiny", "tiny_hybrid"), default=None,
                        help="fix the geometry up front to kvbridge's own model's nodes")
    parser.add_argument("--block-size", type=int, default=16, help="with --model")
    parser.add_argument("--model-name", default="kvbridge", help="with --model")
    parser.add_argument("--model-revision", default="", help="with --model")
    parser.add_argument("--hash-fn", default="sha256_cbor", help="with --model")
    args = parser.parse_args(argv)
    if args.profile is not None and args.model is not None:
        parser.error("--profile and --model both fix the geometry: give one")
    if args.max_shelves < 1:
        parser.error(f"--max-shelves must be >= 1, got {args.max_shelves}")
    try:
        profile = None if args.profile is None else StoreProfile.from_json(args.profile)
    except ValueError as exc:
        parser.error(str(exc))
    # Its log (stderr): the geometry it takes and from whom, refused writers.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = None
    if args.model is not None:
        model = ModelConfig.tiny() if args.model == "tiny" else ModelConfig.tiny_hybrid()
    try:  # a setting it cannot serve (an unreachable cluster index among them): one line
        node = _start(args, model, profile)
    except ValueError as exc:
        parser.error(str(exc))
    announce(
        engine_id=node.engine_id,
        incarnation=node.incarnation,
        pull_address=None if node.transport is None else list(node.address),
        store_url=node.store_url,
        capacity_blocks=None if node.cache is None else node.cache.num_store_blocks,
        max_shelves=node.max_shelves,
    )
    try:
        wait_for_stop()
    finally:
        print(json.dumps(_final_stats(node)), flush=True)  # its last line
        close_store_node(node)
    return 0


def _final_stats(node: StoreNode) -> dict[str, Any]:
    """The store's totals and, per shelf in the order they opened, its profile (the JSON
    ``--profile`` takes, as an object), pull address and counters."""
    shelves = [{"profile": json.loads(shelf.profile.to_json()),
                "pull_address": None if shelf.transport is None else list(shelf.address),
                "stats": shelf.stats.snapshot()}
               for shelf in list(node.shelves)]
    return {"stats": node.stats.snapshot(), "shelves": shelves}


def _start(args: argparse.Namespace, model: ModelConfig | None,
           profile: StoreProfile | None) -> StoreNode:
    return start_store_node(
        StoreNode(
            model,
            block_size=args.block_size,
            capacity_bytes=args.capacity_bytes,
            engine_id=args.engine_id,
            model_name=args.model_name,
            model_revision=args.model_revision,
            hash_fn_name=args.hash_fn,
            index_url=args.index_url,
            host=args.host,
            port=args.port,
            write_host=args.host,
            write_port=args.write_port,
            read_guard_s=args.read_guard_s,
            index_socket_timeout_s=args.index_socket_timeout_s,
            profile=profile,
            max_shelves=args.max_shelves,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
