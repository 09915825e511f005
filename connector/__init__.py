"""kvbridge.connector."""

from .block_index import (
    BlockIndex,
    Holder,
    IndexNamespace,
    InMemoryBlockIndex,
    PrefixHit,
    new_incarnation,
)
from .redis_block_index import RedisBlockIndex

__all__ = [
    "BlockIndex",
    "Holder",
    "InMemoryBlockIndex",
    "IndexNamespace",
    "PrefixHit",
    "RedisBlockIndex",
    "new_incarnation",
]
