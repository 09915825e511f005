"""Greedy sampling and log-probabilities from logits."""

from __future__ import annotations

from typing import NamedTuple

import torch


class PromptLogprobs(NamedTuple):
    """Log-probabilities of a prompt's tokens under the model.

    ``token_logprobs[t]`` is ``log p(prompt[t + 1] | prompt[: t + 1])``, float32 ``[T - 1]`` (the
    first prompt token has none, as in vLLM's ``prompt_logprobs``). ``top_ids`` /
    ``top_logprobs``: int64 / float32 ``[T - 1, num_top]``, the ``num_top`` most likely tokens at
    each position, most likely first.
    """

    token_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Argmax token of each row of ``logits`` ``[n, vocab]``: int64 ``[n]`` (lowest id on ties)."""
    return torch.argmax(logits, dim=-1)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the vocabulary in float32: ``[n, vocab]``."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
    """``log p(next_token_ids[i])`` under row ``i`` of ``logits`` ``[n, vocab]``: float32 ``[n]``.

    Useful for chunked prefill: row ``i`` is the logits at one prompt position and
    ``next_token_ids[i]`` the prompt token that follows it.

    Raises:
        ValueError: if the row counts differ.
    """
    if next_token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"next_token_ids {tuple(next_token_ids.shape)} must be [n] for logits "
            f"{tuple(logits.shape)}"
        )
    logprobs = compute_logprobs(logits)
    return logprobs.gather(1, next_token_ids.to(torch.int64)[:, None]).squeeze(1)


def prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor, num_top: int = 0
) -> PromptLogprobs:
    """Prompt log-probabilities from the logits of every prompt position.

    Args:
        logits: ``[T, vocab]``, row ``t`` computed at prompt position ``t``.
        prompt_token_ids: int ``[T]``.
        num_top: how many most likely alternatives to return per position (0: none).

    Raises:
        ValueError: on mismatched lengths or ``num_top`` outside ``[0, vocab]``.
    """
    if prompt_token_ids.dim() != 1 or prompt_token_ids.shape[0] != logits.shape[0]:
        raise ValueError(
            f"prompt_token_ids {tuple(prompt_token_ids.shape)} must be [T] for logits "
            f"{tuple(logits.shape)}"
        )
    if not 0 <= num_top <= logits.shape[-1]:
        raise ValueError(f"num_top must lie in [0, {logits.shape[-1]}], got {num_top}")
    logprobs = compute_logprobs(logits[:-1])
    chosen = logprobs.gather(1, prompt_token_ids[1:].to(torch.int64)[:, None]).squeeze(1)
    top_logprobs, top_ids = torch.topk(logprobs, num_top, dim=-1)
    return PromptLogprobs(chosen, top_ids, top_logprobs)
