"""The control-message wire schema: ``msgspec`` structs over msgpack, with an explicit version.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack: the map
``{"v": WIRE_VERSION, "msg": {"t": <type>, ...fields}}``. Each message type is a frozen
``msgspec.Struct`` tagged by ``t``; ``decode_message`` decodes the frame into the tagged union in
one step, checking every field's type, range and length (``limits``), then the version. Anything
that does not fit raises ``WireError`` naming the field's path (msgspec's ``ValidationError``
text, e.g. ``Expected `int` >= 1 - at `$.msg.transfer_id```); a frame of another version is
refused as such, whatever else it holds. The server answers with an ``ErrorMsg`` and keeps
serving (DESIGN.md, "Reliability rules": everything that arrives over the network is validated).
Checks across fields (a hash per block id, a region per layer, a consistent ``compat_hash``) run
in ``__post_init__``, which msgspec also runs when decoding; a local caller that builds such a
message wrongly gets ``ValueError``.

A ``Read`` under a handoff's lease names it in its own field (``LeaseRef``: the holder's request
id and the ticket's token); its positions the lease alone guards (the partial last block, which
has no hash) carry an empty expected hash.

Requester -> holder: ``Hello``, ``AuthProof``, ``Read``, ``ReadCopied``, ``Cancel``,
``Heartbeat``, ``TransferDoneNotice`` (tag ``TransferDone``).
Holder -> requester: ``AuthChallenge``, ``HelloOk``, ``ReadOk``, ``ReadDone``, ``CancelOk``,
``ErrorMsg``.

One type per concept: ``TransferDoneNotice`` is both the wire message and what the holder's
``on_transfer_done`` receives (the holder refuses one whose ``peer_engine_id`` is not the peer of
its connection); ``NodeMetadata`` travels as it is. ``GroupReadMsg`` is what the holder is asked
for one group (remote ids and hashes); the requester's ``base.GroupRead`` also says where each
block lands here, which the holder is never told.

Block bytes never travel in these messages; they go over UCX tag messages (``ucx_read``,
``ucx_serve``) or, between processes on one host, by cross-memory attach (``cma``).
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .errors import WireError
from .limits import (
    MAX_BLOCKS_PER_READ,
    MAX_CHUNK_BYTES,
    MAX_GROUPS,
    MAX_HASH_BYTES,
    MAX_STR_LEN,
    MIN_CHUNK_BYTES,
    Address,
    AddressesByGroup,
    AuthBytes,
    BlockHashes,
    BlockIds,
    ChunkBytes,
    CompatHash,
    DeadlineMs,
    GroupId,
    LongText,
    NumChunks,
    Pid,
    PositionsByEntry,
    Probe,
    RequestId,
    RequestIds,
    ShortText,
    TagBase,
    Text,
    TransferId,
    TransferIdOrZero,
    WorkerAddress,
    clip_text,
)
from .metadata import NodeMetadata

__all__ = [
    "FRAME_HEADER",
    "MAX_BLOCKS_PER_READ",
    "MAX_CHUNK_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_GROUPS",
    "MAX_HASH_BYTES",
    "MAX_STR_LEN",
    "MIN_CHUNK_BYTES",
    "WIRE_VERSION",
    "AuthChallenge",
    "AuthProof",
    "Cancel",
    "CancelOk",
    "CmaOffer",
    "ErrorMsg",
    "GroupReadMsg",
    "Heartbeat",
    "Hello",
    "HelloOk",
    "LeaseRef",
    "Message",
    "Read",
    "ReadCopied",
    "ReadDone",
    "ReadOk",
    "TransferDoneNotice",
    "decode_message",
    "encode_message",
    "frame_length",
    "transfer_done_notice",
]

WIRE_VERSION = 9
# 2: Cancel carries num_chunks_posted (filler sends, see ucx_serve)
# 3: ReadDone (the holder's re-check of each block after its bytes left, see ``ReadDone``)
# 4: same-host reads: HelloOk.cma, Read.cma, ReadCopied (see ``cma``)
# 5: msgspec schema: {"v", "msg"} frames; compat_hash beside Hello's metadata; TransferDone
#    carries the sender's peer_engine_id
# 6: tickets as capabilities: Heartbeat.tokens, TransferDone.token; peer authentication:
#    Hello.auth_nonce, AuthChallenge, AuthProof (see ``auth``)
# 7: Read.lease (a handoff's lease in its own field, no longer inside an expected hash)
# 8: Read.copy_first (a same-host read under a lease copies while the holder checks it)
# 9: ReadOk.lease_pending (a refusal under a lease not granted yet; otherwise it is final)
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 << 20


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag=True):
    """Base of every control message: frozen, keyword-only, tagged by its class name."""


class GroupReadMsg(msgspec.Struct, frozen=True, kw_only=True):
    """One group's part of a ``Read``: remote block ids and, optionally, one expected hash per
    id (``plan``, "Hash checks on the holder"). An empty expected hash is guarded by the read's
    ``lease`` alone, or not checked when the read has none."""

    group_id: GroupId
    block_ids: BlockIds
    expected_hashes: BlockHashes | None

    def __post_init__(self) -> None:
        hashes = self.expected_hashes
        if hashes is not None and len(hashes) != len(self.block_ids):
            raise ValueError(f"{len(hashes)} expected_hashes for {len(self.block_ids)} block_ids")


class CmaOffer(msgspec.Struct, frozen=True, kw_only=True):
    """What a holder on host memory tells requesters at handshake (``HelloOk.cma``).

    Attributes:
        host_id: the holder's boot id; a requester on another boot (another host) ignores it.
        pid: the holder's process id (in the holder's pid namespace).
        probe_address, probe: a live 16-byte buffer in the holder and its content.
        regions: ``[group][layer]`` address of each KV tensor's first byte
            (``[num_blocks, *block_shape]``, contiguous, as ``NodeMetadata`` describes).
        board_address: the holder's block board (``cma_board``: one entry per block of each
            group, ``NodeMetadata``'s ``num_blocks``), which lets a handoff read skip the
            holder's round trip; None: no board (every read asks the holder).
    """

    host_id: ShortText
    pid: Pid
    probe_address: Address
    probe: Probe
    regions: AddressesByGroup
    board_address: Address | None = None


def _check_compat_hash(metadata: NodeMetadata, compat_hash: str) -> None:
    if compat_hash != metadata.compat_hash:
        raise ValueError("field 'compat_hash' does not match the metadata fields it covers")


class Hello(_Message):
    """The requester's handshake: its metadata, that metadata's ``compat_hash`` as the sender
    computed it (a peer hashing the same fields differently is refused), its UCX worker
    address, and, when it holds a cluster key, a fresh ``auth_nonce`` (``auth``; empty: none)."""

    metadata: NodeMetadata
    compat_hash: CompatHash
    worker_address: WorkerAddress
    auth_nonce: AuthBytes = b""

    def __post_init__(self) -> None:
        _check_compat_hash(self.metadata, self.compat_hash)


class AuthChallenge(_Message):
    """A holder with a cluster key answers a ``Hello`` with this before anything else: its own
    nonce and its proof over both nonces and the ``Hello`` (``auth.holder_proof``)."""

    nonce: AuthBytes
    proof: AuthBytes


class AuthProof(_Message):
    """The requester's answer to ``AuthChallenge`` (``auth.requester_proof``); the holder
    sends ``HelloOk`` only when it checks."""

    proof: AuthBytes


class HelloOk(_Message):
    """The holder's answer to a compatible ``Hello``; ``cma`` is its same-host offer, None
    when its KV tensors are not in host memory (``cma``); its regions must list one address per
    layer of each group of ``metadata``."""

    metadata: NodeMetadata
    compat_hash: CompatHash
    worker_address: WorkerAddress
    cma: CmaOffer | None = None

    def __post_init__(self) -> None:
        _check_compat_hash(self.metadata, self.compat_hash)
        if self.cma is None:
            return
        regions, groups = self.cma.regions, self.metadata.groups
        if len(regions) != len(groups):
            raise ValueError(
                f"field 'cma.regions' has {len(regions)} groups, metadata {len(groups)}"
            )
        for group_id, (addresses, layout) in enumerate(zip(regions, groups, strict=True)):
            if len(addresses) != layout.num_layers:
                raise ValueError(
                    f"field 'cma.regions[{group_id}]' lists {len(addresses)} addresses for "
                    f"{layout.num_layers} layers"
                )


class LeaseRef(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff's lease on the holder, as a read presents it: ``request_id`` names the lease there
    (the prefill side's request id) and ``token`` is its ticket's capability
    (``remote_lease_token``; empty: none presented). The holder's validator serves a position with
    an empty expected hash only while this lease is held, has this token and covers the block."""

    request_id: RequestId
    token: ShortText = ""


