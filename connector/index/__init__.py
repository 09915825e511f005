"""kvbridge.connector.index: which node holds which block hash, across nodes.

``BlockIndex`` (``protocol``) is the contract; ``InMemoryBlockIndex``, ``RedisBlockIndex`` and
``RedisClusterBlockIndex`` (``redis-cluster://``) implement it; ``NodeDirectory`` maps node ids
to transport addresses; ``find_server_binary`` (``server_binary``) picks the Redis-protocol
server a local index starts; ``check_index_url`` (``url``) checks an ``index_url`` (an IPv6
host in brackets) before anything connects; ``IndexClient`` is one node's non-blocking use of
both (publishing its block events, heart-beating, looking up remote prefixes), its
``IndexWorker`` thread the one that makes the backend calls (``lookup.py``: one lookup).
docs/architecture.md, "The block index".
"""

from .client import IndexClient, block_index_for_url, open_index
from .in_memory import InMemoryBlockIndex
from .listed import ListedSet
from .lookup import LookupResult, LookupStatus, RemotePrefix
from .node_directory import (
    InMemoryNodeDirectory,
    NodeAddress,
    NodeDirectory,
    RedisNodeDirectory,
)
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
from .server_binary import ServerBinary, find_server_binary
from .url import check_index_url

__all__ = [
    "NO_HIT",
    "BlockIndex",
    "Holder",
    "InMemoryBlockIndex",
    "InMemoryNodeDirectory",
    "IndexClient",
    "IndexNamespace",
    "IndexStats",
    "ListedSet",
    "LookupResult",
    "LookupStatus",
    "NodeAddress",
    "NodeDirectory",
    "PrefixHit",
    "RedisBlockIndex",
    "RedisClusterBlockIndex",
    "RedisNodeDirectory",
    "RemotePrefix",
    "ServerBinary",
    "Tier",
    "block_index_for_url",
    "check_index_url",
    "cluster_client",
    "find_server_binary",
    "new_incarnation",
    "open_index",
]
