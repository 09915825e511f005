"""Block identities one field apart (issue 28, item 7): two nodes that differ in one field of
``BlockIdentity`` only must never exchange a block, neither through the index namespace nor
past the handshake. The tests take their cases from ``IDENTITY_FIELDS`` (every field of the
class), so a field added there without a value in ``OTHER_VALUE`` fails
``test_every_identity_field_has_a_case`` until it has its cases too."""

from __future__ import annotations

import dataclasses

from kvbridge.transport import BlockIdentity

IDENTITY_FIELDS = tuple(f.name for f in dataclasses.fields(BlockIdentity))

BASE_IDENTITY = BlockIdentity(
    model_name="tiny-llama", kv_cache_dtype="bfloat16", block_size=16, hash_fn_name="sha256_cbor"
)
"""kvbridge's own layout, revision unknown (``""``), the transport helpers' bfloat16 caches."""

OTHER_VALUE: dict[str, object] = {
    "model_name": "tiny-llama-chat",
    "model_revision": "5d0f2ab1",  # another commit of the same weights' repository
    "model_dtype": "float16+q:fp8",  # the same checkpoint, quantized when loaded
    "kv_cache_dtype": "fp8_e5m2",  # a name only: vLLM's fp8 caches are uint8 tensors either way
    "kv_layout": "vllm:cuda-attn:kv_split[16,2,8]:NHD:bfloat16",
    "block_size": 32,
    "hash_fn_name": "xxhash_cbor",
    "hash_root": "0f1e2d3c4b5a6978",  # vLLM's NONE_HASH from another PYTHONHASHSEED
}


def one_field_apart(name: str, base: BlockIdentity = BASE_IDENTITY) -> BlockIdentity:
    """``base`` with field ``name`` changed to its ``OTHER_VALUE``."""
    return dataclasses.replace(base, **{name: OTHER_VALUE[name]})


def holder_refusal(name: str) -> str:
    """The handshake error's field part when a holder of ``one_field_apart(name)`` refuses a
    requester of ``BASE_IDENTITY`` (the holder speaks: "local" is the holder)."""
    return f"{name}: local {OTHER_VALUE[name]!r}, remote {getattr(BASE_IDENTITY, name)!r}"
