"""``StoreProfile``: a store node built for another engine's KV (vLLM's): its block identity
(``BlockIdentity``, every field), KV geometry and index namespace, so the engine's puts are
accepted, its handshake matches and its lookups find the store's blocks."""

from __future__ import annotations

import pytest
import torch
from kvbridge.connector.index import IndexNamespace
from kvbridge.connector.serve import store_server
from kvbridge.connector.store import PutGroup, PutRequest, StoreNode, StoreWireError
from kvbridge.connector.store.profile import StoreProfile
from kvbridge.transport import LoopbackNetwork, NodeMetadata

VLLM_LAYOUT = "vllm:cpu-attn:blocks_first[2,32,64]:float32"  # the suite's tiny Llama on CPU


def _writer(kv_layout: str = VLLM_LAYOUT, **identity: str) -> NodeMetadata:
    """A vLLM engine's handshake metadata: 2 layers of [blocks, 2, 32, 2, 32] float32 views."""
    caches = [[torch.zeros(8, 2, 32, 2, 32) for _ in range(2)]]
    return NodeMetadata.from_kv_caches(
        engine_id="engine-a", kv_caches_by_group=caches, model_name="/models/tiny",
        hash_fn_name="sha256", kv_layout=kv_layout, model_revision="abc123",
        model_dtype="float32", hash_root="00ff00ff00ff00ff", **identity)


def _put(metadata: NodeMetadata, num_blocks: int = 1) -> PutRequest:
    group = PutGroup(group_id=0, block_hashes=tuple(bytes([i + 1]) * 32 for i in range(num_blocks)),
                     parent_hashes=(b"",) * num_blocks,
                     nbytes=num_blocks * 2 * metadata.groups[0].block_nbytes)
    return PutRequest(compat_hash=metadata.compat_hash, groups=(group,))


def test_a_store_built_from_a_vllm_engine_s_profile_takes_its_puts_in_its_namespace():
    writer = _writer()
    profile = StoreProfile.of_metadata(writer, kv_heads_layout="")
    assert StoreProfile.from_json(profile.to_json()) == profile
    assert StoreProfile.from_msgpack(profile.to_msgpack()) == profile
    block_nbytes = 2 * 2 * 32 * 2 * 32 * 4  # two layers of one block, float32
    assert profile.bytes_per_block == block_nbytes
    assert profile.compat_hash == writer.compat_hash
    node = StoreNode(None, capacity_bytes=10 * block_nbytes, transport="loopback",
                     loopback_network=LoopbackNetwork(), profile=profile)
    assert node.cache.num_store_blocks == 10 and node.block_size == 32
    # The store's handshake is the writer's identity and geometry, every field of it.
    assert node.metadata.identity == writer.identity
    assert node.metadata.compat_hash == writer.compat_hash
    node.check_put(_put(writer, 3))  # accepted: the same identity and geometry
    # Its index namespace is exactly the one the writer's scheduler half publishes in.
    assert node.namespace == IndexNamespace(identity=writer.identity)
    # A writer of another layout, revision or hash root is refused.
    for other in (_writer(kv_layout="kvbridge-blocks-first"), _writer(kv_cache_dtype="fp8")):
        with pytest.raises(StoreWireError, match="compat_hash"):
            node.check_put(_put(other))


def test_the_profile_carries_the_writer_s_kv_heads_layout_into_the_namespace():
    profile = StoreProfile.of_metadata(_writer(), kv_heads_layout="tp2h8")
    assert profile.namespace.key_prefix.endswith(":tp2h8")
    assert StoreProfile.from_json(profile.to_json()).kv_heads_layout == "tp2h8"


_GOOD = StoreProfile.of_metadata(_writer()).to_json()


@pytest.mark.parametrize(("text", "field"), [
    ("not json", "malformed"),
    ('{"identity": 1}', r"\$.identity"),
    (_GOOD.replace('"block_shape":[2,32,', '"block_shape":[2,16,'), "block size 32 second"),
    (_GOOD.replace('"dtype":"float32"', '"dtype":"nosuchdtype"'), r"groups\[0\].dtype"),
    (_GOOD.replace('"model_name":"/models/tiny"', '"model_name":""'), "model_name"),
])
def test_a_malformed_profile_is_refused_naming_the_field(text, field):
    assert text != _GOOD
    with pytest.raises(ValueError, match=field):
        StoreProfile.from_json(text)


def test_kvbridge_store_refuses_a_malformed_profile_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        store_server.main(["--capacity-bytes", "1000000", "--index-url", "memory",
                           "--profile", "{}"])
    assert exc.value.code == 2
    assert "store profile: Object missing required field `identity`" in capsys.readouterr().err
