"""Wire schema of the store tier's write path (issue 7, part 1): msgpack frames, version 1.

One frame::

    | header_nbytes: u32 big-endian | header: msgpack map | payload: "payload_nbytes" bytes |

Messages (every header carries ``"v": STORE_SCHEMA_VERSION`` and ``"type"``):

- ``hello`` (writer -> store, first on each connection): ``profile`` (bytes, the writer's
  ``StoreProfile`` as msgpack: its block identity, KV geometry and ``kv_heads_layout``), no
  payload. The store sends the connection's puts to its shelf of that profile, opened for the
  first writer of it (``StoreNode.hello``); a store that cannot open one more answers ``error``
  naming both profiles. ``hello_ok`` (store -> writer): ``incarnation``. A writer that sends no
  hello is held to the shelf of its puts' ``compat_hash`` (refused by a store that has none).
- ``put`` (writer -> store): ``compat_hash`` (str, the writer's ``NodeMetadata.compat_hash``: the
  store refuses another block identity, e.g. another model revision or KV cache dtype, or KV
  geometry) and ``groups``, a list
  of ``{"group_id", "block_hashes", "parent_hashes", "nbytes"}``. ``parent_hashes[i]`` is the hash
  that precedes ``block_hashes[i]`` in its chain (``b""`` for a request's first block). The
  payload is the groups' bytes back to back; group ``k``'s ``nbytes`` bytes are the
  ``gather_blocks`` staging layout ``[num_layers, n, 2, block_size, num_kv_heads, head_size]``
  for its ``n`` hashes (kvbridge.kernels.layout), so its size must be exactly
  ``n * num_layers * block_nbytes`` of that group on the store. Optional ``heads``
  (``[start, stop]``, the model's KV heads): the put carries only those heads of each block (a
  tensor-parallel rank's; ``num_kv_heads`` of the staging layout is then ``stop - start`` and
  the size scales with it); absent: every head. The store holds a block once every head of it
  was written (``StoreCache``, "Blocks written in slices").
- ``put_ok`` (store -> writer): ``num_stored`` (blocks, or a ``heads`` put's slices, written),
  ``num_present`` (already held: touched, not rewritten; for a ``heads`` put, those heads of
  the block already written), ``num_incomplete`` (blocks of the put still lacking other heads;
  may be absent), ``num_refused`` (no room: every cold block is still being served), ``refused``
  (``[[group_id, block_hash], ...]``), ``missing_ancestors`` (``[[group_id, block_hash], ...]``:
  for the put's blocks the store holds but cannot publish, the first ancestor it does not hold,
  which breaks their chain back to block 0: a block it evicted since, or one never written; may
  be absent: an older store sends none), no payload.
- ``error`` (store -> writer): ``error`` (str naming the bad field), no payload. The store keeps
  serving; after an error about framing it closes that one connection (the stream is lost).

Every field is type-, range- and size-checked here; a bad one raises ``StoreWireError`` naming it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import KVConnectorError
from .profile import StoreProfile

__all__ = [
    "FRAME_HEADER",
    "MAX_HEADER_BYTES",
    "STORE_SCHEMA_VERSION",
    "PutGroup",
    "PutReply",
    "PutRequest",
    "StoreRefusedError",
    "StoreWireError",
    "check_reply",
    "decode_header",
    "decode_hello",
    "decode_hello_reply",
    "decode_put",
    "decode_reply",
    "encode_error",
    "encode_hello",
    "encode_hello_ok",
    "encode_put_header",
    "encode_reply",
]

STORE_SCHEMA_VERSION = 1
FRAME_HEADER = struct.Struct(">I")
MAX_HEADER_BYTES = 8 << 20
MAX_GROUPS = 64
MAX_BLOCKS_PER_PUT = 1 << 16
MAX_HASH_BYTES = 128
MAX_ERROR_LEN = 2048
MAX_INCARNATION = (1 << 63) - 1
MAX_PROFILE_BYTES = 64 << 10
MAX_KV_HEADS = 1 << 16


class StoreWireError(KVConnectorError):
    """A store message that cannot be honoured: bad framing, schema version or field (named)."""


class StoreRefusedError(StoreWireError):
    """The store refused this writer's hello: another block geometry (its message names both
    profiles), or a store that cannot take it. Every write to that store fails the same way."""


@dataclass(frozen=True, slots=True)
class PutGroup:
    """One KV cache group's part of a put: ``len(block_hashes) == len(parent_hashes)`` blocks
    whose bytes are ``nbytes`` of the payload (staging layout)."""

    group_id: int
    block_hashes: tuple[bytes, ...]
    parent_hashes: tuple[bytes, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class PutRequest:
    """``heads``: the model's KV heads ``(start, stop)`` the payload holds of each block (a
    tensor-parallel rank's); None: every head."""

    compat_hash: str
    groups: tuple[PutGroup, ...]
    heads: tuple[int, int] | None = None

    @property
    def payload_nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


