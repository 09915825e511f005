"""Builders for engine tests: seeded tiny models (built once per process), engines whose keyword
arguments name the scenario, real text prompts of chosen token lengths, and the no-cache
reference generation every engine result is compared with."""

from __future__ import annotations

import functools

import torch
from kvbridge.kernels.model import ByteTokenizer, ModelConfig, ReferenceDecoder
from kvbridge.kvmanager import Engine, EngineConfig
from kvbridge.kvmanager.engine import ConnectorFactory

BLOCK_SIZE = 8
SLIDING_WINDOW = 16  # two blocks: long prompts leave null blocks in the sliding group
TOKENIZER = ByteTokenizer()

_TEXT = (
    "The quick brown fox jumps over the lazy dog while the scheduler hands out blocks, "
    "and every block that was hashed may be found again by a later request with the same "
    "prefix. Paged attention reads the keys through the block table."
)


@functools.cache
def tiny_model(*, hybrid: bool) -> ReferenceDecoder:
    """Seeded tiny decoder: full attention only, or alternating full / sliding-window layers."""
    if hybrid:
        return ReferenceDecoder(ModelConfig.tiny_hybrid(sliding_window=SLIDING_WINDOW))
    return ReferenceDecoder(ModelConfig.tiny())


def text_prompt(num_tokens: int, *, offset: int = 0) -> list[int]:
    """Real text cut to exactly ``num_tokens`` tokens: BOS then UTF-8 bytes of ``_TEXT`` from
    ``offset`` (num_tokens == 1 is the BOS alone)."""
    text = _TEXT[offset : offset + num_tokens - 1]
    ids = TOKENIZER.encode(text)
    assert len(ids) == num_tokens, (len(ids), num_tokens)
    return ids


def varied_prompts() -> list[list[int]]:
    """1 token; block size - 1, block size, block size + 1; many blocks; two prompts sharing a
    40-token prefix (five full blocks) with different tails."""
    shared = text_prompt(41)
    return [
        text_prompt(1),
        text_prompt(BLOCK_SIZE - 1, offset=50),
        text_prompt(BLOCK_SIZE, offset=60),
        text_prompt(BLOCK_SIZE + 1, offset=70),
        text_prompt(6 * BLOCK_SIZE + 3, offset=90),
        [*shared, *TOKENIZER.encode(" and the cat", add_bos=False)],
        [*shared, *TOKENIZER.encode(" so quickly?", add_bos=False)],
    ]


@functools.cache
def _reference_cached(hybrid: bool, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    model = tiny_model(hybrid=hybrid)
    token_ids = list(prompt)
    for _ in range(max_tokens):
        logits = model.forward_full(torch.tensor(token_ids))
        token_ids.append(int(torch.argmax(logits[-1])))
    return tuple(token_ids[len(prompt) :])


def reference_greedy(prompt: list[int], max_tokens: int, *, hybrid: bool) -> list[int]:
    """Greedy tokens of a plain full-recompute forward (no KV cache), one token at a time."""
    return list(_reference_cached(hybrid, tuple(prompt), max_tokens))


def make_engine(
    *,
    hybrid: bool = False,
    num_blocks: int = 256,
    max_model_len: int = 96,
    chunk_size: int = 256,
    prefix_caching: bool = True,
    max_num_seqs: int = 8,
    kv_load_failure_policy: str = "recompute",
    connector_factory: ConnectorFactory | None = None,
) -> Engine:
    """An engine on the shared tiny model; ``chunk_size`` is the per-step token budget (a
    prompt longer than it is prefilled in chunks)."""
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=chunk_size,
        enable_prefix_caching=prefix_caching,
        kv_load_failure_policy=kv_load_failure_policy,
    )
    return Engine(tiny_model(hybrid=hybrid), config, connector_factory=connector_factory)


def min_blocks_for(max_model_len: int, *, hybrid: bool) -> int:
    """Smallest pool the engine accepts: one max_model_len request in every group + null."""
    num_groups = 2 if hybrid else 1
    return num_groups * -(-max_model_len // BLOCK_SIZE) + 1
