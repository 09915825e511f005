"""``kv_transfer_params``: what a proxy carries from the prefill node P to the decode node D.

The shapes follow vLLM's NIXL connector (vllm/distributed/kv_transfer/kv_connector/v1/
nixl_connector.py). A request for P carries ``{"do_remote_decode": true}``; P's
``request_finished`` answers with ``RemotePrefillParams.to_dict()``, which the proxy forwards to
D unchanged. Everything here came over the network, so ``RemotePrefillParams.parse`` checks every
field's type and range and raises ``KVTransferParamsError`` naming the field.

A ticket names P's blocks, not the prompt they hold, and a proxy can pair it with another
request. P's hash check refuses a full block of another prompt (``holder``), but a partial last
block has no hash: only the lease guards it, and a prompt that shares every full block with the
ticket's would load the other prompt's tail. So the ticket also carries ``prompt_digest`` of the
tokens it covers (``remote_prompt_digest``), and D compares it with its own request's before
pulling anything (``scheduler_half``).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.transport.limits import MAX_STR_LEN, clip_text

from .errors import KVTransferParamsError
from .metadata import ReleaseNotice, Ticket

__all__ = [
    "RemotePrefillParams",
    "prompt_digest",
    "release_notice_for_rejected",
    "ticket_of",
    "wants_remote_decode",
    "wants_remote_prefill",
]

_MAX_BLOCK_ID = 2**31 - 1
_LEASE_TOKEN = re.compile(r"[A-Za-z0-9_-]{0,64}")
_DIGEST = re.compile(r"(?:[0-9a-f]{64})?")
_DIGEST_DOMAIN = b"kvbridge.prompt_digest.v1"


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """True when a request asks this (prefill) node to keep its KV for a decode node."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """True when a request's prompt KV was computed on another node and must be pulled."""
    return bool(params) and params.get("do_remote_prefill") is True  # type: ignore[union-attr]