@dataclass(frozen=True, slots=True)
class PutReply:
    num_stored: int
    num_present: int
    num_refused: int
    refused: tuple[tuple[int, bytes], ...] = ()
    missing_ancestors: tuple[tuple[int, bytes], ...] = ()
    store_incarnation: int = 0  # the answering store's; 0: a store that does not say
    num_incomplete: int = 0  # blocks of the put still lacking other heads (a ``heads`` put)


# ---------------------------------------------------------------------- field checks
def _int(obj: dict[Any, Any], name: str, lo: int, hi: int) -> int:
    value = obj.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise StoreWireError(f"field {name!r} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _str(obj: dict[Any, Any], name: str, max_len: int) -> str:
    value = obj.get(name)
    if type(value) is not str or len(value) > max_len:
        raise StoreWireError(f"field {name!r} must be a str of <= {max_len} chars")
    return value


def _hashes(obj: dict[Any, Any], name: str, *, allow_empty: bool) -> tuple[bytes, ...]:
    value = obj.get(name)
    if type(value) is not list or len(value) > MAX_BLOCKS_PER_PUT:
        raise StoreWireError(f"field {name!r} must be a list of <= {MAX_BLOCKS_PER_PUT} hashes")
    lo = 0 if allow_empty else 1
    for i, h in enumerate(value):
        if type(h) is not bytes or not lo <= len(h) <= MAX_HASH_BYTES:
            raise StoreWireError(f"field {name!r}[{i}] must be bytes of {lo}..{MAX_HASH_BYTES}")
    return tuple(value)


def decode_header(raw: bytes) -> dict[Any, Any]:
    """A frame header as a dict with a known schema version and a str ``type``."""
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise StoreWireError(f"header is not msgpack: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise StoreWireError(f"header must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != STORE_SCHEMA_VERSION:
        raise StoreWireError(
            f"schema version {version!r} unsupported (this store speaks {STORE_SCHEMA_VERSION})"
        )
    _str(obj, "type", 32)
    return obj


def decode_put(obj: dict[Any, Any], *, max_payload_nbytes: int) -> PutRequest:
    """Validate a ``put`` header. Raises StoreWireError naming the first bad field."""
    if obj["type"] != "put":
        raise StoreWireError(f"unknown message type {obj['type']!r} (expected 'put')")
    compat_hash = _str(obj, "compat_hash", 128)
    raw_groups = obj.get("groups")
    if type(raw_groups) is not list or not 1 <= len(raw_groups) <= MAX_GROUPS:
        raise StoreWireError(f"field 'groups' must be a list of 1..{MAX_GROUPS} maps")
    groups: list[PutGroup] = []
    for i, raw in enumerate(raw_groups):
        if not isinstance(raw, dict):
            raise StoreWireError(f"groups[{i}] must be a map")
        hashes = _hashes(raw, "block_hashes", allow_empty=False)
        parents = _hashes(raw, "parent_hashes", allow_empty=True)
        if len(parents) != len(hashes):
            raise StoreWireError(
                f"groups[{i}]: {len(hashes)} block_hashes but {len(parents)} parent_hashes"
            )
        groups.append(
            PutGroup(
                group_id=_int(raw, "group_id", 0, MAX_GROUPS - 1),
                block_hashes=hashes,
                parent_hashes=parents,
                nbytes=_int(raw, "nbytes", 0, max_payload_nbytes),
            )
        )
    put = PutRequest(compat_hash=compat_hash, groups=tuple(groups), heads=_heads(obj))
    declared = _int(obj, "payload_nbytes", 0, max_payload_nbytes)
    if declared != put.payload_nbytes:
        raise StoreWireError(
            f"payload_nbytes {declared} != sum of groups' nbytes {put.payload_nbytes}"
        )
    return put


def _heads(obj: dict[Any, Any]) -> tuple[int, int] | None:
    """A put's optional ``heads``: ``[start, stop]`` with ``0 <= start < stop``."""
    value = obj.get("heads")
    if value is None:
        return None
    if (type(value) is not list or len(value) != 2 or any(type(v) is not int for v in value)
            or not 0 <= value[0] < value[1] <= MAX_KV_HEADS):
        raise StoreWireError(f"field 'heads' must be [start, stop] with 0 <= start < stop <= "
                             f"{MAX_KV_HEADS}, got {value!r}")
    return value[0], value[1]


def decode_hello(obj: dict[Any, Any]) -> StoreProfile:
    """A writer's ``hello``: its profile. Raises StoreWireError naming the bad field."""
    raw = obj.get("profile")
    if type(raw) is not bytes or len(raw) > MAX_PROFILE_BYTES:
        raise StoreWireError(f"field 'profile' must be bytes of <= {MAX_PROFILE_BYTES}")
    try:
        return StoreProfile.from_msgpack(raw)
    except ValueError as exc:
        raise StoreWireError(f"field 'profile': {exc}") from None


def decode_hello_reply(obj: dict[Any, Any]) -> int:
    """The store's answer to a hello: its incarnation. Raises StoreRefusedError with the
    store's message for an ``error``, StoreWireError for anything else."""
    if obj["type"] == "error":
        raise StoreRefusedError(f"the store refused this writer: "
                                f"{_str(obj, 'error', MAX_ERROR_LEN)}")
    if obj["type"] != "hello_ok":
        raise StoreWireError(f"unknown reply type {obj['type']!r} to a hello")
    return _int(obj, "incarnation", 0, MAX_INCARNATION)


def decode_reply(obj: dict[Any, Any]) -> PutReply:
    """A store's reply; an ``error`` reply raises StoreWireError with the store's message."""
    if obj["type"] == "error":
        raise StoreWireError(f"store refused the put: {_str(obj, 'error', MAX_ERROR_LEN)}")
    if obj["type"] != "put_ok":
        raise StoreWireError(f"unknown reply type {obj['type']!r}")
    top = MAX_BLOCKS_PER_PUT * MAX_GROUPS
    return PutReply(
        num_stored=_int(obj, "num_stored", 0, top),
        num_present=_int(obj, "num_present", 0, top),
        num_refused=_int(obj, "num_refused", 0, top),
        refused=_block_keys(obj.get("refused"), "refused"),
        missing_ancestors=_block_keys(obj.get("missing_ancestors", []), "missing_ancestors"),
        store_incarnation=_int(obj, "incarnation", 0, MAX_INCARNATION) if "incarnation" in obj
        else 0,
        num_incomplete=_int(obj, "num_incomplete", 0, top) if "num_incomplete" in obj else 0,
    )


def check_reply(put: PutRequest, reply: PutReply) -> None:
    """Raise StoreWireError when ``reply`` cannot be the answer to ``put``: it refuses a block
    the put did not send, names more missing ancestors than the put has blocks (at most one a
    block), or names one in a group the put did not write. A store's names make the writer's
    planner write blocks again, so a faulty store must not pick them freely."""
    keys = {(g.group_id, h) for g in put.groups for h in g.block_hashes}
    stray = sum(key not in keys for key in reply.refused)
    if stray:
        raise StoreWireError(f"the reply refuses {stray} block(s) the put did not send")
    num_blocks = sum(len(g.block_hashes) for g in put.groups)
    if len(reply.missing_ancestors) > num_blocks:
        raise StoreWireError(
            f"the reply names {len(reply.missing_ancestors)} missing ancestors for a put of "
            f"{num_blocks} block(s)"
        )
    groups = {g.group_id for g in put.groups}
    if any(group_id not in groups for group_id, _ in reply.missing_ancestors):
        raise StoreWireError("the reply names a missing ancestor in a group the put did not write")


def _block_keys(raw: Any, name: str) -> tuple[tuple[int, bytes], ...]:
    """A reply's list of ``[group_id, block_hash]`` pairs, checked."""
    if type(raw) is not list or len(raw) > MAX_BLOCKS_PER_PUT * MAX_GROUPS:
        raise StoreWireError(f"field {name!r} must be a list")
    keys: list[tuple[int, bytes]] = []
    for item in raw:
        if (
            type(item) is not list
            or len(item) != 2
            or type(item[0]) is not int
            or not 0 <= item[0] < MAX_GROUPS
            or type(item[1]) is not bytes
            or not 0 < len(item[1]) <= MAX_HASH_BYTES
        ):
            raise StoreWireError(f"field {name!r} must hold [group_id, block_hash] pairs")
        keys.append((item[0], item[1]))
    return tuple(keys)


# ---------------------------------------------------------------------- encoders
def _frame(header: dict[str, Any]) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return FRAME_HEADER.pack(len(raw)) + raw


def encode_put_header(put: PutRequest) -> bytes:
    """Length prefix and header of a put; the caller sends ``put.payload_nbytes`` bytes next."""
    header: dict[str, Any] = {
        "v": STORE_SCHEMA_VERSION,
        "type": "put",
        "compat_hash": put.compat_hash,
        "payload_nbytes": put.payload_nbytes,
        "groups": [
            {
                "group_id": g.group_id,
                "block_hashes": list(g.block_hashes),
                "parent_hashes": list(g.parent_hashes),
                "nbytes": g.nbytes,
            }
            for g in put.groups
        ],
    }
    if put.heads is not None:
        header["heads"] = list(put.heads)
    return _frame(header)


def encode_hello(profile: StoreProfile) -> bytes:
    return _frame({"v": STORE_SCHEMA_VERSION, "type": "hello", "profile": profile.to_msgpack()})


def encode_hello_ok(incarnation: int) -> bytes:
    return _frame({"v": STORE_SCHEMA_VERSION, "type": "hello_ok", "incarnation": incarnation})


def encode_reply(reply: PutReply) -> bytes:
    return _frame(
        {
            "v": STORE_SCHEMA_VERSION,
            "type": "put_ok",
            "num_stored": reply.num_stored,
            "num_present": reply.num_present,
            "num_refused": reply.num_refused,
            "refused": [[g, h] for g, h in reply.refused],
            "missing_ancestors": [[g, h] for g, h in reply.missing_ancestors],
            "incarnation": reply.store_incarnation,
            "num_incomplete": reply.num_incomplete,
        }
    )


def encode_error(message: str) -> bytes:
    return _frame({"v": STORE_SCHEMA_VERSION, "type": "error", "error": message[:MAX_ERROR_LEN]})
