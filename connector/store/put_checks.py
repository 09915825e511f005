"""Whether a decoded put fits a store (``StoreNode.check_put``): its block identity, groups,
sizes and, for a put of some KV heads (a tensor-parallel rank's, ``wire``: ``heads``), those
heads. Raises ``StoreWireError`` naming the field; mutates nothing."""

from __future__ import annotations

from kvbridge.transport import NodeMetadata

from .cache import StoreCache
from .slices import HeadSlice
from .wire import PutRequest, StoreWireError

__all__ = ["check_put", "put_heads"]


def put_heads(put: PutRequest, metadata: NodeMetadata) -> HeadSlice | None:
    """The heads ``put`` carries of each block of a store of ``metadata`` (None: every head).

    Raises:
        StoreWireError: heads outside the model's, or a part of the heads on a store whose
            layout does not keep a run of heads in one byte range of a block row.
    """
    if put.heads is None:
        return None
    heads = HeadSlice(*put.heads, metadata.total_kv_heads)
    error = heads.error()
    if error is not None:
        raise StoreWireError(f"field 'heads': {error}")
    sliceable = metadata.kv_heads is not None and metadata.kv_heads.sliceable
    if not heads.whole and not sliceable:
        raise StoreWireError(
            f"field 'heads': this store's layout {metadata.identity.kv_layout!r} does not keep "
            "a run of KV heads in one byte range of a block: only whole blocks are stored")
    return heads


def check_put(put: PutRequest, metadata: NodeMetadata | None, cache: StoreCache | None) -> None:
    """Raise StoreWireError if ``put`` does not fit the store of ``metadata`` and ``cache``
    (None: a store without a geometry yet): the identity (``compat_hash``), each group's id and
    payload size (scaled by the share of heads a ``heads`` put carries), the heads
    (``put_heads``) and how they meet what the store has of those blocks
    (``StoreCache.head_conflict``)."""
    if metadata is None or cache is None:
        raise StoreWireError("this store has no block geometry yet: a writer names its own "
                             "in a hello on its connection (or start kvbridge-store with "
                             "--profile)")
    if put.compat_hash != metadata.compat_hash:
        raise StoreWireError(
            f"compat_hash {put.compat_hash[:16]}... is not this store's "
            f"{metadata.compat_hash[:16]}... (another block identity: model, "
            "revision, KV dtype, layout, block size or hash function; or KV geometry)"
        )
    heads = put_heads(put, metadata)
    for i, group in enumerate(put.groups):
        if group.group_id >= len(cache.groups):
            raise StoreWireError(
                f"groups[{i}].group_id {group.group_id} not in [0, {len(cache.groups)})"
            )
        block_nbytes = cache.groups[group.group_id].block_nbytes
        if heads is not None:  # rows hold the same bytes per head (transport.heads)
            block_nbytes = block_nbytes * (heads.stop - heads.start) // heads.total
        expected = len(group.block_hashes) * block_nbytes
        if group.nbytes != expected:
            raise StoreWireError(
                f"groups[{i}].nbytes {group.nbytes} != {len(group.block_hashes)} blocks x "
                f"{block_nbytes} bytes" + ("" if heads is None else
                                           f" (heads [{heads.start}, {heads.stop}))")
            )
        conflict = cache.head_conflict(group.group_id, group.block_hashes, heads)
        if conflict is not None:
            raise StoreWireError(conflict)