def _require(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in params:
        raise KVTransferParamsError(key, "missing")
    value = params[key]
    # bool is an int subclass; a JSON true where a number belongs is still a type error.
    if isinstance(value, bool) and kind is not bool:
        raise KVTransferParamsError(key, f"expected {kind}, got bool")
    if not isinstance(value, kind):
        raise KVTransferParamsError(key, f"expected {kind}, got {type(value).__name__}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class RemotePrefillParams:
    """Where D pulls a request's prompt KV from.

    Attributes:
        remote_engine_id: P's engine id.
        remote_incarnation: P's incarnation when it produced the params; a restarted P (new
            incarnation) no longer holds these blocks, and the pull is refused at handshake.
        remote_request_id: the request id on P (names the lease D extends and releases).
        remote_host, remote_port: P's transport listen address.
        remote_block_ids: P's block ids per KV cache group, in position order; 0 is P's null
            block (a position P no longer holds, e.g. outside a sliding window).
        remote_num_tokens: prompt tokens whose KV P computed (positions ``[0, n)``).
        remote_block_size: P's tokens per block; must equal D's (different block sizes are
            refused with an error naming both, never transferred blindly).
        lease_expires_at: P's wall clock (seconds since the epoch) when P stops holding the
            blocks unless D's heartbeats extend the lease.
        remote_lease_token: the ticket's capability (URL-safe base64, ``secrets``): P extends,
            releases and serves the lease's unhashed block only to a peer presenting it.
            Optional when parsing (``""``: a ticket without one, which P refuses when its lease
            has a token).
        remote_prompt_digest: ``prompt_digest`` of P's request over ``remote_num_tokens``
            (64 lowercase hex digits), or ``""`` (optional: a prompt it cannot cover, a P that
            sends none); D refuses a ticket whose digest is not its own request's.
    """

    remote_engine_id: str
    remote_incarnation: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_num_tokens: int
    remote_block_size: int
    lease_expires_at: float
    remote_lease_token: str = ""
    remote_prompt_digest: str = ""

    @classmethod
    def parse(
        cls, params: Mapping[str, Any], *, num_groups: int, block_size: int,
        num_prompt_tokens: int | None = None,
    ) -> RemotePrefillParams:
        """Validate D-side params.

        Args:
            params: the request's ``kv_transfer_params`` (``do_remote_prefill`` true).
            num_groups: KV cache groups on this node; ``remote_block_ids`` must have as many.
            block_size: tokens per block (same on both nodes, checked again at handshake); every
                group lists exactly ``cdiv(remote_num_tokens, block_size)`` ids.
            num_prompt_tokens: the prompt length of the request the params came with, when
                known; ``remote_num_tokens`` may not exceed it (P computed KV for positions this
                request does not have; clamping it would hide a proxy pairing the wrong
                params with a prompt). None skips this check.

        Raises:
            KVTransferParamsError: a field is missing, of the wrong type or out of range.
        """
        if not isinstance(params, Mapping):
            raise KVTransferParamsError(
                "<root>", f"expected a mapping, got {type(params).__name__}"
            )
        engine_id = _require(params, "remote_engine_id", str)
        incarnation = _require(params, "remote_incarnation", str)
        request_id = _require(params, "remote_request_id", str)
        host = _require(params, "remote_host", str)
        port = _require(params, "remote_port", int)
        num_tokens = _require(params, "remote_num_tokens", int)
        remote_block_size = _require(params, "remote_block_size", int)
        expires = _require(params, "lease_expires_at", (int, float))
        raw_ids = _require(params, "remote_block_ids", (list, tuple))
        token = params.get("remote_lease_token", "")
        if not isinstance(token, str) or not _LEASE_TOKEN.fullmatch(token):
            raise KVTransferParamsError(
                "remote_lease_token", "expected at most 64 URL-safe base64 characters"
            )
        digest = params.get("remote_prompt_digest", "")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise KVTransferParamsError(
                "remote_prompt_digest", "expected 64 lowercase hex digits or an empty string"
            )
        for key, value in (
            ("remote_engine_id", engine_id),
            ("remote_request_id", request_id),
            ("remote_host", host),
        ):
            if not value:
                raise KVTransferParamsError(key, "must be non-empty")
        for key, value in (
            ("remote_engine_id", engine_id),
            ("remote_incarnation", incarnation),
            ("remote_request_id", request_id),
            ("remote_host", host),
        ):  # each travels in the pull's messages, whose schema caps strings (``MAX_STR_LEN``)
            if len(value) > MAX_STR_LEN:
                raise KVTransferParamsError(
                    key, f"at most {MAX_STR_LEN} characters, got {len(value)}"
                )
        if not 1 <= port <= 65535:
            raise KVTransferParamsError("remote_port", f"must be in [1, 65535], got {port}")
        if not math.isfinite(expires):
            raise KVTransferParamsError("lease_expires_at", f"must be finite, got {expires}")
        if num_tokens < 1:
            raise KVTransferParamsError("remote_num_tokens", f"must be >= 1, got {num_tokens}")
        if num_prompt_tokens is not None and num_tokens > num_prompt_tokens:
            raise KVTransferParamsError(
                "remote_num_tokens",
                f"{num_tokens} exceeds the request's prompt of {num_prompt_tokens} tokens",
            )
        if remote_block_size != block_size:
            raise KVTransferParamsError(
                "remote_block_size",
                f"local {block_size}, remote {remote_block_size}: prefill and decode nodes "
                "must use the same block size",
            )
        if len(raw_ids) != num_groups:
            raise KVTransferParamsError(
                "remote_block_ids", f"expected {num_groups} groups, got {len(raw_ids)}"
            )
        num_blocks = -(-num_tokens // block_size)
        block_ids = tuple(_check_group_ids(g, ids, num_blocks) for g, ids in enumerate(raw_ids))
        return cls(
            remote_engine_id=engine_id,
            remote_incarnation=incarnation,
            remote_request_id=request_id,
            remote_host=host,
            remote_port=port,
            remote_block_ids=block_ids,
            remote_num_tokens=num_tokens,
            remote_block_size=remote_block_size,
            lease_expires_at=float(expires),
            remote_lease_token=token,
            remote_prompt_digest=digest,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON/msgpack-ready form D receives (``do_remote_prefill`` set)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_incarnation": self.remote_incarnation,
            "remote_request_id": self.remote_request_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_block_ids": [list(ids) for ids in self.remote_block_ids],
            "remote_num_tokens": self.remote_num_tokens,
            "remote_block_size": self.remote_block_size,
            "lease_expires_at": self.lease_expires_at,
            "remote_lease_token": self.remote_lease_token,
            "remote_prompt_digest": self.remote_prompt_digest,
        }


def _check_group_ids(group_id: int, ids: Any, num_blocks: int) -> tuple[int, ...]:
    field = f"remote_block_ids[{group_id}]"
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise KVTransferParamsError(field, f"expected a list of ints, got {type(ids).__name__}")
    if len(ids) != num_blocks:
        raise KVTransferParamsError(
            field, f"expected {num_blocks} ids for remote_num_tokens, got {len(ids)}"
        )
    for block_id in ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise KVTransferParamsError(field, f"block id {block_id!r} is not an int")
        if not 0 <= block_id <= _MAX_BLOCK_ID:
            raise KVTransferParamsError(field, f"block id {block_id} out of range")
    real = [b for b in ids if b != 0]
    if len(set(real)) != len(real):
        raise KVTransferParamsError(field, "block ids repeat")
    return tuple(ids)


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


def ticket_of(params: RemotePrefillParams) -> Ticket:
    """The lease a handoff's params name on their prefill node, with its capability token."""
    return Ticket(
        params.remote_host, params.remote_port, params.remote_request_id, params.remote_lease_token
    )


def release_notice_for_rejected(kv_transfer_params: Any, reason: str) -> ReleaseNotice | None:
    """The release notice for a prefill node whose handoff a decode node refused before
    admission (best effort: params too broken to name a usable address or lease, a request id
    or token no lease has, give None, and the lease ends the hold). ``kv_transfer_params`` may
    be anything a client sent; ``reason`` is clipped to what the wire carries."""
    if not (isinstance(kv_transfer_params, Mapping) and wants_remote_prefill(kv_transfer_params)):
        return None
    host = kv_transfer_params.get("remote_host")
    port = kv_transfer_params.get("remote_port")
    remote_request_id = kv_transfer_params.get("remote_request_id")
    if not (isinstance(host, str) and host and isinstance(port, int)):
        return None
    if isinstance(port, bool) or not 0 < port < 65536 or not isinstance(remote_request_id, str):
        return None
    token = kv_transfer_params.get("remote_lease_token", "")
    if not 0 < len(remote_request_id) <= MAX_STR_LEN or not (
        isinstance(token, str) and _LEASE_TOKEN.fullmatch(token)
    ):
        return None
    return ReleaseNotice(
        ticket=Ticket(host, port, remote_request_id, token),
        success=False,
        reason=clip_text(f"rejected: {reason}"),
    )
