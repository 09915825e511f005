"""The store tier in vLLM's KV-event stream (issue 31 part 5): what this engine wrote to the
store and the store later reported missing, as vLLM ``BlockStored`` / ``BlockRemoved`` events
with the medium ``STORE_MEDIUM``, for ``KVConnectorBase_V1.take_events`` (vLLM publishes them
with its pool's own when ``kv_events_config.enable_kv_cache_events`` is on).

Source: the worker half's offload outcomes (``store.offload_items.OffloadOutcome``) that reach
the scheduler half each step. A held outcome -> ``BlockStored`` of that block (its parent the
one the offload planner planned it with, kept until the outcome even if vLLM has evicted the
block meanwhile); a ``missing`` one (a put's reply named a block the store no longer holds) ->
``BlockRemoved``. The store drops blocks on its own (LRU) without telling the writers, so a
router learns a removal only when a later put of this engine meets it; the index (tier
``"store"``) is the exact record.

Owner: the engine thread (vLLM's scheduler); nothing here is shared.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

__all__ = ["STORE_MEDIUM", "StoreTierEvents"]

STORE_MEDIUM = "KVBRIDGE_STORE"
"""``medium`` of the store tier's events (vLLM's own are ``"GPU"``, ``"CPU"``, ``"STORAGE"``)."""

MAX_PENDING_EVENTS = 1 << 16
"""Events kept between two ``take`` calls at most (the oldest are dropped first)."""


class StoreTierEvents:
    """Turns offload outcomes into vLLM KV events. See the module docstring.

    Args:
        block_size: tokens per block (``BlockStored.block_size``).
        parent_of: ``parent_of(group_id, block_hash)`` -> the parent hash (``b""``: a first
            block) or None when unknown (``OffloadPlanner.written_parent_of``).
    """

    def __init__(self, *, block_size: int,
                 parent_of: Callable[[int, bytes], bytes | None]) -> None:
        self.block_size = block_size
        self._parent_of = parent_of
        self._events: deque[Any] = deque(maxlen=MAX_PENDING_EVENTS)

    def observe(self, outcomes: Iterable[Any]) -> None:
        """Record the events of ``outcomes``: ``(group_id, block_hash, held[, missing])``
        arrays or ``OffloadOutcome`` records, in the order they settled."""
        for outcome in outcomes:
            group_id, block_hash, held = int(outcome[0]), bytes(outcome[1]), bool(outcome[2])
            missing = len(outcome) > 3 and bool(outcome[3])
            if missing:
                self._events.append(BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(block_hash)], medium=STORE_MEDIUM,
                    group_idx=group_id))
            elif held:
                parent = self._parent_of(group_id, block_hash)
                self._events.append(BlockStored(
                    block_hashes=[maybe_convert_block_hash(block_hash)],
                    parent_block_hash=maybe_convert_block_hash(parent) if parent else None,
                    token_ids=[], block_size=self.block_size, lora_id=None,
                    medium=STORE_MEDIUM, lora_name=None, group_idx=group_id))

    def take(self) -> list[Any]:
        """The events recorded since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events
