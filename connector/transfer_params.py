"""``kv_transfer_params``: what a proxy carries from the prefill node P to the decode node D.

The shapes follow vLLM's NIXL connector (vllm/distributed/kv_transfer/kv_connector/v1/
nixl_connector.py). A request for P carries ``{"do_remote_decode": true}``; P's
``request_finished`` answers with ``RemotePrefillParams.to_dict()``, which the proxy forwards to
D unchanged. Everything here came over the network, so ``RemotePrefillParams.parse`` checks every
field's type and range and raises ``KVTransferParamsError`` naming the field.

A tensor-parallel P (issue 30) adds, as vLLM's NIXL ticket carries ``tp_size``::

    "remote_tp_size": 2,                       # P's ranks (absent: 1)
    "remote_ranks": [{"host", "port", "incarnation"}, ...],   # by tp rank; [0] = remote_*
    "remote_num_kv_heads": 8,                  # the model's KV heads, as P counts them

A ticket of a P of one rank is unchanged (the three fields absent); D reads each rank's heads
from the rank that holds them (``tp_layout``).

A ticket names P's blocks, not the prompt they hold, and a proxy can pair it with another
request. P's hash check refuses a full block of another prompt (``holder``), but a partial last
block has no hash: only the lease guards it, and a prompt that shares every full block with the
ticket's would load the other prompt's tail. So the ticket also carries a digest of the tokens
it covers (``remote_prompt_digest``, from ``prompt_digest``), and D compares it with its own
request's before pulling anything (``handoff``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.transport.address import check_host
from kvbridge.transport.limits import MAX_STR_LEN, clip_text

from .errors import KVTransferParamsError
from .metadata import ReleaseNotice, Ticket
from .tp_layout import MAX_TP_SIZE, TPLayout, pairing_error

__all__ = [
    "PrefillRank",
    "RemotePrefillParams",
    "rank_tickets",
    "release_notices_for_rejected",
    "ticket_of",
    "wants_remote_decode",
    "wants_remote_prefill",
]

_MAX_BLOCK_ID = 2**31 - 1
_MAX_KV_HEADS = 1 << 16
_LEASE_TOKEN = re.compile(r"[A-Za-z0-9_-]{0,64}")
_DIGEST = re.compile(r"(?:[0-9a-f]{64})?")


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


@dataclass(frozen=True, slots=True)
class PrefillRank:
    """One rank of P: where its transport listens, and its incarnation (each rank's worker has
    its own)."""

    host: str
    port: int
    incarnation: str


def _check_rank(key: str, host: Any, port: Any, incarnation: Any) -> PrefillRank:
    """A rank's address from the network, checked as ``remote_host`` and the others are."""
    for name, value, kind in (("host", host, str), ("port", port, int),
                              ("incarnation", incarnation, str)):
        if isinstance(value, bool) or not isinstance(value, kind):
            raise KVTransferParamsError(f"{key}.{name}", f"expected {kind.__name__}")
    if not host:
        raise KVTransferParamsError(f"{key}.host", "must be non-empty")
    for name, value in (("host", host), ("incarnation", incarnation)):
        if len(value) > MAX_STR_LEN:
            raise KVTransferParamsError(f"{key}.{name}", f"at most {MAX_STR_LEN} characters")
    if not 1 <= port <= 65535:
        raise KVTransferParamsError(f"{key}.port", f"must be in [1, 65535], got {port}")
    return PrefillRank(host, port, incarnation)