class Read(_Message):
    """Pull request. The holder sends chunk ``k`` of the plan with UCX tag ``tag_base + k``;
    with ``cma`` it sends nothing: the requester copies the blocks itself after ``ReadOk``
    (``cma``) and, when it sent expected hashes, ends with ``ReadCopied``. ``lease``: the
    handoff's lease the read is made under (``LeaseRef``), None for a read through the block
    index. ``copy_first`` (a ``cma`` read under a lease, with expected hashes in every group):
    the requester copies without waiting for ``ReadOk``; the holder vouches for a position
    only through the read's own lease, pins that lease until ``ReadCopied`` (or the deadline
    plus a grace) and sends no ``ReadDone`` (``cma_read``)."""

    transfer_id: TransferId
    request_id: Text
    tag_base: TagBase
    chunk_bytes: ChunkBytes
    deadline_ms: DeadlineMs
    groups: Annotated[list[GroupReadMsg], Meta(max_length=MAX_GROUPS)]
    cma: bool = False
    lease: LeaseRef | None = None
    copy_first: bool = False

    def __post_init__(self) -> None:
        total = sum(len(group.block_ids) for group in self.groups)
        if total > MAX_BLOCKS_PER_READ:
            raise ValueError(f"a read of {total} blocks exceeds {MAX_BLOCKS_PER_READ}")
        if self.copy_first and not (
            self.cma
            and self.lease is not None
            and all(group.expected_hashes is not None for group in self.groups)
        ):
            raise ValueError(
                "copy_first needs cma, a lease and expected hashes in every group (only the "
                "read's own lease vouches for the bytes it copies before the check)"
            )


