"""Builders for store-tier tests: a started store node of the tiny model's blocks, and a store
that takes its geometry from its first writer."""

from __future__ import annotations

from collections.abc import Iterator

from _engine_builders import tiny_model
from kvbridge.connector.store import StoreNode, close_store_node, start_store_node
from kvbridge.transport import LoopbackNetwork

BLOCK_SIZE = 16


def make_store(
    network: LoopbackNetwork, *, index_url: str, capacity_blocks: int, **kw
) -> StoreNode:
    """A started loopback store of ``capacity_blocks`` tiny-model blocks (4 layers of float32,
    block size 16) publishing to ``index_url``; ``kw`` goes to ``StoreNode``."""
    model = tiny_model(hybrid=False).config
    per_block = 2 * BLOCK_SIZE * model.num_kv_heads * model.head_dim * 4 * model.num_layers
    node = StoreNode(
        model,
        block_size=BLOCK_SIZE,
        capacity_bytes=capacity_blocks * per_block,
        transport="loopback",
        loopback_network=network,
        index_url=index_url,
        **kw,
    )
    return start_store_node(node)


def learning_store(redis_url: str, capacity_bytes: int, *,
                   write_port: int = 0) -> Iterator[StoreNode]:
    """A started loopback store with no geometry (its first writer's hello gives it one),
    publishing to ``redis_url`` with a 5 s index TTL, writes on ``write_port`` (0: any free
    one); closed when the generator ends (the body of a pytest fixture: ``yield from
    learning_store(...)``)."""
    node = start_store_node(StoreNode(capacity_bytes=capacity_bytes, index_url=redis_url,
                                      transport="loopback", loopback_network=LoopbackNetwork(),
                                      index_ttl_s=5.0, write_port=write_port))
    try:
        yield node
    finally:
        close_store_node(node)
