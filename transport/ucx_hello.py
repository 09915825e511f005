"""The requester's half of ``UcxxTransport``'s control handshake: send ``Hello``, prove the
cluster key when this node holds one (``auth``: the holder proves it first), and return the
holder's ``HelloOk``. Anything else (a refusal, a holder that cannot prove the key, silence) is a
``HandshakeError`` naming the peer. The holder's half is ``ucxx_holder``; what the requester
then checks of ``HelloOk`` (compatibility, worker address) stays with ``UcxxTransport``.

Both halves time their steps (``HandshakeClock``) and log a handshake slower than
``SLOW_HANDSHAKE_S`` step by step, so a slow first contact says where its time went.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .auth import NONCE_BYTES, holder_proof, proof_matches, requester_proof
from .base import PeerAddress
from .control import read_frame, write_message
from .errors import HandshakeError, WireError
from .wire import AuthChallenge, AuthProof, ErrorMsg, Hello, HelloOk, decode_message, encode_message

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
"""How long the requester waits for each handshake answer (and for the TCP connection)."""
SLOW_HANDSHAKE_S = 1.0
"""A handshake that took this long (seconds; one side's view) is logged step by step."""


class HandshakeClock:
    """The steps of one side's handshake with ``peer`` and how long each took (``mark`` after
    each); ``report`` logs them when the whole took ``SLOW_HANDSHAKE_S`` or more. Loop thread.
    """

    def __init__(self, side: str, peer: object) -> None:
        self.side, self.peer = side, peer
        self.started_at = self._last = time.monotonic()
        self.steps: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self.steps.append((step, now - self._last))
        self._last = now

    def report(self) -> None:
        total = time.monotonic() - self.started_at
        if total >= SLOW_HANDSHAKE_S:
            done = ", ".join(f"{step} {seconds:.3f} s" for step, seconds in self.steps)
            logger.warning("%s handshake with %s took %.2f s (%s; then %.3f s to the end)",
                           self.side, self.peer, total, done or "no step done",
                           time.monotonic() - self._last)


async def exchange_hello(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    peer: PeerAddress,
    hello: Hello,
    auth_key: bytes | None,
) -> HelloOk:
    """Run the handshake on a fresh control connection to ``peer``; ``hello.auth_nonce`` must
    be a fresh nonce when ``auth_key`` is set. Loop thread.

    Raises:
        HandshakeError: refused (the holder's ``ErrorMsg``), the key not proved either way, or
            no valid answer within ``HANDSHAKE_TIMEOUT_S``.
        TransportError: the connection broke while sending.
    """
    await write_message(writer, hello)
    reply = await _reply(reader, peer)
    if auth_key is not None:  # the proofs cover the Hello as sent (deterministic)
        hello_payload = bytes(encode_message(hello)[4:])
        proof = _our_proof(reply, peer, auth_key, hello.auth_nonce, hello_payload)
        await write_message(writer, AuthProof(proof=proof))
        reply = await _reply(reader, peer)
    elif isinstance(reply, AuthChallenge):
        raise HandshakeError(
            f"peer {tuple(peer)} requires the cluster key (auth_key); this node has none"
        )
    if isinstance(reply, ErrorMsg):
        raise HandshakeError(f"refused by peer {tuple(peer)}: {reply.message}")
    if not isinstance(reply, HelloOk):
        raise HandshakeError(f"expected HelloOk from {tuple(peer)}, got {type(reply).__name__}")
    return reply


async def _reply(reader: asyncio.StreamReader, peer: PeerAddress) -> object:
    """The holder's next handshake message (``HandshakeError`` if none comes in time)."""
    try:
        return decode_message(await asyncio.wait_for(read_frame(reader), HANDSHAKE_TIMEOUT_S))
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
        raise HandshakeError(f"no handshake answer from {tuple(peer)}: {exc!r}") from None
    except WireError as exc:
        raise HandshakeError(f"bad handshake answer from {tuple(peer)}: {exc}") from None


def _our_proof(
    reply: object, peer: PeerAddress, auth_key: bytes, nonce: bytes, hello_payload: bytes
) -> bytes:
    """Our ``AuthProof`` once ``reply`` proved the holder holds the cluster key (``auth``).

    Raises:
        HandshakeError: the holder refused us, or did not prove the key.
    """
    if isinstance(reply, ErrorMsg):
        raise HandshakeError(f"refused by peer {tuple(peer)}: {reply.message}")
    if not isinstance(reply, AuthChallenge) or len(reply.nonce) != NONCE_BYTES:
        raise HandshakeError(
            f"peer {tuple(peer)} did not prove the cluster key (a holder without auth_key?)"
        )
    if not proof_matches(holder_proof(auth_key, nonce, reply.nonce, hello_payload), reply.proof):
        raise HandshakeError(f"peer {tuple(peer)} failed the cluster key check")
    return requester_proof(auth_key, nonce, reply.nonce, hello_payload)