@dataclass(frozen=True, kw_only=True, slots=True)
class RemotePrefillParams:
    """Where D pulls a request's prompt KV from.

    Attributes:
        remote_engine_id: P's engine id.
        remote_incarnation: P's incarnation when it produced the params; a restarted P (new
            incarnation) no longer holds these blocks, and the pull is refused at handshake.
        remote_request_id: the request id on P (names the lease D extends and releases).
        remote_host, remote_port: P's transport listen address; the host is a hostname or an
            IP address, an IPv6 one bare (``"::1"``, no brackets: the port is a field of its
            own; ``kvbridge.transport.address``).
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
        remote_tp_size: P's tensor-parallel ranks (1: the fields below are empty).
        remote_ranks: every rank of P by tp rank (rank 0 is ``remote_host``, ``remote_port``,
            ``remote_incarnation``); each holds the lease under the same id and token.
        remote_num_kv_heads: the model's KV heads on P (0: not named, a ticket of one rank).
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
    remote_tp_size: int = 1
    remote_ranks: tuple[PrefillRank, ...] = ()
    remote_num_kv_heads: int = 0
    remote_prompt_digest: str = ""

    def ranks(self) -> tuple[PrefillRank, ...]:
        """Every rank of P by tp rank (``remote_ranks``, or rank 0 alone)."""
        if self.remote_ranks:
            return self.remote_ranks
        return (PrefillRank(self.remote_host, self.remote_port, self.remote_incarnation),)

    @classmethod
    def parse(
        cls, params: Mapping[str, Any], *, num_groups: int, block_size: int,
        num_prompt_tokens: int | None = None, local_tp: TPLayout | None = None,
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
            local_tp: this engine's tensor-parallel layout (any rank's: its size and heads);
                a P of another size must be one it can read from (``tp_layout.pairing_error``),
                of the same head count. None: an engine that does not name its heads, which
                takes tickets of a P of one rank only.

        Raises:
            KVTransferParamsError: a field is missing, of the wrong type or out of range, or a
                P this engine cannot read from (naming both tp sizes and the head count).
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
        try:
            check_host(host, what="remote_host")
        except ValueError as exc:
            raise KVTransferParamsError("remote_host", str(exc)) from None
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
        rank0 = PrefillRank(host, port, incarnation)
        tp_size, ranks, num_kv_heads = _parse_ranks(params, rank0, local_tp)
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
            remote_tp_size=tp_size,
            remote_ranks=ranks,
            remote_num_kv_heads=num_kv_heads,
            remote_prompt_digest=digest,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON/msgpack-ready form D receives (``do_remote_prefill`` set; the
        tensor-parallel fields only for a P of several ranks)."""
        tp: dict[str, Any] = {}
        if self.remote_tp_size > 1:
            tp = {
                "remote_tp_size": self.remote_tp_size,
                "remote_ranks": [
                    {"host": r.host, "port": r.port, "incarnation": r.incarnation}
                    for r in self.remote_ranks
                ],
                "remote_num_kv_heads": self.remote_num_kv_heads,
            }
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
            **tp,
            "remote_prompt_digest": self.remote_prompt_digest,
        }