class ReadOk(_Message):
    """The holder accepted a ``Read``; ``mismatched[i]``: positions of ``groups[i]`` refused (not
    sent); ``lease_pending``: the read's lease may yet be granted (else a refusal is final)."""

    transfer_id: TransferId
    mismatched: PositionsByEntry
    lease_pending: bool = False


class ReadCopied(_Message):
    """The requester finished copying a ``cma`` read that sent expected hashes; the holder
    re-checks the blocks it let through and answers ``ReadDone`` (a ``copy_first`` read: the
    holder unpins its lease and says nothing)."""

    transfer_id: TransferId


class ReadDone(_Message):
    """The holder's last word on a read that sent expected hashes, after its last chunk send
    completed (a ``cma`` read: after ``ReadCopied``). ``mismatched[i]`` lists positions in
    ``groups[i]`` that passed the check at ``ReadOk`` and were sent, but no longer carried the
    expected hash when re-checked right after their bytes were copied out (the holder evicted
    and reused the block meanwhile, so the bytes sent may be torn): the requester must treat
    those blocks as failed, never as landed."""

    transfer_id: TransferId
    mismatched: PositionsByEntry


class Cancel(_Message):
    """Stop a transfer. The requester has posted receives for chunks ``[0, num_chunks_posted)``;
    the holder completes each of those it never issued with an empty message, so no posted
    receive or issued send is left waiting on either side."""

    transfer_id: TransferId
    num_chunks_posted: NumChunks


class CancelOk(_Message):
    """The holder stopped a transfer after issuing ``num_chunks_issued`` chunk sends."""

    transfer_id: TransferId
    num_chunks_issued: NumChunks


class Heartbeat(_Message):
    """These request ids are still wanted (the holder's ``on_heartbeat``); ``tokens[i]`` is the
    lease token of ``request_ids[i]``'s ticket (tickets are capabilities: a lease is extended
    only by who presents its token). Empty ``tokens``: none presented."""

    request_ids: RequestIds
    tokens: RequestIds = []

    def __post_init__(self) -> None:
        if self.tokens and len(self.tokens) != len(self.request_ids):
            raise ValueError(
                f"{len(self.tokens)} tokens for {len(self.request_ids)} request_ids"
            )

    def token_of(self, index: int) -> str:
        """The token presented for ``request_ids[index]`` ("" when none)."""
        return self.tokens[index] if self.tokens else ""


