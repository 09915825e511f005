"""The control-message wire schema: msgpack maps with an explicit schema version.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. Every message is a
map ``{"v": WIRE_VERSION, "t": <type>, ...fields}``. ``decode_message`` checks the version, the
type and every field's type and range, and raises ``WireError`` naming the field; the server
answers with an ``ErrorMsg`` and keeps serving (DESIGN.md, "Reliability rules": everything that
arrives over the network is validated).

Requester -> holder: ``Hello``, ``Read``, ``ReadCopied``, ``Cancel``, ``Heartbeat``,
``TransferDone``.
Holder -> requester: ``HelloOk``, ``ReadOk``, ``ReadDone``, ``CancelOk``, ``ErrorMsg``.

Block bytes never travel in these messages; they go over UCX tag messages (``ucxx_transport``)
or, between processes on one host, by cross-memory attach (``cma``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import WireError
from .metadata import KVGroupLayout, NodeMetadata

WIRE_VERSION = 4
# 2: Cancel carries num_chunks_posted (filler sends, see ucxx_holder)
# 3: ReadDone (the holder's re-check of each block after its bytes left, see ``ReadDone``)
# 4: same-host reads: HelloOk.cma, Read.cma, ReadCopied (see ``cma``)
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 << 20
MAX_STR_LEN = 512
MAX_GROUPS = 64
MAX_BLOCKS_PER_READ = 1 << 20
MAX_HASH_BYTES = 128
MAX_U64 = (1 << 64) - 1
MIN_CHUNK_BYTES = 1 << 12
MAX_CHUNK_BYTES = 1 << 30
MAX_DEADLINE_MS = 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupReadMsg:
    """One group's part of a ``Read``: remote block ids and, optionally, their expected hashes."""

    group_id: int
    block_ids: list[int]
    expected_hashes: list[bytes] | None