def _int_field(params: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVTransferParamsError(key, f"expected int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise KVTransferParamsError(key, f"must be in [{lo}, {hi}], got {value}")
    return value


def _parse_ranks(
    params: Mapping[str, Any], rank0: PrefillRank, local_tp: TPLayout | None
) -> tuple[int, tuple[PrefillRank, ...], int]:
    """``(remote_tp_size, remote_ranks, remote_num_kv_heads)`` of a ticket, checked against
    this engine's layout (``RemotePrefillParams.parse``)."""
    tp_size = _int_field(params, "remote_tp_size", 1, 1, MAX_TP_SIZE)
    raw_ranks = params.get("remote_ranks")
    ranks: tuple[PrefillRank, ...] = ()
    if tp_size > 1 or raw_ranks is not None:
        if not isinstance(raw_ranks, (list, tuple)):
            raise KVTransferParamsError(
                "remote_ranks",
                f"expected a list of {tp_size} ranks, got {type(raw_ranks).__name__}",
            )
        if len(raw_ranks) != tp_size:
            raise KVTransferParamsError(
                "remote_ranks", f"{len(raw_ranks)} ranks for remote_tp_size {tp_size}"
            )
        checked = []
        for rank, raw in enumerate(raw_ranks):
            key = f"remote_ranks[{rank}]"
            if not isinstance(raw, Mapping):
                raise KVTransferParamsError(key, f"expected a mapping, got {type(raw).__name__}")
            checked.append(
                _check_rank(key, raw.get("host"), raw.get("port"), raw.get("incarnation"))
            )
        if checked[0] != rank0:
            raise KVTransferParamsError(
                "remote_ranks[0]", "must be remote_host, remote_port and remote_incarnation"
            )
        ranks = tuple(checked) if tp_size > 1 else ()
    if tp_size > 1 and "remote_num_kv_heads" not in params:
        raise KVTransferParamsError("remote_num_kv_heads", "missing (remote_tp_size > 1)")
    num_kv_heads = _int_field(params, "remote_num_kv_heads", 0, 0, _MAX_KV_HEADS)
    if tp_size > 1 and num_kv_heads < 1:
        raise KVTransferParamsError("remote_num_kv_heads", "must be >= 1")
    if local_tp is None:
        if tp_size > 1:
            raise KVTransferParamsError(
                "remote_tp_size", f"{tp_size}: this engine does not name its KV heads, so it "
                "reads from a prefill engine of one rank only"
            )
        return tp_size, ranks, num_kv_heads
    total = local_tp.total_num_kv_heads
    if num_kv_heads and num_kv_heads != total:
        raise KVTransferParamsError(
            "remote_num_kv_heads",
            f"the prefill model has {num_kv_heads} KV heads, this one {total}",
        )
    error = pairing_error(local_tp, tp_size)
    if error is not None:
        raise KVTransferParamsError("remote_tp_size", error)
    return tp_size, ranks, num_kv_heads


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


def ticket_of(params: RemotePrefillParams) -> Ticket:
    """The lease a handoff's params name on their prefill node (rank 0), with its capability
    token."""
    return Ticket(
        params.remote_host, params.remote_port, params.remote_request_id, params.remote_lease_token
    )


def rank_tickets(params: RemotePrefillParams) -> list[Ticket]:
    """The lease on every rank of P (rank order): the same id and token at each rank's
    address. Heartbeats and release notices go to all of them."""
    return [
        Ticket(r.host, r.port, params.remote_request_id, params.remote_lease_token)
        for r in params.ranks()
    ]


def release_notices_for_rejected(kv_transfer_params: Any, reason: str) -> list[ReleaseNotice]:
    """The release notices for a prefill node whose handoff a decode node refused before
    admission, one per rank whose address the params name usably (``remote_host`` /
    ``remote_port`` and the entries of ``remote_ranks``; best effort: params too broken to name
    a usable address or lease, a request id or token no lease has, give none, and the lease
    ends the hold). ``kv_transfer_params`` may be anything a client sent; ``reason`` is clipped
    to what the wire carries."""
    if not (isinstance(kv_transfer_params, Mapping) and wants_remote_prefill(kv_transfer_params)):
        return []
    remote_request_id = kv_transfer_params.get("remote_request_id")
    token = kv_transfer_params.get("remote_lease_token", "")
    if not (isinstance(remote_request_id, str) and 0 < len(remote_request_id) <= MAX_STR_LEN):
        return []
    if not (isinstance(token, str) and _LEASE_TOKEN.fullmatch(token)):
        return []
    addresses = [(kv_transfer_params.get("remote_host"), kv_transfer_params.get("remote_port"))]
    ranks = kv_transfer_params.get("remote_ranks")
    if isinstance(ranks, (list, tuple)):
        addresses += [(r.get("host"), r.get("port")) for r in ranks[:MAX_TP_SIZE]
                      if isinstance(r, Mapping)]
    notices, seen = [], set()
    for host, port in addresses:
        usable = isinstance(host, str) and 0 < len(host) <= MAX_STR_LEN
        usable = usable and isinstance(port, int) and not isinstance(port, bool)
        if not usable or not 0 < port < 65536 or (host, port) in seen:
            continue
        try:
            check_host(host, what="remote_host")  # not a host: nowhere to send it
        except ValueError:
            continue
        seen.add((host, port))
        notices.append(ReleaseNotice(
            ticket=Ticket(host, port, remote_request_id, token),
            success=False,
            reason=clip_text(f"rejected: {reason}"),
        ))
    return notices