class TransferDoneNotice(_Message, tag="TransferDone"):
    """A requester's completion notice for one request (success or failure), as sent and as the
    holder's ``on_transfer_done`` receives it; ``peer_engine_id`` is the requester's engine id,
    ``token`` the lease token of the request's ticket (a lease ends only for its token)."""

    peer_engine_id: Text
    request_id: Text
    success: bool
    reason: LongText
    token: Text = ""


def transfer_done_notice(*, reason: str, **fields: Any) -> TransferDoneNotice:
    """A ``TransferDoneNotice`` with ``reason`` clipped to ``MAX_TEXT_LEN`` (it may quote a
    peer's value). Raises ValueError for a request id or token over ``MAX_STR_LEN``."""
    for name in ("request_id", "token"):
        if len(fields.get(name, "")) > MAX_STR_LEN:
            raise ValueError(f"{name} over {MAX_STR_LEN} characters")
    return TransferDoneNotice(reason=clip_text(reason), **fields)


class ErrorMsg(_Message):
    """An error for one transfer (``transfer_id`` > 0) or for the connection (0)."""

    transfer_id: TransferIdOrZero
    code: ShortText
    message: LongText


Message = (
    Hello
    | AuthChallenge
    | AuthProof
    | HelloOk
    | Read
    | ReadOk
    | ReadCopied
    | ReadDone
    | Cancel
    | CancelOk
    | Heartbeat
    | TransferDoneNotice
    | ErrorMsg
)


class _Frame(msgspec.Struct):
    """What one frame's payload holds: the schema version and one message."""

    v: int
    msg: Message


class _Version(msgspec.Struct):
    """A frame read for its version alone (a frame that failed to decode may be of another)."""

    v: int


_ENCODER = msgspec.msgpack.Encoder()
_FRAME_DECODER = msgspec.msgpack.Decoder(_Frame)
_VERSION_DECODER = msgspec.msgpack.Decoder(_Version)


def encode_message(message: Message) -> bytearray:
    """One frame (length prefix + msgpack) for ``message``."""
    frame = bytearray(FRAME_HEADER.size)
    _ENCODER.encode_into(_Frame(v=WIRE_VERSION, msg=message), frame, FRAME_HEADER.size)
    FRAME_HEADER.pack_into(frame, 0, len(frame) - FRAME_HEADER.size)
    return frame


def decode_message(payload: bytes | bytearray | memoryview) -> Message:
    """Decode one frame's payload (without the length prefix).

    Raises:
        WireError: not msgpack; ``v`` missing or not ``WIRE_VERSION``; or a message of an
            unknown type, with a field missing, of the wrong type, out of range or too long, or
            inconsistent with another (the message names the field's path).
    """
    try:
        frame = _FRAME_DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        _refuse_other_version(payload)
        raise WireError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError(f"not a msgpack message: {exc}") from None
    if frame.v != WIRE_VERSION:
        raise _version_error(frame.v)
    return frame.msg


def _refuse_other_version(payload: bytes | bytearray | memoryview) -> None:
    """Raise the version error for a frame of another version (its message may not fit ours)."""
    try:
        version = _VERSION_DECODER.decode(payload).v
    except msgspec.DecodeError:
        return  # no readable version: the caller's error says what is wrong
    if version != WIRE_VERSION:
        raise _version_error(version)


def _version_error(version: int) -> WireError:
    return WireError(f"unknown schema version {version!r}, this node speaks {WIRE_VERSION}")


def frame_length(header: bytes) -> int:
    """Payload length from a 4-byte frame header.

    Raises:
        WireError: if the length is 0 or above ``MAX_FRAME_BYTES``.
    """
    (length,) = FRAME_HEADER.unpack(header)
    if not 0 < length <= MAX_FRAME_BYTES:
        raise WireError(f"frame length {length} is outside [1, {MAX_FRAME_BYTES}]")
    return length
