"""The client side of kvbridge-demo-vllm: its text workload, its ``/v1/completions`` calls
and its reading of vLLM's Prometheus ``/metrics``.

- :func:`build_conversations`: multi-turn chats over the standard library's module docstrings
  (``pd_workload.stdlib_paragraphs``, the text ``make demo`` uses), tokenized by the tiny
  model's own BPE tokenizer (``tokenizer.json`` beside the checkpoint). Conversations share two
  long system prompts. A first turn is sent as text (vLLM tokenizes it); every later turn as
  token ids: the previous prompt's ids (as the server returned them) + the answer's ids + the
  new user message, so an answer is appended exactly as generated.
- :func:`complete`: one greedy completion (``temperature`` 0, ``ignore_eos``,
  ``return_token_ids``), streamed or not, against a vLLM server or the proxy in front of P and D.
- :func:`scrape` / :class:`MetricsDelta`: vLLM's Prometheus counters and histogram sums, and
  what one request added to them (requests are sent one at a time, so a delta is that request's).
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .workload import stdlib_paragraphs

__all__ = [
    "Answer",
    "Conversation",
    "MetricsDelta",
    "build_conversations",
    "complete",
    "load_tokenizer",
    "scrape",
]

_SYSTEM = "System: you are a careful assistant who explains the Python standard library. "
_METRIC_LINE = re.compile(r"^(vllm:[a-zA-Z_:]+)(?:\{([^}]*)\})?\s+(\S+)$")
# Labels every vLLM series carries; the rest (e.g. source="external_kv_transfer") name a series.
_COMMON_LABELS = {"engine", "model_name"}


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's ``tokenizers.Tokenizer`` (the one vLLM loads from the same folder)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@dataclass(slots=True)
class Conversation:
    """A chat: turn 0 is text (system prompt + user message), later turns token ids."""

    conversation_id: int
    first_text: str
    user_turns: list[list[int]]  # turns 1..n-1, encoded
    history: list[int] | None = None  # prompt ids + answer ids of the last turn
    next_turn: int = 0

    def next_prompt(self) -> str | list[int] | None:
        if self.next_turn == 0:
            return self.first_text
        if self.next_turn > len(self.user_turns) or self.history is None:
            return None
        return self.history + self.user_turns[self.next_turn - 1]

    def record(self, prompt_token_ids: list[int], answer_token_ids: list[int]) -> None:
        self.history = list(prompt_token_ids) + list(answer_token_ids)
        self.next_turn += 1


def build_conversations(
    tokenizer: Any, num_conversations: int, num_turns: int, *, seed: int = 0
) -> list[Conversation]:
    """``num_conversations`` chats of ``num_turns`` turns; conversation ``i`` uses system prompt
    ``i % 2`` (three docstring paragraphs each); user messages are drawn without replacement
    by a seeded PRNG from the other paragraphs."""
    paragraphs = stdlib_paragraphs()
    systems = [_SYSTEM + " ".join(paragraphs[3 * i:3 * i + 3]) for i in range(2)]
    rest = paragraphs[6:]
    random.Random(seed).shuffle(rest)
    conversations = []
    for c in range(num_conversations):
        texts = [rest[(c * num_turns + t) % len(rest)] for t in range(num_turns)]
        turns = [f"\nUser: {text}\nAssistant:" for text in texts]
        later = [tokenizer.encode(turn).ids for turn in turns[1:]]
        conversations.append(Conversation(c, systems[c % 2] + turns[0], later))
    return conversations


@dataclass(slots=True)
class Answer:
    """One completion as the client saw it (seconds)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    latency_s: float
    first_token_s: float | None  # streamed only: time to the first chunk carrying tokens
    kv_transfer_params: Any = None
    chunks: int = 0


