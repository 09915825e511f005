"""Error types of the transport.

Policy (STYLE.md, point 8): a caller mistake raises ``ValueError``; bad input from the network
raises one of these, caught at the request boundary so one bad peer or one bad message never
stops a node from serving the others.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of every error the transport raises for network-side trouble."""


class PeerUnreachableError(TransportError):
    """No connection to the peer's address (refused, timed out, no route, no such node): the
    peer is down, or its advertised transport address is not reachable from here."""


class WireError(TransportError):
    """A control message that cannot be decoded: bad framing, unknown schema version, unknown
    message type, or a field of the wrong type or out of range. The message names the field."""


class HandshakeError(TransportError):
    """The peer refused us, or we refused the peer, at handshake: incompatible metadata (the
    message names the differing field, e.g. ``"block_size: local 16, remote 32"``), or no reply."""


class TransferError(TransportError):
    """A block read that did not complete.

    Attributes:
        request_id: the request the read belonged to.
        local_block_ids: every local block id (of all groups, in request order) whose bytes did
            not land; the caller must treat them as not loaded (vLLM's ``invalid_block_ids``).
    """

    def __init__(self, message: str, *, request_id: str, local_block_ids: tuple[int, ...]):
        super().__init__(
            f"request {request_id!r}: {message} (local blocks {list(local_block_ids)})"
        )
        self.request_id = request_id
        self.local_block_ids = local_block_ids


class TransferTimeoutError(TransferError):
    """The read passed its deadline (holder hung, slow, or dead without a closed socket)."""


class TransferCancelledError(TransferError):
    """The read was cancelled with ``Transport.cancel(request_id)``."""
