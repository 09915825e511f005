"""kvbridge.connector: the P/D connector plugin, the cross-node block index and the store tier.

- ``KVBridgeConnector`` (both halves of vLLM's ``KVConnectorBase_V1`` protocol) moves a request's
  prompt KV from a prefill node to a decode node over a ``kvbridge.transport.Transport``;
  ``create_engine`` builds a node with it from a vLLM-shaped ``kv_transfer_config``.
- ``BlockIndex`` (``InMemoryBlockIndex``, ``RedisBlockIndex``) finds a request's longest prefix
  held anywhere; ``IndexClient`` is one node's use of it.
- ``store``: the remote store tier (``StoreNode``) and a node's offload to it.
- ``get_loop_thread``: the process's one asyncio loop thread that runs the connector's network work.
"""

from .config import KVTransferConfig
from .errors import KVConnectorError, KVTransferConfigError, KVTransferParamsError
from .factory import KVBridgeConnectorFactory, create_engine
from .index import (
    BlockIndex,
    Holder,
    IndexClient,
    IndexNamespace,
    InMemoryBlockIndex,
    PrefixHit,
    RedisBlockIndex,
    new_incarnation,
    open_index,
)
from .kvbridge_connector import KVBridgeConnector
from .loop_thread import LoopThread, get_loop_thread
from .stats import KVTransferStats
from .transfer_params import RemotePrefillParams

__all__ = [
    "BlockIndex",
    "Holder",
    "InMemoryBlockIndex",
    "IndexClient",
    "IndexNamespace",
    "KVBridgeConnector",
    "KVBridgeConnectorFactory",
    "KVConnectorError",
    "KVTransferConfig",
    "KVTransferConfigError",
    "KVTransferParamsError",
    "KVTransferStats",
    "LoopThread",
    "PrefixHit",
    "RedisBlockIndex",
    "RemotePrefillParams",
    "create_engine",
    "get_loop_thread",
    "new_incarnation",
    "open_index",
]
