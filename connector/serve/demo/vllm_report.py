"""The report of kvbridge-demo-vllm: per-request figures from vLLM's own metrics, folded
into one flat dict (the JSON line) and a few readable lines.

Every request of the demo is sent alone, so what it added to a server's Prometheus series
(:class:`vllm_pd_client.MetricsDelta`) is that request's: on P, its time to first token (the
prefill); on D, its queue time (from arrival to being scheduled, which for a disaggregated
request is the wait for the KV pull), its prefill time (the first token, computed on the pulled
KV) and its external prefix-cache hits (the tokens the connector loaded); on the reference, its
prefill time, which is what recomputing the prompt costs. "KV moved" is estimated from D's
external hits: whole blocks of the model's geometry (kvbridge pulls whole blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .report import percentile
from .vllm_client import Answer

__all__ = ["BLOCK_SIZE", "KV_CACHE_USAGE", "Turn", "build_report", "print_summary", "request_rows"]

BLOCK_SIZE = 32
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
_PREFILL = "vllm:request_prefill_time_seconds_sum"
_QUEUE = "vllm:request_queue_time_seconds_sum"
_TTFT = "vllm:time_to_first_token_seconds_sum"
_EXTERNAL = "vllm:external_prefix_cache_hits_total"
_LOCAL = "vllm:prefix_cache_hits_total"
_PROMPT = "vllm:prompt_tokens_total"


@dataclass(slots=True)
class Turn:
    """One request of the workload: what the reference said and what P/D said."""

    conversation: int
    turn: int
    stream: bool
    expected: Answer
    ref: dict[str, float]
    got: Answer | None = None
    p: dict[str, float] | None = None
    d: dict[str, float] | None = None
    error: str | None = None


def _q(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def build_report(turns: list[Turn], mismatches: int, checks: dict[str, Any], timings: dict,
                 block_bytes: int) -> dict[str, Any]:
    done = [t for t in turns if t.got is not None and t.p is not None and t.d is not None]
    d_pulled = [t.d.get(_EXTERNAL, 0.0) for t in done]
    blocks = sum(-(-int(n) // BLOCK_SIZE) for n in d_pulled)
    d_prompt = sum(t.d.get(_PROMPT, 0.0) for t in done)

    def series(side: str, key: str) -> list[float]:
        return [getattr(t, side)[key] for t in done if getattr(t, side).get(key) is not None]

    fetch = series("d", _QUEUE)
    recompute = [t.ref.get(_PREFILL, 0.0) for t in done]
    ratios = [f / r for f, r in zip(fetch, recompute, strict=True) if r > 0]
    figures = {
        "ttft_s": [t.p[_TTFT] + t.d[_TTFT] for t in done],
        "p_prefill_s": series("p", _TTFT),
        "d_kv_wait_s": fetch,
        "d_first_token_s": series("d", _PREFILL),
        "d_ttft_s": series("d", _TTFT),
        "reference_ttft_s": [t.ref.get(_TTFT, 0.0) for t in done],
        "client_latency_s": [t.got.latency_s for t in done],
        "client_first_token_s": [t.got.first_token_s for t in done
                                 if t.got.first_token_s is not None],
    }
    report: dict[str, Any] = {
        "requests": len(turns),
        "completed": len(done),
        "errors": sum(t.error is not None for t in turns),
        "mismatches": mismatches,
        "streamed": sum(t.stream for t in turns),
        "prompt_tokens": sum(len(t.expected.prompt_token_ids) for t in turns),
        "output_tokens": sum(len(t.got.token_ids) for t in done),
        **{f"{name}_{q}": v for name, vals in figures.items() for q, v in _q(vals).items()},
        "kv_tokens_pulled": int(sum(d_pulled)),
        "kv_blocks_pulled_est": blocks,
        "kv_bytes_moved_est": blocks * block_bytes,
        "d_prompt_tokens": int(d_prompt),
        "d_local_hit_tokens": int(sum(t.d.get(_LOCAL, 0.0) for t in done)),
        "p_local_hit_tokens": int(sum(t.p.get(_LOCAL, 0.0) for t in done)),
        "pd_pulled_fraction": sum(d_pulled) / d_prompt if d_prompt else None,
        "d_requests_without_pull": sum(n == 0 for n in d_pulled),
        "fetch_vs_recompute_ratio_p50": percentile(ratios, 0.5),
        "fetch_vs_recompute_ratio_total": sum(fetch) / sum(recompute) if sum(recompute) else None,
        "p_kv_cache_usage_after": checks.get("p_kv_cache_usage_after"),
        "failed_loads": checks.get("failed_loads"),
        "expired_leases": checks.get("expired_leases"),
        **timings,
    }
    return report


def _ms(value: Any) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f} ms"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_summary(r: dict[str, Any]) -> None:
    print(f"requests {r['requests']} ({r['streamed']} streamed; completed {r['completed']}, "
          f"errors {r['errors']}), mismatches {r['mismatches']}, prompt tokens "
          f"{r['prompt_tokens']}, output tokens {r['output_tokens']}")
    print(f"start-up: reference {r['reference_start_s']:.0f} s, P+D {r['pd_start_s']:.0f} s; "
          f"reference run {r['reference_run_s']:.1f} s, P/D run {r['pd_run_s']:.1f} s, "
          f"total {r['total_s']:.0f} s")
    for name, what in (("ttft_s", "TTFT (P's + D's)"), ("p_prefill_s", "P prefill"),
                       ("d_kv_wait_s", "D waits for KV"), ("d_first_token_s", "D first token"),
                       ("d_ttft_s", "D TTFT"), ("reference_ttft_s", "reference TTFT"),
                       ("client_latency_s", "client, whole request"),
                       ("client_first_token_s", "client, first streamed token")):
        print(f"  {what:>28}: p50 {_ms(r[name + '_p50'])}, p99 {_ms(r[name + '_p99'])}")
    fraction = r["pd_pulled_fraction"]
    print(f"KV moved: {r['kv_tokens_pulled']} tokens in about {r['kv_blocks_pulled_est']} blocks "
          f"= {r['kv_bytes_moved_est'] / 1e6:.2f} MB (vLLM's external prefix-cache hits on D); "
          f"pulled {'n/a' if fraction is None else f'{fraction:.0%}'} of D's prompt tokens, "
          f"D's own prefix cache {r['d_local_hit_tokens']}, P's {r['p_local_hit_tokens']}; "
          f"requests D did not pull for {r['d_requests_without_pull']}")
    p50, total = r["fetch_vs_recompute_ratio_p50"], r["fetch_vs_recompute_ratio_total"]
    print(f"fetch vs recompute (D's wait for KV / the reference's prefill of the same prompt): "
          f"p50 {_ratio(p50)}, total {_ratio(total)}; P's KV cache in use after the run: "
          f"{r['p_kv_cache_usage_after']}; failed pulls {r['failed_loads']}, leases expired "
          f"{r['expired_leases']}")


def request_rows(turns: list[Turn]) -> list[dict[str, Any]]:
    """One flat row per request (seconds, tokens) for ``requests.jsonl`` in the work directory."""
    rows = []
    for t in turns:
        p, d, got = t.p or {}, t.d or {}, t.got
        rows.append({
            "conversation": t.conversation, "turn": t.turn, "stream": t.stream,
            "prompt_tokens": len(t.expected.prompt_token_ids),
            "equal": got is not None and got.prompt_token_ids == t.expected.prompt_token_ids
            and got.token_ids == t.expected.token_ids,
            "error": t.error,
            "p_prefill_s": p.get(_TTFT), "p_local_hit_tokens": p.get(_LOCAL),
            "d_kv_wait_s": d.get(_QUEUE), "d_first_token_s": d.get(_PREFILL),
            "d_ttft_s": d.get(_TTFT), "d_pulled_tokens": d.get(_EXTERNAL),
            "d_local_hit_tokens": d.get(_LOCAL),
            "reference_prefill_s": t.ref.get(_PREFILL), "reference_ttft_s": t.ref.get(_TTFT),
            "client_latency_s": got.latency_s if got else None,
            "client_first_token_s": got.first_token_s if got else None,
        })
    return rows
