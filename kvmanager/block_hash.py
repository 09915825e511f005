"""Chained block hashes: the identity of a full block of tokens for prefix caching.

A block's hash covers its parent's hash, its token ids and the extra keys of every input that
changes its K/V (LoRA adapter, multimodal items, cache salt, prompt embeddings), so two blocks
match only when everything before and inside them matches (seed 001, section 1;
vllm/v1/core/kv_cache_utils.py ``hash_block_tokens``)::

    h0 = H((ROOT, u32le(t0..t15),  extra0))
    h1 = H((h0,   u32le(t16..t31), extra1))

Hashes are computed over canonical CBOR (or msgpack for ``"sha256"``) of plain tuples, token ids
packed as little-endian uint32 bytes (``pack_token_ids``), so they are identical in every process
and on every node; the root hash comes from a fixed seed, never from
``PYTHONHASHSEED`` or ``os.urandom``. Extra keys are tagged tuples so that domains never collide:
``("lora", name)``, ``("mm", identifier, offset_in_block)``, ``("cache_salt", salt)`` (first
block only; the chain carries it on), ``("prompt_embeds", sha256 digest of the block's rows)``.

The prefix-cache key is the block hash plus the KV cache group id appended as 4 big-endian bytes
(``make_block_hash_with_group_id``).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias

import cbor2
import msgpack
import xxhash

__all__ = [
    "HASH_FN_NAMES",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "HashFn",
    "HashableRequest",
    "MultiModalSpan",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "get_root_hash",
    "hash_block_tokens",
    "make_block_hash_with_group_id",
    "pack_token_ids",
]

BlockHash: TypeAlias = bytes
"""Digest of one full block (32 bytes for sha256, 16 for xxh3_128)."""

BlockHashWithGroupId: TypeAlias = bytes
"""``block_hash + group_id.to_bytes(4, "big")``: the key of ``cached_block_hash_to_block``."""

HashFn: TypeAlias = Callable[[Any], bytes]
"""Maps a tuple of plain values (ints, str, bytes, None, tuples) to a digest."""


class MultiModalSpan(Protocol):
    """One multimodal item's place in the prompt, as the hasher reads it."""

    @property
    def identifier(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


class HashableRequest(Protocol):
    """What the block hasher reads of a request (``kvmanager.request.Request`` is one).

    Attributes read, never written: ``all_token_ids`` (prompt then output tokens),
    ``block_hashes`` (hashes made so far; the hasher returns only new ones), ``lora_name``,
    ``cache_salt``, ``mm_features`` and ``prompt_embeds`` (the inputs that enter extra keys).
    A protocol, so that this module needs nothing of the request module.
    """

    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def mm_features(self) -> Sequence[MultiModalSpan]: ...
    @property
    def prompt_embeds(self) -> Any: ...

    def prompt_embeds_digest(self, start_token_idx: int, end_token_idx: int) -> bytes | None: ...

_GROUP_ID_BYTES = 4
_ROOT_SEED = "kvbridge-root-v1"
_TOKEN_BYTES = 4
if array.array("I").itemsize != _TOKEN_BYTES:  # pragma: no cover - every CPython target has it
    raise ImportError("kvbridge needs a 4-byte C unsigned int for token packing")


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, 4 bytes each: the form in which tokens are hashed.

    ValueError if an id is negative or >= 2**32 (token ids are vocabulary indices).
    """
    try:
        packed = array.array("I", token_ids)
    except OverflowError:
        bad = next(t for t in token_ids if not 0 <= t < 2**32)
        raise ValueError(f"token id {bad} is outside [0, 2**32)") from None
    if sys.byteorder != "little":  # pragma: no cover - little-endian hosts only in CI
        packed.byteswap()
    return packed.tobytes()


def _cbor_head(major_type: int, value: int) -> bytes:
    """Shortest CBOR head (RFC 8949 preferred serialization) for ``value`` < 2**32."""
    top = major_type << 5
    if value < 24:
        return bytes((top | value,))
    if value < 0x100:
        return bytes((top | 24, value))
    if value < 0x10000:
        return bytes((top | 25,)) + value.to_bytes(2, "big")
    return bytes((top | 26,)) + value.to_bytes(4, "big")


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_msgpack(obj: Any) -> bytes:
    return hashlib.sha256(msgpack.packb(obj, use_bin_type=True)).digest()


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def _sha256_bytes(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


# Hash functions over canonical CBOR, by the digest they apply to the encoded bytes: for these
# the request hasher writes the CBOR bytes itself (same bytes as cbor2, without a call per block).
_CBOR_PAYLOAD_DIGESTS: dict[HashFn, Callable[[bytes], bytes]] = {
    _sha256_cbor: _sha256_bytes,
    _xxhash_cbor: xxhash.xxh3_128_digest,
}

_HASH_FNS: dict[str, HashFn] = {
    "sha256_cbor": _sha256_cbor,
    "sha256": _sha256_msgpack,
    "xxhash_cbor": _xxhash_cbor,
}
HASH_FN_NAMES: tuple[str, ...] = tuple(_HASH_FNS)
_FN_TO_NAME: dict[HashFn, str] = {fn: name for name, fn in _HASH_FNS.items()}
_ROOT_HASHES: dict[HashFn, BlockHash] = {}


def get_hash_fn_by_name(name: str) -> HashFn:
    """Return the hash function called ``name``: ``"sha256_cbor"`` (default), ``"sha256"``
    (sha256 over msgpack) or ``"xxhash_cbor"`` (xxh3_128 over canonical CBOR).

    Raises ValueError for any other name.
    """
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"unknown hash function {name!r}; choose one of {HASH_FN_NAMES}") from None


def _resolve(hash_fn: str | HashFn) -> HashFn:
    return get_hash_fn_by_name(hash_fn) if isinstance(hash_fn, str) else hash_fn


def get_root_hash(hash_fn: str | HashFn) -> BlockHash:
    """Parent hash of the first block (vLLM's ``NONE_HASH``), from a fixed seed.

    ``hash_fn(("kvbridge-root-v1", name))``: the same bytes in every process and on every node
    for the same hash function. Cached per function.
    """
    fn = _resolve(hash_fn)
    root = _ROOT_HASHES.get(fn)
    if root is None:
        name = _FN_TO_NAME.get(fn, getattr(fn, "__qualname__", "custom"))
        root = fn((_ROOT_SEED, name))
        _ROOT_HASHES[fn] = root
    return root


def hash_block_tokens(
    hash_fn: str | HashFn,
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block: ``hash_fn((parent or ROOT, pack_token_ids(token_ids), extra_keys))``.

    Args:
        hash_fn: a function or its name (see ``get_hash_fn_by_name``).
        parent_block_hash: the previous block's hash; ``None`` for the first block.
        token_ids: the block's ``block_size`` token ids (each in [0, 2**32), else ValueError).
        extra_keys: tagged tuples from ``generate_block_hash_extra_keys`` or ``None``.
    Returns the digest (bytes). Pure; mutates nothing.
    """
    fn = _resolve(hash_fn)
    parent = get_root_hash(fn) if parent_block_hash is None else parent_block_hash
    return fn((parent, pack_token_ids(token_ids), extra_keys))


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Cache key of ``block_hash`` in KV cache group ``group_id`` (4 big-endian bytes appended).

    ValueError unless ``0 <= group_id < 2**32``.
    """
    try:
        return block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big")
    except OverflowError:
        raise ValueError(f"group_id {group_id} does not fit in 4 unsigned bytes") from None


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """Inverse of ``make_block_hash_with_group_id``: the block hash part."""
    return key[:-_GROUP_ID_BYTES]


def get_group_id(key: BlockHashWithGroupId) -> int:
    """Inverse of ``make_block_hash_with_group_id``: the group id part."""
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


def generate_block_hash_extra_keys(
    request: HashableRequest, start_token_idx: int, end_token_idx: int
) -> tuple[Any, ...] | None:
    """Tagged extra keys for the block covering tokens ``[start_token_idx, end_token_idx)``.

    Order: ``("lora", name)``; one ``("mm", identifier, offset - start_token_idx)`` per
    multimodal item overlapping the block (offset relative to the block start, negative when the
    item began in an earlier block); ``("cache_salt", salt)`` when ``start_token_idx == 0``;
    ``("prompt_embeds", sha256(rows))`` when the request carries prompt embeddings for the block.
    Returns ``None`` when there is no extra key. Source: vllm/v1/core/kv_cache_utils.py
    ``generate_block_hash_extra_keys``; seed 001, section 1.
    """
    keys: list[tuple[Any, ...]] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    for feature in request.mm_features:
        if feature.offset < end_token_idx and feature.offset + feature.length > start_token_idx:
            keys.append(("mm", feature.identifier, feature.offset - start_token_idx))
    if start_token_idx == 0 and request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    digest = request.prompt_embeds_digest(start_token_idx, end_token_idx)
    if digest is not None:
        keys.append(("prompt_embeds", digest))
    return tuple(keys) if keys else None


def get_request_block_hasher(
    block_size: int, hash_fn: str | HashFn = "sha256_cbor"
) -> Callable[[HashableRequest], list[BlockHash]]:
    """Return ``hasher(request) -> new hashes`` for full blocks not yet in
    ``request.block_hashes`` (the caller, ``Request``, extends its list with them).

    ``block_size`` is the hash granularity in tokens (vLLM's ``hash_block_size``). Only full
    blocks of ``request.all_token_ids`` are hashed; a partial tail block is hashed once it fills.
    Source: vllm/v1/core/kv_cache_utils.py (``get_request_block_hasher``), seed 001, section 1.

    Raises:
        ValueError: if ``block_size < 1`` or ``hash_fn`` names no known function.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    fn = _resolve(hash_fn)
    payload_digest = _CBOR_PAYLOAD_DIGESTS.get(fn)
    block_bytes = block_size * _TOKEN_BYTES
    tokens_head = _cbor_head(2, block_bytes)

    def request_block_hasher(request: HashableRequest) -> list[BlockHash]:
        token_ids = request.all_token_ids
        num_hashed = len(request.block_hashes)
        start = num_hashed * block_size
        num_new_blocks = (len(token_ids) - start) // block_size
        if num_new_blocks <= 0:
            return []
        parent = request.block_hashes[-1] if num_hashed else get_root_hash(fn)
        has_extra_keys = (
            request.lora_name is not None
            or request.cache_salt is not None
            or bool(request.mm_features)
            or request.prompt_embeds is not None
        )
        packed = pack_token_ids(token_ids[start : start + num_new_blocks * block_size])
        new_hashes: list[BlockHash] = []
        append = new_hashes.append
        # Canonical CBOR of (parent, block bytes, extra): array(3) head, byte-string head +
        # parent, byte-string head + block bytes, extra (null = 0xf6). Equal to cbor2's bytes.
        prefix = b"\x83" + _cbor_head(2, len(parent))
        for k in range(num_new_blocks):
            block = packed[k * block_bytes : (k + 1) * block_bytes]
            extra = None
            if has_extra_keys:
                block_start = start + k * block_size
                extra = generate_block_hash_extra_keys(
                    request, block_start, block_start + block_size
                )
            if payload_digest is None:
                parent = fn((parent, block, extra))
            else:
                tail = b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True)
                parent = payload_digest(b"".join((prefix, parent, tokens_head, block, tail)))
            append(parent)
        return new_hashes

    return request_block_hasher


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """Read-only view of hashes made at ``hash_block_size`` as hashes of ``block_size`` blocks.

    With ``block_size = k * hash_block_size`` the hash of a large block ``i`` is the
    concatenation of the ``k`` fine hashes it covers (the last of which already chains everything
    before it). Only complete large blocks are visible. Mirrors vLLM's class of the same name.
    """

    __slots__ = ("_block_hashes", "_ratio")

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int):
        if block_size % hash_block_size:
            raise ValueError(
                f"block_size {block_size} is not a multiple of hash_block_size {hash_block_size}"
            )
        self._block_hashes = block_hashes
        self._ratio = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._block_hashes) // self._ratio

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self._ratio
        return b"".join(self._block_hashes[start : start + self._ratio])
