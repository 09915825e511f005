"""``Request``, its status and sampling parameters (vllm/v1/request.py, sampling_params.py).

A request owns its token ids (prompt then outputs), its scheduling progress
(``num_computed_tokens``) and the chained hashes of its full blocks (``block_hashes``), which its
block hasher extends whenever tokens are appended (seed 001, section 1).
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .block_hash import BlockHash

__all__ = ["MultiModalFeature", "Request", "RequestStatus", "SamplingParams"]


class RequestStatus(enum.IntEnum):
    """Lifecycle state; every status after ``PREEMPTED`` is a finished one (vLLM's order)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for every ``FINISHED_*`` status."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """OpenAI-style reason ("stop", "length", "abort", "error") or None if not finished."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(kw_only=True)
class SamplingParams:
    """The sampling options the KV manager and scheduler care about.

    ``skip_reading_prefix_cache=None`` resolves to ``prompt_logprobs is not None``: prompt
    logprobs need logits for every prompt token, so no prefix may be skipped (seed 001,
    section 6; vLLM ``SamplingParams.__post_init__``). Raises ValueError for ``max_tokens < 1``
    or ``prompt_logprobs < 0``.
    """

    max_tokens: int = 16
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None


@dataclass(frozen=True, kw_only=True)
class MultiModalFeature:
    """A multimodal item: content ``identifier`` (its hash) at prompt positions
    ``[offset, offset + length)`` (vLLM's ``MultiModalFeatureSpec`` + ``PlaceholderRange``)."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"bad multimodal range offset={self.offset} length={self.length}")


class Request:
    """One generation request as the scheduler and KV manager see it.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, at least one token.
        sampling_params: defaults to ``SamplingParams()``.
        block_hasher: ``get_request_block_hasher(...)``; without it ``block_hashes`` stays empty
            and the request can never hit the prefix cache.
        lora_name, cache_salt, mm_features, prompt_embeds: inputs that enter the block hashes.
        prompt_embeds: optional tensor ``[num_prompt_tokens, hidden_size]``.
        kv_transfer_params: connector parameters (P/D), untouched here.
    Raises ValueError on an empty prompt or a prompt_embeds row count that differs from the prompt.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if prompt_embeds is not None and prompt_embeds.shape[0] != len(prompt_token_ids):
            raise ValueError(
                f"prompt_embeds has {prompt_embeds.shape[0]} rows for "
                f"{len(prompt_token_ids)} prompt tokens"
            )
        self.request_id = request_id
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())
        self.prompt_embeds = prompt_embeds
        self.kv_transfer_params = kv_transfer_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.eos_token_id = eos_token_id
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Prompt tokens served from a cache (local or external) at first scheduling; -1 = unset.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.max_tokens = self.sampling_params.max_tokens
        self.skip_reading_prefix_cache = bool(self.sampling_params.skip_reading_prefix_cache)
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self._embeds_digests: dict[tuple[int, int], bytes] = {}
        self.update_block_hashes()

    # -- tokens -----------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        """Generated token ids (a live list: do not mutate)."""
        return self._output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self._output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens including unverified draft tokens (never cached)."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash any block they complete (mutates ``block_hashes``)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend ``block_hashes`` with the hashes of newly completed full blocks."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def prompt_embeds_digest(self, start_token_idx: int, end_token_idx: int) -> bytes | None:
        """sha256 of the prompt-embedding rows ``[start, end)`` clipped to the prompt, or None."""
        if self.prompt_embeds is None or start_token_idx >= self.num_prompt_tokens:
            return None
        end = min(end_token_idx, self.num_prompt_tokens)
        key = (start_token_idx, end)
        digest = self._embeds_digests.get(key)
        if digest is None:
            rows = self.prompt_embeds[start_token_idx:end].detach().cpu().contiguous()
            digest = hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).digest()
            self._embeds_digests[key] = digest
        return digest

    # -- status -----------------------------------------------------------------------------
    def is_finished(self) -> bool:
        """True once ``status`` is a ``FINISHED_*`` status."""
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        """The finish reason ("stop", "length", "abort", "error"), or None while unfinished."""
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
