"""Bounds on everything a peer sends, as ``msgspec``-constrained types (``Annotated[..., Meta]``).

``wire`` and ``metadata`` annotate their fields with these, so decoding a control message checks
every type, range and length in one step (in C) and a refusal names the field's path, e.g.
``Expected `int` >= 0 - at `$.msg.groups[0].block_ids[3]```. The constraints apply to decoding
only: building a message or a ``NodeMetadata`` locally checks nothing (the requester checks its
own reads in ``plan.build_group_msgs``, raising ``ValueError``).

msgspec supports integer bounds within int64 only; an unbounded ``int`` still stops at
``2**64 - 1``, the largest integer msgpack carries.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

MAX_STR_LEN = 512
MAX_GROUPS = 64
MAX_LAYERS = 1 << 16
MAX_BLOCKS_PER_READ = 1 << 20
MAX_HASH_BYTES = 128
MAX_TEXT_LEN = 4096  # error messages, TransferDone reasons
MAX_REQUEST_IDS = 1 << 16  # per Heartbeat
MIN_CHUNK_BYTES = 1 << 12
MAX_CHUNK_BYTES = 1 << 30
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_KV_HEADS = 1 << 16
MAX_PULLERS = 1 << 12
"""Ranks of a tensor-parallel puller whose release notices together end one lease."""
MAX_TAG_BASE = (1 << 63) - 1 - MAX_BLOCKS_PER_READ
"""Chunk ``k`` of a read has UCX tag ``tag_base + k`` (``transfer.tag_base_for`` stays below
``2**62``); int64 is msgspec's bound limit."""

Text = Annotated[str, Meta(max_length=MAX_STR_LEN)]
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_STR_LEN)]
"""A request id that must name one (a lease's; ``Read.request_id`` is plain ``Text``)."""
ShortText = Annotated[str, Meta(max_length=64)]
LongText = Annotated[str, Meta(max_length=MAX_TEXT_LEN)]
WorkerAddress = Annotated[bytes, Meta(max_length=1 << 16)]
AuthBytes = Annotated[bytes, Meta(max_length=64)]  # a nonce or an HMAC-SHA256 proof
CompatHash = Annotated[str, Meta(min_length=64, max_length=64)]  # sha256, hex

TransferId = Annotated[int, Meta(ge=1)]
"""A read's id on its requester (``transfer.next_transfer_id``); 0 means "no transfer"."""
TransferIdOrZero = Annotated[int, Meta(ge=0)]
TagBase = Annotated[int, Meta(ge=0, le=MAX_TAG_BASE)]
ChunkBytes = Annotated[int, Meta(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)]
DeadlineMs = Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)]
GroupId = Annotated[int, Meta(ge=0, le=MAX_GROUPS - 1)]
BlockId = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]
"""A remote block id as sent; the holder checks it against its own ``num_blocks`` too."""
BlockIds = Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS_PER_READ)]
BlockHash = Annotated[bytes, Meta(max_length=MAX_HASH_BYTES)]
BlockHashes = Annotated[list[BlockHash], Meta(max_length=MAX_BLOCKS_PER_READ)]
Position = Annotated[int, Meta(ge=0, le=MAX_BLOCKS_PER_READ - 1)]
"""An index into one group entry's ``block_ids``."""
PositionsByEntry = Annotated[
    list[Annotated[list[Position], Meta(max_length=MAX_BLOCKS_PER_READ)]],
    Meta(max_length=MAX_GROUPS),
]
NumChunks = Annotated[int, Meta(ge=0, le=MAX_BLOCKS_PER_READ)]
RequestIds = Annotated[list[Text], Meta(max_length=MAX_REQUEST_IDS)]

Pid = Annotated[int, Meta(ge=1, le=(1 << 31) - 1)]
Address = Annotated[int, Meta(ge=1)]
"""A virtual address in the holder process (``cma``); at most ``2**64 - 1`` (msgpack)."""
AddressesByGroup = Annotated[
    list[Annotated[list[Address], Meta(max_length=MAX_LAYERS)]], Meta(max_length=MAX_GROUPS)
]
Probe = Annotated[bytes, Meta(min_length=1, max_length=64)]

NumLayers = Annotated[int, Meta(ge=1, le=MAX_LAYERS)]
NumBlocks = Annotated[int, Meta(ge=1, le=1 << 31)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
KVHeadIndex = Annotated[int, Meta(ge=0, le=MAX_KV_HEADS - 1)]
NumKVHeads = Annotated[int, Meta(ge=1, le=MAX_KV_HEADS)]
PullerRank = Annotated[int, Meta(ge=0, le=MAX_PULLERS - 1)]
NumPullers = Annotated[int, Meta(ge=1, le=MAX_PULLERS)]
BlockShape = Annotated[tuple[Annotated[int, Meta(ge=1, le=1 << 20)], ...], Meta(max_length=8)]
DtypeName = Literal[
    "float16", "bfloat16", "float32", "float64", "uint8", "int8", "float8_e4m3fn", "float8_e5m2"
]
"""KV dtypes a peer may announce (torch names without the ``torch.`` prefix)."""


def clip_text(text: str, max_len: int = MAX_TEXT_LEN) -> str:
    """``text`` cut to ``max_len`` characters (its end replaced by ``...``), so that free text
    built locally (an error message, a notice's reason, which may quote a peer's long value)
    always decodes on the peer."""
    return text if len(text) <= max_len else text[: max_len - 3] + "..."
