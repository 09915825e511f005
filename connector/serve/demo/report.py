"""Verification and figures for kvbridge-demo.

- :class:`ReferenceRunner`: the single-node run every P/D completion is compared with: the same
  model (same seed or checkpoint) in a local ``Engine`` without a connector and without prefix
  caching, one request at a time; it also times each prompt's prefill (first step), which is
  "the time D would need to prefill it itself".
- :func:`memcpy_gb_per_s`: single-thread memcpy bandwidth measured in the same run, the baseline
  of the decode node's KV transfer bandwidth.
- :func:`percentile`, :func:`build_report`: the report's figures (one flat JSON object), with
  :func:`pulls_by_holder`: per pulling node and holder engine id, the pulls and blocks it took.
- :func:`print_summary`: the report's human-readable lines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kvbridge.kernels.model import ReferenceDecoder
from kvbridge.kvmanager import Engine, EngineConfig, SamplingParams

__all__ = [
    "Completed",
    "ReferenceRunner",
    "build_report",
    "memcpy_gb_per_s",
    "percentile",
    "print_summary",
    "pulls_by_holder",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Completed:
    """One finished P/D request as seen by pd_pair (seconds; None: not measured)."""

    prompt_token_ids: list[int]
    max_tokens: int
    token_ids: list[int]
    ttft_s: float
    prefill_s: float | None
    transfer_s: float | None
    decode_s: float | None


class ReferenceRunner:
    """Greedy generation on one local node: no connector, no prefix caching."""

    def __init__(self, model: ReferenceDecoder, *, block_size: int, max_model_len: int) -> None:
        num_groups = len(set(model.config.layer_types))
        num_blocks = num_groups * -(-max_model_len // block_size) + 2
        self.engine = Engine(
            model,
            EngineConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_model_len,
                enable_prefix_caching=False,
            ),
        )
        self._count = 0

    def run(self, prompt_token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        """``(token ids, prefill seconds)``: the prompt is prefilled in one step (the token budget
        equals max_model_len), and that step is timed."""
        request_id = f"ref-{self._count}"
        self._count += 1
        self.engine.add_request(
            request_id,
            list(prompt_token_ids),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        prefill_s: float | None = None
        while True:
            start = time.perf_counter()
            outputs = self.engine.step()
            if prefill_s is None:
                prefill_s = time.perf_counter() - start
            for output in outputs:
                if output.request_id == request_id and output.finished:
                    return list(output.token_ids), prefill_s


def memcpy_gb_per_s(num_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """Best-of-``repeats`` single-thread copy bandwidth of ``num_bytes`` (GB/s, 1e9 bytes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return num_bytes / best / 1e9


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _rate(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def pulls_by_holder(node_stats: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """``{puller engine id: {holder engine id: {"pulls", "blocks", "index_pulls"}}}`` from the
    nodes' ``/v1/stats`` (``pulls_by_holder``: pulls planned; ``index_pulls`` of them found
    through the block index, the rest P/D handovers). Every node appears, with ``{}`` when it
    pulled nothing; a node without a connector (no ``pulls_by_holder``) is left out."""
    return {
        str(s["engine_id"]): dict(sorted(s["pulls_by_holder"].items()))
        for s in node_stats
        if "pulls_by_holder" in s
    }


def _pulls_from(
    by_puller: dict[str, dict[str, dict[str, int]]], pullers: set[str], holders: set[str]
) -> tuple[int, int]:
    """Pulls and blocks that ``pullers`` took from ``holders``."""
    picked = [c for p, row in by_puller.items() if p in pullers
              for h, c in row.items() if h in holders]
    return sum(c["pulls"] for c in picked), sum(c["blocks"] for c in picked)


def build_report(
    *,
    completed: Sequence[Completed],
    mismatches: int,
    errors: int,
    reference_prefill_s: Sequence[float],
    wall_s: float,
    prefill_stats: Sequence[dict[str, Any]],
    decode_stats: Sequence[dict[str, Any]],
    store_stats: Sequence[dict[str, Any]],
    memcpy_gbps: float,
    index: str,
    block_size: int,
) -> dict[str, Any]:
    """The report's figures as one flat dict (see the README's "What the report says").

    ``reference_prefill_s[i]`` is the single-node prefill time of ``completed[i]``'s prompt.
    Node stats are the nodes' ``/v1/stats`` answers after the run.
    """

    def split(name: str) -> dict[str, float | None]:
        values = [getattr(c, name) for c in completed if getattr(c, name) is not None]
        return {f"{name}_p50": percentile(values, 0.5), f"{name}_p99": percentile(values, 0.99)}

    def total(stats: Sequence[dict[str, Any]], section: str, key: str) -> float:
        return float(sum(s.get(section, {}).get(key) or 0 for s in stats))

    bytes_received = total(decode_stats, "transfer", "bytes_received")
    transfer_s_sum = total(decode_stats, "transfer", "transfer_s_sum")
    receive_gbps = _rate(bytes_received, transfer_s_sum)
    receive_gbps = receive_gbps / 1e9 if receive_gbps is not None else None
    ratios = [
        c.transfer_s / ref_s
        for c, ref_s in zip(completed, reference_prefill_s, strict=True)
        if c.transfer_s is not None and ref_s > 0
    ]
    loaded = [
        (c.transfer_s, ref_s)
        for c, ref_s in zip(completed, reference_prefill_s, strict=True)
        if c.transfer_s is not None
    ]
    # Per token, so that D's local prefix hits (which shrink a pull) do not flatter the ratio:
    # seconds per pulled token (whole blocks) / seconds per prefilled prompt token.
    pulled_tokens = total(decode_stats, "transfer", "num_blocks_received") * block_size
    prefill_s_per_token = _rate(
        sum(reference_prefill_s), sum(len(c.prompt_token_ids) for c in completed)
    )
    fetch_s_per_token = _rate(transfer_s_sum, pulled_tokens)
    nodes = [*prefill_stats, *decode_stats]
    local_hits = total(nodes, "counters", "local_hit_tokens")
    local_queries = total(nodes, "counters", "local_query_tokens")
    all_prompt = total(nodes, "counters", "prompt_tokens")
    remote_tokens = total(nodes, "transfer", "remote_hit_tokens")
    d_prompt = total(decode_stats, "counters", "pd_prompt_tokens")
    d_pulled = total(decode_stats, "counters", "pd_cached_tokens") - total(
        decode_stats, "counters", "local_hit_tokens"
    )
    store_tokens = total(nodes, "transfer", "store_hit_tokens")
    by_puller = pulls_by_holder(nodes)
    decode_ids = {str(s.get("engine_id")) for s in decode_stats}
    prefill_ids = {str(s.get("engine_id")) for s in prefill_stats}
    from_p = _pulls_from(by_puller, decode_ids, prefill_ids)
    from_d = _pulls_from(by_puller, decode_ids, decode_ids)
    report: dict[str, Any] = {
        "requests": len(completed) + errors,
        "completed": len(completed),
        "errors": errors,
        "mismatches": mismatches,
        "prompt_tokens": sum(len(c.prompt_token_ids) for c in completed),
        "output_tokens": sum(len(c.token_ids) for c in completed),
        "wall_s": wall_s,
        "index": index,
        **split("ttft_s"),
        **split("prefill_s"),
        **split("transfer_s"),
        **split("decode_s"),
        "kv_bytes_moved": int(bytes_received),
        "kv_same_host_fraction": _rate(
            total(decode_stats, "transfer", "bytes_received_same_host"), bytes_received
        ),
        "kv_transfer_gb_per_s": receive_gbps,
        "memcpy_gb_per_s": memcpy_gbps,
        "transfer_vs_memcpy_ratio": _rate(receive_gbps or 0.0, memcpy_gbps),
        "fetch_vs_prefill_ratio_p50": percentile(ratios, 0.5),
        "fetch_vs_prefill_ratio_total": _rate(
            sum(t for t, _ in loaded), sum(r for _, r in loaded)
        ),
        "fetch_vs_prefill_ratio_per_token": (
            _rate(fetch_s_per_token, prefill_s_per_token or 0.0)
            if fetch_s_per_token is not None
            else None
        ),
        "hit_rate_local_apc": _rate(local_hits, local_queries),
        "hit_rate_remote_index": _rate(remote_tokens, all_prompt),
        "hit_rate_store": _rate(store_tokens, all_prompt),
        "pd_pulled_fraction": _rate(max(d_pulled, 0.0), d_prompt),
        "failed_loads": int(total(decode_stats, "transfer", "num_failed_loads")),
        "expired_leases": int(total(prefill_stats, "transfer", "num_expired_leases")),
        "preemptions": int(total(nodes, "counters", "num_preemptions")),
        "store_nodes": len(store_stats),
        "decode_nodes": len(decode_stats),
        "pulls_by_holder": by_puller,
        "decode_pulls_from_prefill": from_p[0],
        "decode_blocks_from_prefill": from_p[1],
        "decode_pulls_from_decode": from_d[0],
        "decode_blocks_from_decode": from_d[1],
    }
    return report


def _fmt(value: Any, unit: str = "", scale: float = 1.0) -> str:
    return "n/a" if value is None else f"{value * scale:.3g}{unit}"


def print_summary(r: dict[str, Any]) -> None:
    """The report's figures as a few lines on stdout (the JSON line follows them)."""
    print(
        f"requests {r['requests']} (completed {r['completed']}, errors {r['errors']}), "
        f"mismatches {r['mismatches']}, prompt tokens {r['prompt_tokens']}, "
        f"output tokens {r['output_tokens']}, wall {r['wall_s']:.1f} s"
    )
    for name in ("ttft_s", "prefill_s", "transfer_s", "decode_s"):
        print(
            f"  {name[:-2]:>8}: p50 {_fmt(r[name + '_p50'], ' ms', 1e3)}, "
            f"p99 {_fmt(r[name + '_p99'], ' ms', 1e3)}"
        )
    print(
        f"KV moved {r['kv_bytes_moved'] / 1e6:.2f} MB ({_fmt(r['kv_same_host_fraction'], '%', 100)}"
        f" of it by same-host copy) at {_fmt(r['kv_transfer_gb_per_s'], ' GB/s')}"
        f" = {_fmt(r['transfer_vs_memcpy_ratio'])} x memcpy ({_fmt(r['memcpy_gb_per_s'])} GB/s); "
        f"fetch / prefill time p50 {_fmt(r['fetch_vs_prefill_ratio_p50'])}, "
        f"total {_fmt(r['fetch_vs_prefill_ratio_total'])}, per token "
        f"{_fmt(r['fetch_vs_prefill_ratio_per_token'])}"
    )
    print(
        f"prefix hits: local APC {_fmt(r['hit_rate_local_apc'])}, remote via index "
        f"{_fmt(r['hit_rate_remote_index'])}, store {_fmt(r['hit_rate_store'])}; "
        f"pulled from P {_fmt(r['pd_pulled_fraction'])} of D's prompt tokens; failed loads "
        f"{r['failed_loads']}, expired leases {r['expired_leases']}"
    )
    print(
        f"pulls by {r['decode_nodes']} decode node(s): from P {r['decode_pulls_from_prefill']} "
        f"({r['decode_blocks_from_prefill']} blocks), from decode nodes "
        f"{r['decode_pulls_from_decode']} ({r['decode_blocks_from_decode']} blocks)"
    )
    for puller, row in r["pulls_by_holder"].items():
        cells = ", ".join(
            f"{holder} {c['pulls']} pulls / {c['blocks']} blocks ({c['index_pulls']} via index)"
            for holder, c in row.items()
        )
        print(f"  {puller} pulled from: {cells or 'nothing'}")