@dataclass(frozen=True, kw_only=True, slots=True)
class CmaOffer:
    """What a holder on host memory tells requesters at handshake (``HelloOk.cma``).

    Attributes:
        host_id: the holder's boot id; a requester on another boot (another host) ignores it.
        pid: the holder's process id (in the holder's pid namespace).
        probe_address, probe: a live 16-byte buffer in the holder and its content.
        regions: ``[group][layer]`` address of each KV tensor's first byte
            (``[num_blocks, *block_shape]``, contiguous, as ``NodeMetadata`` describes).
    """

    host_id: str
    pid: int
    probe_address: int
    probe: bytes
    regions: list[list[int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Hello:
    metadata: NodeMetadata
    worker_address: bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class HelloOk:
    """The holder's answer to a compatible ``Hello``; ``cma`` is its same-host offer, None
    when its KV tensors are not in host memory (``cma``)."""

    metadata: NodeMetadata
    worker_address: bytes
    cma: CmaOffer | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Read:
    """Pull request. The holder sends chunk ``k`` of the plan with UCX tag ``tag_base + k``;
    with ``cma`` it sends nothing: the requester copies the blocks itself after ``ReadOk``
    (``cma``) and, when it sent expected hashes, ends with ``ReadCopied``."""

    transfer_id: int
    request_id: str
    tag_base: int
    chunk_bytes: int
    deadline_ms: int
    groups: list[GroupReadMsg]
    cma: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadOk:
    """The holder accepted a ``Read``; ``mismatched[i]`` lists positions in ``groups[i]`` whose
    block no longer carries the expected hash (not sent)."""

    transfer_id: int
    mismatched: list[list[int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadCopied:
    """The requester finished copying a ``cma`` read that sent expected hashes; the holder
    re-checks the blocks it let through and answers ``ReadDone``."""

    transfer_id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadDone:
    """The holder's last word on a read that sent expected hashes, after its last chunk send
    completed (a ``cma`` read: after ``ReadCopied``). ``mismatched[i]`` lists positions in
    ``groups[i]`` that passed the check at ``ReadOk`` and were sent, but no longer carried the
    expected hash when re-checked right after their bytes were copied out (the holder evicted
    and reused the block meanwhile, so the bytes sent may be torn): the requester must treat
    those blocks as failed, never as landed."""

    transfer_id: int
    mismatched: list[list[int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cancel:
    """Stop a transfer. The requester has posted receives for chunks ``[0, num_chunks_posted)``;
    the holder completes each of those it never issued with an empty message, so no posted
    receive or issued send is left waiting on either side."""

    transfer_id: int
    num_chunks_posted: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CancelOk:
    """The holder stopped a transfer after issuing ``num_chunks_issued`` chunk sends."""

    transfer_id: int
    num_chunks_issued: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    request_ids: list[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferDone:
    request_id: str
    success: bool
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorMsg:
    """An error for one transfer (``transfer_id`` > 0) or for the connection (0)."""

    transfer_id: int
    code: str
    message: str


Message = (
    Hello
    | HelloOk
    | Read
    | ReadOk
    | ReadCopied
    | ReadDone
    | Cancel
    | CancelOk
    | Heartbeat
    | TransferDone
    | ErrorMsg
)


# ----------------------------------------------------------------------------- field checks


def _get(obj: dict[Any, Any], name: str) -> Any:
    if name not in obj:
        raise WireError(f"missing field {name!r}")
    return obj[name]


def _int(obj: dict[Any, Any], name: str, lo: int, hi: int) -> int:
    value = _get(obj, name)
    if type(value) is not int:
        raise WireError(f"field {name!r} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireError(f"field {name!r} = {value} is outside [{lo}, {hi}]")
    return value


def _str(obj: dict[Any, Any], name: str, max_len: int = MAX_STR_LEN) -> str:
    value = _get(obj, name)
    if type(value) is not str:
        raise WireError(f"field {name!r} must be a str, got {type(value).__name__}")
    if len(value) > max_len:
        raise WireError(f"field {name!r} is {len(value)} characters, at most {max_len} allowed")
    return value


def _bytes(obj: dict[Any, Any], name: str, max_len: int) -> bytes:
    value = _get(obj, name)
    if type(value) is not bytes:
        raise WireError(f"field {name!r} must be bytes, got {type(value).__name__}")
    if len(value) > max_len:
        raise WireError(f"field {name!r} is {len(value)} bytes, at most {max_len} allowed")
    return value


def _bool(obj: dict[Any, Any], name: str) -> bool:
    value = _get(obj, name)
    if type(value) is not bool:
        raise WireError(f"field {name!r} must be a bool, got {type(value).__name__}")
    return value


def _list(obj: dict[Any, Any], name: str, max_len: int) -> list[Any]:
    value = _get(obj, name)
    if type(value) is not list:
        raise WireError(f"field {name!r} must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise WireError(f"field {name!r} has {len(value)} items, at most {max_len} allowed")
    return value


def _map(value: Any, name: str) -> dict[Any, Any]:
    if type(value) is not dict:
        raise WireError(f"{name} must be a map, got {type(value).__name__}")
    return value


def _int_list(obj: dict[Any, Any], name: str, lo: int, hi: int, max_len: int) -> list[int]:
    values = _list(obj, name, max_len)
    # fast path in C for the usual case (thousands of block ids); the slow one names the culprit
    if values and set(map(type, values)) == {int} and min(values) >= lo and max(values) <= hi:
        return values
    for i, value in enumerate(values):
        if type(value) is not int or not lo <= value <= hi:
            raise WireError(f"field {name!r}[{i}] = {value!r} is not an int in [{lo}, {hi}]")
    return values


# ----------------------------------------------------------------------------- metadata


def _metadata_to_wire(metadata: NodeMetadata) -> dict[str, Any]:
    return {
        "engine_id": metadata.engine_id,
        "incarnation": metadata.incarnation,
        "model_name": metadata.model_name,
        "dtype": metadata.dtype,
        "block_size": metadata.block_size,
        "hash_fn_name": metadata.hash_fn_name,
        "kv_layout": metadata.kv_layout,
        "compat_hash": metadata.compat_hash,
        "groups": [
            {
                "num_layers": g.num_layers,
                "num_blocks": g.num_blocks,
                "block_shape": list(g.block_shape),
                "dtype": g.dtype,
            }
            for g in metadata.groups
        ],
    }


_DTYPE_NAMES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "uint8", "int8", "float8_e4m3fn", "float8_e5m2"}
)


def _dtype(obj: dict[Any, Any], name: str) -> str:
    value = _str(obj, name, 32)
    if value not in _DTYPE_NAMES:
        raise WireError(f"field {name!r} = {value!r} is not a known dtype")
    return value


def _metadata_from_wire(value: Any) -> NodeMetadata:
    obj = _map(value, "metadata")
    groups = []
    for i, raw in enumerate(_list(obj, "groups", MAX_GROUPS)):
        group = _map(raw, f"groups[{i}]")
        groups.append(
            KVGroupLayout(
                num_layers=_int(group, "num_layers", 1, 1 << 16),
                num_blocks=_int(group, "num_blocks", 1, 1 << 31),
                block_shape=tuple(_int_list(group, "block_shape", 1, 1 << 20, 8)),
                dtype=_dtype(group, "dtype"),
            )
        )
    if not groups:
        raise WireError("field 'groups' is empty")
    metadata = NodeMetadata(
        engine_id=_str(obj, "engine_id"),
        incarnation=_str(obj, "incarnation"),
        model_name=_str(obj, "model_name"),
        dtype=_dtype(obj, "dtype"),
        block_size=_int(obj, "block_size", 1, 1 << 20),
        hash_fn_name=_str(obj, "hash_fn_name", 64),
        kv_layout=_str(obj, "kv_layout"),
        groups=tuple(groups),
    )
    if _str(obj, "compat_hash", 64) != metadata.compat_hash:
        raise WireError("field 'compat_hash' does not match the metadata fields it covers")
    return metadata


def _cma_offer(value: Any, metadata: NodeMetadata) -> CmaOffer | None:
    """``HelloOk.cma``: None, or an offer with one region address per layer of each group."""
    if value is None:
        return None
    obj = _map(value, "cma")
    regions = _list(obj, "regions", MAX_GROUPS)
    if len(regions) != len(metadata.groups):
        raise WireError(
            f"field 'regions' has {len(regions)} groups, metadata {len(metadata.groups)}"
        )
    for group_id, (addresses, layout) in enumerate(zip(regions, metadata.groups, strict=True)):
        if type(addresses) is not list or len(addresses) != layout.num_layers:
            raise WireError(f"field 'regions'[{group_id}] must list {layout.num_layers} addresses")
        for address in addresses:
            if type(address) is not int or not 0 < address <= MAX_U64:
                raise WireError(f"field 'regions'[{group_id}] holds a bad address {address!r}")
    probe = _bytes(obj, "probe", 64)
    if not probe:
        raise WireError("field 'probe' is empty")
    return CmaOffer(
        host_id=_str(obj, "host_id", 64),
        pid=_int(obj, "pid", 1, (1 << 31) - 1),
        probe_address=_int(obj, "probe_address", 1, MAX_U64),
        probe=probe,
        regions=regions,
    )


# ----------------------------------------------------------------------------- encode / decode


def encode_message(message: Message) -> bytes:
    """One frame (length prefix + msgpack) for ``message``."""
    body: dict[str, Any]
    if isinstance(message, Hello):
        body = {
            "metadata": _metadata_to_wire(message.metadata),
            "worker_address": message.worker_address,
        }
    elif isinstance(message, HelloOk):
        cma = message.cma
        body = {
            "metadata": _metadata_to_wire(message.metadata),
            "worker_address": message.worker_address,
            "cma": None if cma is None else {name: getattr(cma, name) for name in cma.__slots__},
        }
    elif isinstance(message, Read):
        body = {
            "transfer_id": message.transfer_id,
            "request_id": message.request_id,
            "tag_base": message.tag_base,
            "chunk_bytes": message.chunk_bytes,
            "deadline_ms": message.deadline_ms,
            "cma": message.cma,
            "groups": [
                {
                    "group_id": g.group_id,
                    "block_ids": g.block_ids,
                    "expected_hashes": g.expected_hashes,
                }
                for g in message.groups
            ],
        }
    else:
        body = {name: getattr(message, name) for name in message.__slots__}
    payload = msgpack.packb({"v": WIRE_VERSION, "t": type(message).__name__, **body})
    return FRAME_HEADER.pack(len(payload)) + payload


def _decode_read(obj: dict[Any, Any]) -> Read:
    groups = []
    total_blocks = 0
    for i, raw in enumerate(_list(obj, "groups", MAX_GROUPS)):
        group = _map(raw, f"groups[{i}]")
        block_ids = _int_list(group, "block_ids", 0, (1 << 31) - 1, MAX_BLOCKS_PER_READ)
        total_blocks += len(block_ids)
        expected_hashes = None
        if _get(group, "expected_hashes") is not None:
            hashes = _list(group, "expected_hashes", MAX_BLOCKS_PER_READ)
            for j, h in enumerate(hashes):
                if type(h) is not bytes or len(h) > MAX_HASH_BYTES:
                    raise WireError(
                        f"field 'expected_hashes'[{j}] must be bytes of <= {MAX_HASH_BYTES}"
                    )
            if len(hashes) != len(block_ids):
                raise WireError(
                    f"groups[{i}]: {len(hashes)} expected_hashes for {len(block_ids)} block_ids"
                )
            expected_hashes = hashes
        groups.append(
            GroupReadMsg(
                group_id=_int(group, "group_id", 0, MAX_GROUPS - 1),
                block_ids=block_ids,
                expected_hashes=expected_hashes,
            )
        )
    if total_blocks > MAX_BLOCKS_PER_READ:
        raise WireError(f"a read of {total_blocks} blocks exceeds {MAX_BLOCKS_PER_READ}")
    return Read(
        transfer_id=_int(obj, "transfer_id", 1, MAX_U64),
        request_id=_str(obj, "request_id"),
        tag_base=_int(obj, "tag_base", 0, MAX_U64 - MAX_BLOCKS_PER_READ),
        chunk_bytes=_int(obj, "chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES),
        deadline_ms=_int(obj, "deadline_ms", 1, MAX_DEADLINE_MS),
        groups=groups,
        cma=_bool(obj, "cma"),
    )


def _positions(obj: dict[Any, Any]) -> list[list[int]]:
    """``mismatched`` of ``ReadOk`` / ``ReadDone``: per group entry, block positions."""
    mismatched = _list(obj, "mismatched", MAX_GROUPS)
    for i, positions in enumerate(mismatched):
        if type(positions) is not list or not all(
            type(p) is int and 0 <= p < MAX_BLOCKS_PER_READ for p in positions
        ):
            raise WireError(f"field 'mismatched'[{i}] must be a list of block positions")
    return mismatched


def _decode_body(kind: str, obj: dict[Any, Any]) -> Message:
    if kind == "Hello":
        return Hello(
            metadata=_metadata_from_wire(_get(obj, "metadata")),
            worker_address=_bytes(obj, "worker_address", 1 << 16),
        )
    if kind == "HelloOk":
        metadata = _metadata_from_wire(_get(obj, "metadata"))
        return HelloOk(
            metadata=metadata,
            worker_address=_bytes(obj, "worker_address", 1 << 16),
            cma=_cma_offer(_get(obj, "cma"), metadata),
        )
    if kind == "Read":
        return _decode_read(obj)
    if kind == "ReadOk":
        return ReadOk(transfer_id=_int(obj, "transfer_id", 1, MAX_U64), mismatched=_positions(obj))
    if kind == "ReadCopied":
        return ReadCopied(transfer_id=_int(obj, "transfer_id", 1, MAX_U64))
    if kind == "ReadDone":
        return ReadDone(
            transfer_id=_int(obj, "transfer_id", 1, MAX_U64), mismatched=_positions(obj)
        )
    if kind == "Cancel":
        return Cancel(
            transfer_id=_int(obj, "transfer_id", 1, MAX_U64),
            num_chunks_posted=_int(obj, "num_chunks_posted", 0, MAX_BLOCKS_PER_READ),
        )
    if kind == "CancelOk":
        return CancelOk(
            transfer_id=_int(obj, "transfer_id", 1, MAX_U64),
            num_chunks_issued=_int(obj, "num_chunks_issued", 0, MAX_BLOCKS_PER_READ),
        )
    if kind == "Heartbeat":
        request_ids = _list(obj, "request_ids", 1 << 16)
        for i, request_id in enumerate(request_ids):
            if type(request_id) is not str or len(request_id) > MAX_STR_LEN:
                raise WireError(f"field 'request_ids'[{i}] must be a str of <= {MAX_STR_LEN}")
        return Heartbeat(request_ids=request_ids)
    if kind == "TransferDone":
        return TransferDone(
            request_id=_str(obj, "request_id"),
            success=_bool(obj, "success"),
            reason=_str(obj, "reason", 4096),
        )
    if kind == "ErrorMsg":
        return ErrorMsg(
            transfer_id=_int(obj, "transfer_id", 0, MAX_U64),
            code=_str(obj, "code", 64),
            message=_str(obj, "message", 4096),
        )
    raise WireError(f"unknown message type {kind!r}")


def decode_message(payload: bytes) -> Message:
    """Decode one frame's payload (without the length prefix).

    Raises:
        WireError: not msgpack, not a map, ``v`` != ``WIRE_VERSION``, unknown ``t``, or a field
            of the wrong type or range (the message names it).
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not a msgpack message: {exc}") from None
    obj = _map(obj, "message")
    version = _get(obj, "v")
    if version != WIRE_VERSION:
        raise WireError(f"unknown schema version {version!r}, this node speaks {WIRE_VERSION}")
    return _decode_body(_str(obj, "t", 32), obj)


def frame_length(header: bytes) -> int:
    """Payload length from a 4-byte frame header.

    Raises:
        WireError: if the length is 0 or above ``MAX_FRAME_BYTES``.
    """
    (length,) = FRAME_HEADER.unpack(header)
    if not 0 < length <= MAX_FRAME_BYTES:
        raise WireError(f"frame length {length} is outside [1, {MAX_FRAME_BYTES}]")
    return length