def _body(prompt: str | list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def complete(
    client: httpx.Client, url: str, prompt: str | list[int], max_tokens: int, *, stream: bool
) -> Answer:
    """One completion from ``url`` (a vLLM server or the proxy).

    Raises:
        httpx.HTTPError: transport errors and non-200 answers (``raise_for_status``), or
            RuntimeError for an answer without token ids.
    """
    body = _body(prompt, max_tokens, stream)
    start = time.perf_counter()
    if not stream:
        reply = client.post(f"{url}/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
        data = reply.json()
        choice = data["choices"][0]
        if choice.get("token_ids") is None or choice.get("prompt_token_ids") is None:
            raise RuntimeError(f"answer without token ids: {json.dumps(data)[:300]}")
        return Answer(
            prompt_token_ids=list(choice["prompt_token_ids"]),
            token_ids=list(choice["token_ids"]),
            text=choice.get("text") or "",
            finish_reason=choice.get("finish_reason"),
            latency_s=time.perf_counter() - start,
            first_token_s=None,
            kv_transfer_params=data.get("kv_transfer_params"),
        )
    prompt_ids: list[int] | None = None
    token_ids: list[int] = []
    text: list[str] = []
    finish_reason = None
    first_token_s = None
    chunks = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.read().decode()[:300]}")
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload.strip() == "[DONE]":
                break
            data = json.loads(payload)
            if "error" in data:
                raise RuntimeError(f"stream error: {payload[:300]}")
            for choice in data.get("choices", []):
                chunks += 1
                if choice.get("prompt_token_ids") is not None:
                    prompt_ids = list(choice["prompt_token_ids"])
                new = choice.get("token_ids") or []
                if new and first_token_s is None:
                    first_token_s = time.perf_counter() - start
                token_ids.extend(new)
                text.append(choice.get("text") or "")
                finish_reason = choice.get("finish_reason") or finish_reason
    if prompt_ids is None:
        raise RuntimeError("stream carried no prompt_token_ids")
    return Answer(
        prompt_token_ids=prompt_ids,
        token_ids=token_ids,
        text="".join(text),
        finish_reason=finish_reason,
        latency_s=time.perf_counter() - start,
        first_token_s=first_token_s,
        chunks=chunks,
    )


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """``url``'s ``vllm:*`` series: counters, gauges and histogram ``_sum``/``_count`` (buckets
    left out), summed over engines; a series with other labels is keyed ``name{k=v,...}``."""
    text = client.get(f"{url}/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match is None or match.group(1).endswith(("_bucket", "_created")):
            continue
        name, labels, value = match.groups()
        extra = [
            part for part in (labels or "").split(",")
            if part and part.split("=", 1)[0] not in _COMMON_LABELS
        ]
        key = f"{name}{{{','.join(extra)}}}" if extra else name
        try:
            values[key] = values.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return values


class MetricsDelta:
    """What one request added to a server's metrics.

    ``take()`` waits (up to ``timeout_s``) until ``vllm:request_prefill_time_seconds_count``
    has grown by ``expected`` (vLLM records a request's figures when it finishes, which may be
    a moment after its answer was sent), then returns the differences and moves the baseline.
    """

    _DONE = "vllm:request_prefill_time_seconds_count"

    def __init__(self, client: httpx.Client, url: str, *, timeout_s: float = 3.0) -> None:
        self.client = client
        self.url = url
        self.timeout_s = timeout_s
        self.baseline = scrape(client, url)
        self.first = dict(self.baseline)

    def take(self, expected: int = 1) -> dict[str, float]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            now = scrape(self.client, self.url)
            done = now.get(self._DONE, 0.0) - self.baseline.get(self._DONE, 0.0)
            if done >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        delta = {k: v - self.baseline.get(k, 0.0) for k, v in now.items()}
        self.baseline = now
        return delta

    def since_start(self) -> dict[str, float]:
        """Differences between now and when this watch was made."""
        now = scrape(self.client, self.url)
        return {k: v - self.first.get(k, 0.0) for k, v in now.items()}
