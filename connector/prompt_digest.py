"""The digest a handoff ticket carries of the prompt it covers (``remote_prompt_digest``).

A ticket names P's blocks, not the prompt they hold. P's hash check refuses a full block of
another prompt, but a partial last block has no hash; D compares this digest of its own request
with the ticket's before reading anything (``handoff.ticket_refusal``). P and D compute it alike
from the same inputs (vLLM's own block hashes), so it differs only for another prompt.

Owner: any thread (a pure function).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

__all__ = ["prompt_digest"]

_DIGEST_DOMAIN = b"kvbridge.prompt_digest.v1"


def prompt_digest(request: Any, num_tokens: int, block_size: int) -> str:
    """What a ticket for ``request``'s first ``num_tokens`` prompt tokens must carry
    (``remote_prompt_digest``): 64 hex digits of SHA-256 over the hash of the last full block
    among them (``request.block_hashes``: it chains every full block's tokens and extra keys),
    the token ids after it (the partial last block, which has no hash), the LoRA name and the
    cache salt (a prompt shorter than a block has no block hash to carry them).

    Args:
        request: kvbridge's ``Request`` or the vLLM adapter's ``RequestView``: reads
            ``block_hashes``, ``prompt_token_ids``, ``lora_name``, ``cache_salt`` and, when
            present, ``mm_features`` and ``prompt_embeds``.
        num_tokens: the prompt tokens covered, ``1 <= num_tokens <= num_prompt_tokens``.
        block_size: tokens per block of ``request.block_hashes``.

    Returns:
        The digest, or ``""`` when it would not cover the request's inputs (multimodal inputs
        or prompt embeddings: their bytes are not in the token ids; no token ids; fewer block
        hashes than full blocks, e.g. a request without a block hasher). P and D compute it
        alike from the same inputs, so a digest differs only for another prompt.

    Raises:
        ValueError: ``num_tokens`` outside ``[1, num_prompt_tokens]`` (a caller mistake).
    """
    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is None or getattr(request, "mm_features", None):
        return ""
    if getattr(request, "prompt_embeds", None) is not None:
        return ""
    if not 1 <= num_tokens <= len(token_ids):
        raise ValueError(f"num_tokens {num_tokens} outside [1, {len(token_ids)}]")
    num_full = num_tokens // block_size
    block_hashes = request.block_hashes
    if len(block_hashes) < num_full:
        return ""
    digest = hashlib.sha256(_DIGEST_DOMAIN)
    last = bytes(block_hashes[num_full - 1]) if num_full else b""
    tail = token_ids[num_full * block_size : num_tokens]
    for part in (
        last,
        struct.pack(f"<{len(tail)}q", *tail),
        (getattr(request, "lora_name", None) or "").encode(),
        (getattr(request, "cache_salt", None) or "").encode(),
    ):
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.hexdigest()
