"""Block-index publish benchmark: what one engine step's publish costs the index thread and the
Redis server, every figure measured in this one run.

A step of an engine in chunked prefill caches ``--requests`` chunks of ``--blocks-per-request``
blocks each (the scheduler row of ``bench_vllm_prefix.py``: 8 requests of 16 blocks, 128
blocks), each chunk a ``BlockStored`` whose parent is the request's chunk of the step before;
after ``--steps-per-prompt`` steps the requests are new prompts. Each step is one
``RedisBlockIndex.publish`` (the index worker's call, ``connector/index/worker.py``), measured as

- ``publish_cpu_us``: the calling thread's CPU time per publish (``time.thread_time``: packing,
  the send, reading the reply), the time it holds the interpreter an engine shares with it;
- ``publish_server_us``: the server's CPU per publish (``INFO cpu``, user + system, over all
  publishes: the ``PUBLISH`` script's runs, holes and key sets included);

- ``follow_cpu_us``: what the index thread spends, beside each publish, following the step's
  events in the node's ``ListedSet`` (``connector/index/listed.py``: the set an idle engine's
  resync is built from), against the publish itself: ``follow_cpu_over_publish``;

against two baselines measured in the same run, each the same way:

- a PING (``redis-py``'s ``ping``): ``publish_cpu_over_ping``, ``publish_server_over_ping``;
- the same blocks written as plain ``HSET`` entries in one redis-py pipeline (one command per
  block, no runs, parents or key sets: the least a publish could send):
  ``publish_cpu_over_pipeline``, ``publish_server_over_pipeline``.

Each figure is the median over ``--repeats`` rounds of ``--steps`` calls (server CPU: the
round's total over its calls). Starts its own ``redis-server`` (``_cluster.start_server``).
Usage: ``python benchmarks/bench_publish.py``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from _cluster import start_server
from _report import add_markdown_option, finish
from kvbridge.connector.index import IndexNamespace, ListedSet, RedisBlockIndex
from kvbridge.kvmanager import BlockStored
from kvbridge.transport import BlockIdentity

_IDENTITY = BlockIdentity(model_name="bench-publish", kv_cache_dtype="bfloat16", block_size=16,
                          hash_fn_name="sha256")


def _steps(args: argparse.Namespace) -> Iterator[list[BlockStored]]:
    """Endless steps of ``args.requests`` chained chunks (fresh prompts every
    ``args.steps_per_prompt`` steps; every hash new)."""
    prompt = 0
    while True:
        parents: list[bytes | None] = [None] * args.requests
        for _ in range(args.steps_per_prompt):
            step = []
            for r in range(args.requests):
                hashes = [hashlib.sha256(f"{prompt}/{r}/{i}/{parents[r]!r}".encode()).digest()
                          for i in range(args.blocks_per_request)]
                step.append(BlockStored(
                    block_hashes=hashes, parent_block_hash=parents[r], token_ids=[],
                    block_size=16, lora_name=None, medium=None, group_id=0,
                    block_ids=list(range(r * 1000, r * 1000 + len(hashes)))))
                parents[r] = hashes[-1]
            yield step
        prompt += 1


def _server_cpu_s(admin: redis.Redis) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _round(call: Callable[[Any], object], inputs: list[Any],
           admin: redis.Redis) -> tuple[float, float]:
    """``call`` on each input: (median caller CPU, mean server CPU), microseconds per call."""
    cpu_us = []
    server_before = _server_cpu_s(admin)
    for item in inputs:
        started = time.thread_time()
        call(item)
        cpu_us.append(1e6 * (time.thread_time() - started))
    return statistics.median(cpu_us), 1e6 * (_server_cpu_s(admin) - server_before) / len(inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--blocks-per-request", type=int, default=16)
    parser.add_argument("--steps-per-prompt", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200, help="publishes per round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds")
    add_markdown_option(parser)
    args = parser.parse_args()
    steps = _steps(args)
    rounds: list[dict[str, tuple[float, float]]] = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-publish-") as workdir:
        proc, port = start_server(workdir)
        try:
            admin = redis.Redis(port=port)
            index = RedisBlockIndex(IndexNamespace(identity=_IDENTITY),
                                    f"redis://127.0.0.1:{port}/0")
            index.register_node("bench", 1, ttl_s=3600)
            client = redis.Redis(port=port)
            index.publish("bench", 1, next(steps))  # warm-up: connection, script cache
            listed = ListedSet("device", 16)  # (it grows as the index does: no evictions)

            def pipeline(step: list[BlockStored]) -> None:
                pipe = client.pipeline(transaction=False)
                for event in step:
                    for block_hash, block_id in zip(event.block_hashes, event.block_ids,
                                                    strict=True):
                        pipe.hset(b"plain:" + block_hash[:8], "bench", block_id)
                pipe.execute()

            for _ in range(args.repeats):
                inputs = [next(steps) for _ in range(args.steps)]
                rounds.append({
                    "ping": _round(lambda _: client.ping(), inputs, admin),
                    "publish": _round(lambda step: index.publish("bench", 1, step), inputs,
                                      admin),
                    "pipeline": _round(pipeline, inputs, admin),
                    "follow": _round(listed.follow, inputs, admin),
                })
            if index.stats.publishes != 1 + args.repeats * args.steps:
                raise SystemExit(f"only {index.stats.publishes} publishes were applied")
            index.close()
        finally:
            proc.kill()
            proc.wait()

    def median(name: str, part: int) -> float:
        return statistics.median(r[name][part] for r in rounds)

    def over(name: str, base: str, part: int) -> float:
        return round(statistics.median(r[name][part] / r[base][part] for r in rounds), 3)

    num_blocks = args.requests * args.blocks_per_request
    result = {
        "benchmark": "index_publish",
        "blocks_per_publish": num_blocks,
        "publish_cpu_us": round(median("publish", 0), 1),
        "publish_server_us": round(median("publish", 1), 1),
        "ping_cpu_us": round(median("ping", 0), 1),
        "ping_server_us": round(median("ping", 1), 1),
        "pipeline_cpu_us": round(median("pipeline", 0), 1),
        "pipeline_server_us": round(median("pipeline", 1), 1),
        "publish_cpu_over_ping": over("publish", "ping", 0),
        "publish_server_over_ping": over("publish", "ping", 1),
        "publish_cpu_over_pipeline": over("publish", "pipeline", 0),
        "publish_server_over_pipeline": over("publish", "pipeline", 1),
        "follow_cpu_us": round(median("follow", 0), 1),
        "follow_cpu_over_publish": over("follow", "publish", 0),
    }
    print(f"per call, {num_blocks} blocks a publish (medians of {args.repeats} rounds)")
    print(f"{'call':<34}{'caller CPU us':>15}{'server CPU us':>15}")
    for label, name in (("PING", "ping"), ("publish (PUBLISH script)", "publish"),
                        (f"{num_blocks} HSETs, one pipeline", "pipeline"),
                        ("follow in the listed set", "follow")):
        print(f"{label:<34}{median(name, 0):>15.1f}{median(name, 1):>15.1f}")
    print(f"publish / pipeline: caller {result['publish_cpu_over_pipeline']}, server "
          f"{result['publish_server_over_pipeline']}; follow / publish: caller "
          f"{result['follow_cpu_over_publish']}")
    finish(result, name="publish", title="Block-index publish of one step / PING and a plain "
           "pipeline", markdown=args.markdown)


if __name__ == "__main__":
    main()
