"""Workloads for kvbridge-demo: real text, or a replayed Mooncake trace.

Default: multi-turn conversations built from text every Python installation carries (the module
docstrings of the standard library, read from ``sysconfig.get_paths()["stdlib"]`` in sorted
order, so the same Python gives the same text). Conversations share a few system prompts, and
each turn's prompt is the previous prompt + the model's answer + a new user message, so prefixes
repeat across requests as they do in production chat traffic.

``--trace PATH``: a Mooncake-format JSONL trace (e.g. ``conversation_trace.jsonl`` of the
Mooncake FAST'25 trace release, kvcache-ai/Mooncake, FAST25-release/traces): each hash id
becomes a deterministic run of ``block_size`` byte tokens (a PRNG seeded by the id), the prompt is
cut to ``input_length`` scaled by ``block_size / 512``, so the prefix-sharing structure of the
trace is kept exactly at the node's block size.

Prompts are token id lists (the byte tokenizer's ids) so that a previous answer is appended
exactly as generated.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.kernels.model import ByteTokenizer

__all__ = [
    "Conversation",
    "TraceRequest",
    "stdlib_conversations",
    "stdlib_paragraphs",
    "trace_requests",
]

_TOKENIZER = ByteTokenizer()
_MOONCAKE_BLOCK_TOKENS = 512


def stdlib_paragraphs(min_chars: int = 100, max_chars: int = 260) -> list[str]:
    """Paragraphs of the standard library's module docstrings, in a fixed order.

    Reads the top-level ``*.py`` files of the stdlib directory sorted by name; splits each module
    docstring on blank lines; keeps ASCII paragraphs of ``[min_chars, max_chars]`` characters with
    whitespace collapsed.

    Raises:
        RuntimeError: when fewer than 16 paragraphs are found (a stripped Python install).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paragraphs: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for block in (doc or "").split("\n\n"):
            text = " ".join(block.split())
            if min_chars <= len(text) <= max_chars and text.isascii():
                paragraphs.append(text)
    if len(paragraphs) < 16:
        raise RuntimeError(f"only {len(paragraphs)} docstring paragraphs found under {stdlib}")
    return paragraphs


@dataclass(slots=True)
class Conversation:
    """A chat: a shared system prompt, then user turns; ``history`` grows with each answer."""

    conversation_id: int
    user_turns: list[list[int]]
    history: list[int] = field(default_factory=list)
    next_turn: int = 0

    def next_prompt(self) -> list[int] | None:
        """The next turn's prompt (history + the user message), or None when done."""
        if self.next_turn >= len(self.user_turns):
            return None
        return self.history + self.user_turns[self.next_turn]

    def record_answer(self, prompt: list[int], answer_token_ids: list[int]) -> None:
        self.history = prompt + list(answer_token_ids)
        self.next_turn += 1


def stdlib_conversations(
    num_conversations: int, num_turns: int, *, num_system_prompts: int = 2, seed: int = 0
) -> list[Conversation]:
    """``num_conversations`` chats of ``num_turns`` turns over stdlib docstrings.

    The system prompts are the first paragraphs (conversation ``i`` uses system prompt
    ``i % num_system_prompts``); user messages are drawn without replacement from the rest by a
    seeded PRNG.
    """
    paragraphs = stdlib_paragraphs()
    systems = [
        "System: you are a careful assistant who explains the Python standard library. "
        + paragraphs[i]
        for i in range(num_system_prompts)
    ]
    rest = paragraphs[num_system_prompts:]
    rng = random.Random(seed)
    rng.shuffle(rest)
    conversations = []
    for c in range(num_conversations):
        turns = []
        for t in range(num_turns):
            text = rest[(c * num_turns + t) % len(rest)]
            turns.append(_TOKENIZER.encode(f"\nUser: {text}\nAssistant:", add_bos=False))
        history = _TOKENIZER.encode(systems[c % num_system_prompts])  # BOS + system prompt
        conversations.append(Conversation(c, turns, history=history))
    return conversations


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line expanded to tokens (``output_tokens`` capped by the caller's limit)."""

    index: int
    prompt_token_ids: list[int]
    output_tokens: int


def _hash_id_tokens(hash_id: int, block_size: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(256) for _ in range(block_size)]


def trace_requests(
    path: str | Path, *, block_size: int, limit: int, max_output_tokens: int, max_prompt_tokens: int
) -> Iterator[TraceRequest]:
    """The first ``limit`` requests of a Mooncake trace, expanded for ``block_size``.

    Raises:
        ValueError: a line without ``input_length`` / ``output_length`` / ``hash_ids``.
    """
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            if index >= limit:
                return
            record = json.loads(line)
            try:
                hash_ids = [int(h) for h in record["hash_ids"]]
                input_length = int(record["input_length"])
                output_length = int(record["output_length"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{index + 1}: not a Mooncake trace line: {exc}") from exc
            num_tokens = max(1, -(-input_length * block_size // _MOONCAKE_BLOCK_TOKENS))
            tokens: list[int] = []
            for hash_id in hash_ids:
                tokens.extend(_hash_id_tokens(hash_id, block_size))
            tokens = tokens[: min(num_tokens, max_prompt_tokens)]
            if not tokens:
                continue
            yield TraceRequest(index, tokens, max(1, min(output_length, max_output_tokens)))
