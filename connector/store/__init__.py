"""kvbridge.connector.store: the remote store tier for cold cached blocks.

The store's side: ``StoreNode`` (``node``) holds offloaded blocks (``cache``), takes writes on a
small TCP server (``server``; frames in ``wire``, socket helpers in ``framing``) and serves them
back through the block index and the transport like any holder.

A node's side (offload): ``OffloadPlanner`` (``planner``, scheduler half) picks cold cached
blocks each step; ``OffloadSender`` (``sender``, worker half) snapshots them into host staging
(``staging``) and writes them with ``StoreWriter`` (``writer``); the records between the halves
are in ``offload_items``; ``url`` parses ``store_url``.
docs/architecture.md, "Life of a store offload and restore".
"""

from .cache import StoreCache
from .node import StoreNode, StoreStats, close_store_node, start_store_node
from .offload_items import OffloadItem, OffloadOutcome
from .planner import OffloadPlanner
from .sender import OffloadSender
from .staging import StagingPool, snapshot_blocks
from .url import format_store_url, parse_store_url
from .wire import PutGroup, PutReply, PutRequest, StoreWireError
from .writer import StoreWriter

__all__ = [
    "OffloadItem",
    "OffloadOutcome",
    "OffloadPlanner",
    "OffloadSender",
    "PutGroup",
    "PutReply",
    "PutRequest",
    "StagingPool",
    "StoreCache",
    "StoreNode",
    "StoreStats",
    "StoreWireError",
    "StoreWriter",
    "close_store_node",
    "format_store_url",
    "parse_store_url",
    "snapshot_blocks",
    "start_store_node",
]
