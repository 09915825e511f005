"""A vLLM ``Request`` as kvbridge's scheduler half reads it (``RequestView``).

vLLM's request is read by attribute (this module imports nothing of vLLM), so the view and its
users are tested without a vLLM install (docs/architecture.md, "Inside vLLM").

Owner: the scheduler half's thread (vLLM's engine core), the only caller of ``RequestView.of``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvbridge.kvmanager.request import RequestStatus

__all__ = ["RequestView"]


_STATUS_BY_NAME = {status.name: status for status in RequestStatus}
_UNKNOWN_STATUS = RequestStatus.FINISHED_ERROR


class RequestView(NamedTuple):
    """What kvbridge's scheduler half reads of a vLLM ``Request`` (vllm/v1/request.py).

    ``kv_transfer_params`` is vLLM's dict itself (the half marks a used ticket in it, as vLLM's
    NIXL connector does); ``status`` maps vLLM's status by name (an unknown one counts as an
    error: nothing is handed over for it). ``prompt_token_ids``, ``lora_name`` and
    ``cache_salt`` feed a ticket's ``prompt_digest``; ``prompt_token_ids`` is
    None for a prompt whose inputs are not all token ids (prompt embeddings, multimodal
    features), which then gets no digest. Immutable; built once per call of the adapter's
    scheduler methods, so its construction is kept to one tuple (vLLM asks for every waiting
    request each step).
    """

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int
    num_tokens: int
    block_hashes: Sequence[bytes]
    skip_reading_prefix_cache: bool
    status: RequestStatus
    prompt_token_ids: Sequence[int] | None = None
    lora_name: str | None = None
    cache_salt: str | None = None

    @classmethod
    def of(cls, request: Any) -> RequestView:
        status = request.status
        name = getattr(status, "name", None)
        return cls(
            request.request_id,
            request.kv_transfer_params,
            request.num_prompt_tokens,
            request.num_tokens,
            request.block_hashes,
            bool(getattr(request, "skip_reading_prefix_cache", False)),
            _STATUS_BY_NAME.get(str(status) if name is None else name, _UNKNOWN_STATUS),
            _plain_prompt_token_ids(request),
            getattr(getattr(request, "lora_request", None), "lora_name", None),
            getattr(request, "cache_salt", None),
        )


def _plain_prompt_token_ids(request: Any) -> Sequence[int] | None:
    """A vLLM request's prompt token ids when they are its whole input, else None."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None):
        return None
    return getattr(request, "prompt_token_ids", None)
