"""kvbridge.transport: moving paged KV blocks between nodes.

``Transport`` (``base``) is the protocol. ``UcxxTransport`` moves bytes over UCX, or between
processes on one host by cross-memory attach (``cma``); it is imported lazily, so loading this
package does not load UCX. ``LoopbackTransport`` is its in-process twin for unit tests. ``wire``
is the control schema (msgspec structs over msgpack, bounded by ``limits``), ``metadata`` the
handshake metadata and compatibility check, ``identity`` what a block's bytes depend on,
``address`` the syntax of hosts and ``host:port`` (IPv6 in brackets) that every address kvbridge
takes or hands out goes through.
"""

from typing import Any

from .address import (
    HostPort,
    check_host,
    format_host_port,
    parse_base_url,
    parse_host_port,
    split_host_port,
)
from .base import (
    DEFAULT_CHUNK_BYTES,
    BlockValidator,
    GroupRead,
    HeartbeatCallback,
    HolderCallbacks,
    LeaseRef,
    PeerAddress,
    ReadResult,
    TransferDoneCallback,
    TransferDoneNotice,
    Transport,
)
from .board_look import BoardLook, BoardRef, look_at_board
from .cma_board import BlockBoard, BoardCounts, full_block_tag, lease_block_tag
from .errors import (
    HandshakeError,
    PeerUnreachableError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
    TransportError,
    WireError,
)
from .identity import BlockIdentity, IdentityDifference
from .loopback import LoopbackFaults, LoopbackNetwork, LoopbackTransport
from .metadata import KV_LAYOUT_NAME, KVGroupLayout, KVHeads, NodeMetadata, check_compatible
from .wire import WIRE_VERSION


def __getattr__(name: str) -> Any:
    if name == "UcxxTransport":
        from .ucxx_transport import UcxxTransport

        return UcxxTransport
    raise AttributeError(name)


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "KV_LAYOUT_NAME",
    "WIRE_VERSION",
    "BlockBoard",
    "BlockIdentity",
    "BlockValidator",
    "BoardCounts",
    "BoardLook",
    "BoardRef",
    "GroupRead",
    "HandshakeError",
    "HeartbeatCallback",
    "HolderCallbacks",
    "HostPort",
    "IdentityDifference",
    "KVGroupLayout",
    "KVHeads",
    "LeaseRef",
    "LoopbackFaults",
    "LoopbackNetwork",
    "LoopbackTransport",
    "NodeMetadata",
    "PeerAddress",
    "PeerUnreachableError",
    "ReadResult",
    "TransferCancelledError",
    "TransferDoneCallback",
    "TransferDoneNotice",
    "TransferError",
    "TransferTimeoutError",
    "Transport",
    "TransportError",
    "UcxxTransport",
    "WireError",
    "check_compatible",
    "check_host",
    "format_host_port",
    "full_block_tag",
    "lease_block_tag",
    "look_at_board",
    "parse_base_url",
    "parse_host_port",
    "split_host_port",
]
