"""The trace replay's input: a Mooncake-format trace parsed, each hash id expanded to a fixed
run of token ids, and the unbounded-cache reference hit count (kvbridge-replay).

Trace format (the Mooncake FAST'25 trace release, kvcache-ai/Mooncake, FAST25-release/traces,
e.g. its ``conversation_trace.jsonl``): one JSON object a line with ``timestamp`` (ms),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token block).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "VOCAB_SIZE",
    "TokenExpander",
    "TraceRequest",
    "oracle_hit_blocks",
    "read_trace",
]

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids block length
VOCAB_SIZE = 32_000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Parse a Mooncake-format trace; raises ValueError naming the bad line."""
    requests: list[TraceRequest] = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = TraceRequest(
                    float(obj["timestamp"]) / 1000.0,
                    int(obj["input_length"]),
                    int(obj["output_length"]),
                    tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a trace record ({exc})") from exc
            if req.input_length < 1 or not req.hash_ids:
                raise ValueError(f"{path}:{line_no}: empty prompt")
            requests.append(req)
    requests.sort(key=lambda r: r.arrival_s)  # stable: file order within one timestamp
    return requests


class TokenExpander:
    """hash id -> ``block_size`` token ids, deterministic (PRNG seeded by the id), memoised."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._id_to_tokens: dict[int, list[int]] = {}

    def num_tokens(self, req: TraceRequest) -> int:
        scaled = math.ceil(req.input_length * self.block_size / TRACE_BLOCK_TOKENS)
        return max(1, min(scaled, len(req.hash_ids) * self.block_size))

    def prompt(self, req: TraceRequest) -> list[int]:
        tokens: list[int] = []
        for hash_id in req.hash_ids:
            run = self._id_to_tokens.get(hash_id)
            if run is None:
                rng = random.Random(hash_id)
                run = [rng.randrange(VOCAB_SIZE) for _ in range(self.block_size)]
                self._id_to_tokens[hash_id] = run
            tokens.extend(run)
        return tokens[: self.num_tokens(req)]


def oracle_hit_blocks(requests: list[TraceRequest], expander: TokenExpander) -> list[int]:
    """Per request: prompt blocks an unbounded cache would serve (leading hash ids seen before,
    capped at ``(num_tokens - 1) // block_size`` as ``get_computed_blocks`` caps a hit)."""
    seen: set[int] = set()
    hits: list[int] = []
    for req in requests:
        k = 0
        while k < len(req.hash_ids) and req.hash_ids[k] in seen:
            k += 1
        hits.append(min(k, (expander.num_tokens(req) - 1) // expander.block_size))
        seen.update(req.hash_ids)
    return hits


class LoadedTrace(NamedTuple):
    """A trace read for a replay: its requests, their token expander, the unbounded cache's
    hit blocks per request (``oracle_hit_blocks``) and all prompt blocks (the ratios' base)."""

    requests: list[TraceRequest]
    expander: TokenExpander
    oracle_hit_blocks: list[int]
    total_blocks: int


def load_trace(path: Path, limit: int | None, block_size: int) -> LoadedTrace:
    """``read_trace`` with everything each replay derives from it at ``block_size``."""
    requests = read_trace(path, limit)
    expander = TokenExpander(block_size)
    total_blocks = sum(math.ceil(expander.num_tokens(r) / block_size) for r in requests)
    return LoadedTrace(requests, expander, oracle_hit_blocks(requests, expander), total_blocks)
