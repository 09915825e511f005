"""A stranger process for the peer-authentication tests: it can reach a holder's transport port
but does not hold the cluster key. It tries, each on a fresh TCP connection, what an attacker
would, and prints one JSON line per attempt: what came back and whether the holder then closed.

    python tests/_stranger_peer.py PORT

Attempts: a ``Hello`` without a nonce then a ``Read``; the same for a notices-only connection
(``Hello.notices_only``) then a ``TransferDone``; a ``Hello`` with a nonce and a forged
``AuthProof`` then a ``Read``; no ``Hello`` at all (a ``Heartbeat``, a ``TransferDone`` and a
``Read`` straight away). Plain sockets and the wire codec only: no UCX, no key.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from _transport_helpers import make_kv_caches, make_metadata
from kvbridge.transport.wire import (
    AuthProof,
    GroupReadMsg,
    Heartbeat,
    Hello,
    Read,
    TransferDoneNotice,
    decode_message,
    encode_message,
)


def _read_replies(sock: socket.socket) -> tuple[list[dict], bool]:
    """Every frame the holder sends until it closes (or 5 s of silence)."""
    sock.settimeout(5.0)
    buffer = b""
    replies: list[dict] = []
    closed = False
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        buffer += chunk
        while len(buffer) >= 4 and len(buffer) >= 4 + int.from_bytes(buffer[:4], "big"):
            length = int.from_bytes(buffer[:4], "big")
            message = decode_message(buffer[4 : 4 + length])
            buffer = buffer[4 + length :]
            replies.append(
                {"type": type(message).__name__, "code": getattr(message, "code", None)}
            )
    return replies, closed


def _attempt(port: int, name: str, messages: list) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for message in messages:
            try:
                sock.sendall(encode_message(message))
            except OSError:
                break
        replies, closed = _read_replies(sock)
    print(json.dumps({"attempt": name, "replies": replies, "closed": closed}), flush=True)


def main(port: int) -> None:
    metadata = make_metadata("stranger", make_kv_caches(seed=0))
    read = Read(
        transfer_id=1,
        request_id="p-req",
        tag_base=1 << 20,
        chunk_bytes=1 << 14,
        deadline_ms=2000,
        groups=[GroupReadMsg(group_id=0, block_ids=[1, 2, 3], expected_hashes=None)],
        cma=True,  # a same-host read: if it were accepted the stranger would copy the blocks
    )
    heartbeat = Heartbeat(request_ids=["p-req"])
    notice = TransferDoneNotice(peer_engine_id="stranger", request_id="p-req", success=True,
                                reason="")

    def hello(nonce: bytes, notices_only: bool = False) -> Hello:
        return Hello(metadata=metadata, compat_hash=metadata.compat_hash,
                     worker_address=b"not-a-worker", auth_nonce=nonce, notices_only=notices_only)

    _attempt(port, "no_nonce", [hello(b""), read, heartbeat, notice])
    _attempt(port, "notices_only_no_nonce", [hello(b"", notices_only=True), notice])
    _attempt(port, "forged_proof",
             [hello(os.urandom(32)), AuthProof(proof=os.urandom(32)), read, heartbeat, notice])
    _attempt(port, "no_hello", [heartbeat, notice, read])


if __name__ == "__main__":
    main(int(sys.argv[1]))
