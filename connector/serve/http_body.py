"""The ``/v1/completions`` request body, validated once for the node server and the proxy.

The proxy checks a client's body with the same parser the decode node uses before it sends
anything to a prefill node, so a body the decode node would refuse never costs a prefill or a
lease on P (kvbridge-proxy). The node server refuses a malformed body with 400 and, when the
body carries a pull ticket (``do_remote_prefill``), has the prefill node told to release the
blocks it holds for it (kvbridge-node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_TOKENS_LIMIT", "BadRequest", "CompletionBody", "remote_prefill_ticket"]

MAX_TOKENS_LIMIT = 1 << 16


class BadRequest(ValueError):
    """A malformed request body (answered 400)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionBody:
    """A validated ``/v1/completions`` body."""

    prompt: str | list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    kv_transfer_params: dict[str, Any] | None

    @classmethod
    def parse(cls, body: Any) -> CompletionBody:
        """Validate a decoded JSON body (not mutated).

        Raises:
            BadRequest: naming the bad field. Only greedy sampling exists: a ``temperature``
                other than 0 is refused rather than ignored; ``max_tokens`` must be an int in
                ``[1, MAX_TOKENS_LIMIT]`` (default 16, OpenAI's).
        """
        if not isinstance(body, dict):
            raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # OpenAI allows a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("prompt: must be non-empty")
        elif isinstance(prompt, list):
            if not prompt or not all(type(t) is int for t in prompt):
                raise BadRequest("prompt: a token list must be a non-empty list of ints")
        else:
            raise BadRequest("prompt: required, a string or a list of token ids")
        max_tokens = body.get("max_tokens", 16)
        if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"max_tokens: must be an int in [1, {MAX_TOKENS_LIMIT}]")
        temperature = body.get("temperature", 0)
        if temperature not in (0, 0.0, None):
            raise BadRequest("temperature: this node samples greedily; use 0")
        stream = body.get("stream", False)
        ignore_eos = body.get("ignore_eos", False)
        for name, value in (("stream", stream), ("ignore_eos", ignore_eos)):
            if not isinstance(value, bool):
                raise BadRequest(f"{name}: must be a boolean")
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise BadRequest("kv_transfer_params: must be an object or null")
        return cls(
            prompt=prompt,
            max_tokens=max_tokens,
            stream=stream,
            ignore_eos=ignore_eos,
            kv_transfer_params=params,
        )


def remote_prefill_ticket(body: Any) -> dict[str, Any] | None:
    """The body's ``kv_transfer_params`` when they name a remote prefill
    (``"do_remote_prefill": true``, a prefill node's pull ticket), else None. Works on any
    decoded JSON, valid or not: a refused body's ticket still pins blocks on its prefill node."""
    if not isinstance(body, dict):
        return None
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_prefill") is True:
        return params
    return None
