"""kvbridge.connector.index: which node holds which block hash, across nodes.

``BlockIndex`` (``protocol``) is the contract; ``InMemoryBlockIndex``, ``RedisBlockIndex`` and
``RedisClusterBlockIndex`` (``redis-cluster://``) implement it; ``NodeDirectory`` maps node ids
to transport addresses; ``IndexClient`` is one node's non-blocking use of both (publishing its
block events, heart-beating, looking up remote prefixes), its ``IndexWorker`` thread the one
that makes the backend calls (``lookup.py``: one lookup). DESIGN.md, "Block index".
"""

from .client import IndexClient, block_index_for_url, open_index
from .in_memory import InMemoryBlockIndex
from .lookup import LookupResult, LookupStatus, RemotePrefix
from .node_directory import NodeDirectory
from .protocol import (
    NO_HIT,
    BlockIndex,
    Holder,
    IndexNamespace,
    IndexStats,
    PrefixHit,
    Tier,
    new_incarnation,
)
from .redis_cluster import RedisClusterBlockIndex, cluster_client
from .redis_index import RedisBlockIndex

__all__ = [
    "NO_HIT",
    "BlockIndex",
    "Holder",
    "InMemoryBlockIndex",
    "IndexClient",
    "IndexNamespace",
    "IndexStats",
    "LookupResult",
    "LookupStatus",
    "NodeDirectory",
    "PrefixHit",
    "RedisBlockIndex",
    "RedisClusterBlockIndex",
    "RemotePrefix",
    "Tier",
    "block_index_for_url",
    "cluster_client",
    "new_incarnation",
    "open_index",
]
