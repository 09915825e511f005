"""Peer authentication: both ends of a control connection prove they hold the cluster key.

A node configured with a cluster key (``auth_key``, bytes; the connector reads it from its
config, an environment variable or a file) runs a challenge-response inside the handshake, with
HMAC-SHA256 from the standard library; the key never travels::

    requester                                   holder
    Hello{..., auth_nonce=Nr}  ───────────────>
                               <─────────────── AuthChallenge{nonce=Nh,
                                                  proof=HMAC(k, "holder" | Nr | Nh | H(Hello))}
    checks the holder's proof
    AuthProof{HMAC(k, "requester" | Nr | Nh | H(Hello))} ──>
                                                checks it; only then HelloOk (layout, UCX worker
                               <─────────────── address, same-host offer) and any other message

``H(Hello)`` is the sha256 of the ``Hello`` frame's payload as sent, so a proof is bound to the
requester's metadata and UCX worker address; the two labels keep one side's proof from being
replayed as the other's; fresh 32-byte nonces on both sides keep an old proof from being
replayed at all. Without the proof a holder answers nothing but ``ErrorMsg`` (code
``"unauthenticated"``) and closes: the stranger reads no block, touches no lease and learns
neither the holder's layout nor its addresses. A requester with a key refuses a holder that
cannot prove it (a stranger posing as a holder could otherwise feed it wrong KV).

This authenticates peers; it does not encrypt. Block bytes and control messages travel in the
clear, so a network where someone can watch or alter traffic needs a tunnel (WireGuard, IPsec)
or a private link as well.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = [
    "MIN_KEY_BYTES",
    "NONCE_BYTES",
    "check_auth_key",
    "holder_proof",
    "new_nonce",
    "proof_matches",
    "requester_proof",
]

NONCE_BYTES = 32
MIN_KEY_BYTES = 16
"""A shorter key is refused where it is configured (128 bits at least)."""

_HOLDER_LABEL = b"kvbridge-auth-v1 holder"
_REQUESTER_LABEL = b"kvbridge-auth-v1 requester"


def check_auth_key(auth_key: bytes | None) -> None:
    """Raise ``ValueError`` unless ``auth_key`` is None or bytes of at least ``MIN_KEY_BYTES``."""
    if auth_key is None:
        return
    if not isinstance(auth_key, bytes) or len(auth_key) < MIN_KEY_BYTES:
        raise ValueError(f"auth_key must be bytes of at least {MIN_KEY_BYTES} bytes")


def new_nonce() -> bytes:
    """Fresh random bytes for one handshake (``secrets``)."""
    return secrets.token_bytes(NONCE_BYTES)


def _proof(
    key: bytes, label: bytes, requester_nonce: bytes, holder_nonce: bytes, hello_payload: bytes
) -> bytes:
    message = b"\x00".join(
        (label, requester_nonce, holder_nonce, hashlib.sha256(hello_payload).digest())
    )
    return hmac.new(key, message, hashlib.sha256).digest()


def holder_proof(
    key: bytes, requester_nonce: bytes, holder_nonce: bytes, hello_payload: bytes
) -> bytes:
    """The holder's ``AuthChallenge.proof`` (32 bytes)."""
    return _proof(key, _HOLDER_LABEL, requester_nonce, holder_nonce, hello_payload)


def requester_proof(
    key: bytes, requester_nonce: bytes, holder_nonce: bytes, hello_payload: bytes
) -> bytes:
    """The requester's ``AuthProof.proof`` (32 bytes)."""
    return _proof(key, _REQUESTER_LABEL, requester_nonce, holder_nonce, hello_payload)


def proof_matches(expected: bytes, presented: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, presented)
