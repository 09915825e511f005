"""bench_vllm_prefix's prompts, its tally of first tokens, and the steps every row repeats:
start engines, let one serve prompts, empty the block index between rows."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from _prefix_engines import Node

VLLM_BUSY_LOOP_S = 1.0  # vLLM 0.32's MessageQueue default

__all__ = ["Prompts", "Tally", "flush_index", "request", "serve", "start_all", "tokens"]


def tokens(seed: str, n: int) -> list[int]:
    """``n`` token ids in [1, 512) drawn from ``seed`` (the same on every run)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def request(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A ``Node.generate`` request without ``kv_transfer_params`` (index hits need none)."""
    return {"prompt_token_ids": prompt, "max_tokens": max_tokens, "kv_transfer_params": None}


class Prompts:
    """``num + 1`` prefixes of ``length`` tokens and two distinct suffixes of ``suffix`` tokens
    each (``first``, ``second``: whole prompts); index 0 warms up."""

    def __init__(self, tag: str, num: int, length: int, suffix: int) -> None:
        self.prefixes = [tokens(f"{tag}-p{i}", length) for i in range(num + 1)]
        self.first = [p + tokens(f"{tag}-s{i}", suffix) for i, p in enumerate(self.prefixes)]
        self.second = [p + tokens(f"{tag}-t{i}", suffix) for i, p in enumerate(self.prefixes)]


class Tally:
    """TTFTs by case (warm-up prompts left out) and token mismatches, said loudly."""

    def __init__(self) -> None:
        self.ttft: dict[str, list[float]] = {}
        self.cached: dict[str, list[int]] = {}
        self.mismatches: list[str] = []

    def add(self, case: str, i: int, out: dict[str, Any], reference: list[int] | None) -> None:
        if reference is not None and out["token_ids"] != reference:
            self.mismatches.append(f"{case} prompt {i}")
            print(f"!!! TOKEN MISMATCH: {case}, prompt {i}: {out['token_ids']} != plain vLLM's "
                  f"{reference}", flush=True)
        print(f"  {case:18s} prompt {i}: first token {out['first_token_latency'] * 1e3:7.1f} ms, "
              f"{out['num_cached_tokens']} tokens cached", flush=True)
        if i > 0:
            self.ttft.setdefault(case, []).append(out["first_token_latency"])
            self.cached.setdefault(case, []).append(out["num_cached_tokens"])

    def median(self, case: str) -> float | None:
        values = self.ttft.get(case)
        return statistics.median(values) if values else None


def start_all(*nodes: Node) -> None:
    """Wait until every started node is ready; on any failure kill them all and re-raise."""
    try:
        for node in nodes:
            node.wait_ready()
    except BaseException:
        for node in nodes:
            node.kill()
        raise


def serve(node: Node, prompts: list[list[int]]) -> None:
    """``node`` computes ``prompts`` (one token each), then its blocks reach the index and
    its processes go idle: a vLLM worker spins on its step queue for ``VLLM_BUSY_LOOP_S``
    after its last step (``shm_broadcast.MessageQueue.busy_loop_s``), and on this host of two
    cores that spin would take a core from the engine measured next, whatever its
    connector."""
    node.generate([request(p, 1) for p in prompts])
    time.sleep(VLLM_BUSY_LOOP_S + 0.5)


def flush_index(redis_url: str) -> None:
    """Drop every entry and registration the rows before left in the index (their engines
    are stopped)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        client.flushall()
    finally:
        client.close()
