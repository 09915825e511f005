"""The holder side of a node: what it does when a peer reads its blocks.

A holder serves reads from its own KV tensors (the transport does the bytes); the connector
decides, through the transport's callbacks, whether a block may be served and when a lease ends:

- ``validate_blocks``: a block whose hash changed since the requester planned the read (the
  holder evicted and reused it) is refused, so the requester gets a load error and recomputes,
  never stale bytes (DESIGN.md, "Block index": a hit is advisory).
- ``on_heartbeat`` extends the leases a puller depends on; ``on_transfer_done`` (the puller's
  completion notice, success or not) ends one, so the prefill node frees the blocks.

Callbacks run on the connector's event-loop thread and never block.
"""

from __future__ import annotations

from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.transport import TransferDoneNotice

from .context import ConnectorContext
from .pull_plan import parse_lease_token

__all__ = ["HolderCallbacks"]


class HolderCallbacks:
    """One node's transport callbacks: ``transport.set_callbacks(**callbacks.as_kwargs())``."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx

    def as_kwargs(self) -> dict[str, object]:
        return {
            "block_validator": self.validate_blocks,
            "on_heartbeat": self.on_heartbeat,
            "on_transfer_done": self.on_transfer_done,
        }

    def validate_blocks(
        self, group_id: int, block_ids: list[int], expected_hashes: list[bytes]
    ) -> list[int]:
        """Positions whose block does not hold the expected content now.

        Args:
            group_id: the KV cache group read.
            block_ids: block ids on this node, as the requester sent them.
            expected_hashes: per position, the requester's block hash; or a lease token
                (``pull_plan.lease_token``) for a block without a hash, served only while that
                lease is held and covers the block; ``b""`` = not checked.

        Returns:
            positions to refuse: the hash differs, the lease ended, or the id is outside this
            pool. Called again after the bytes were copied, so a block reused meanwhile (its
            hash goes before new content comes) is refused too.
        """
        manager = self.ctx.kv_cache_manager
        bad: list[int] = []
        for pos, (block_id, expected) in enumerate(zip(block_ids, expected_hashes, strict=True)):
            if not expected:
                continue
            if manager is None or not 0 < block_id < len(manager.block_pool.blocks):
                bad.append(pos)  # no pool yet, or an id from the network out of range
                continue
            lease_id = parse_lease_token(expected)
            if lease_id is not None:
                if not self._lease_covers(lease_id, group_id, block_id):
                    bad.append(pos)
                continue
            actual = manager.block_pool.blocks[block_id].block_hash
            if actual != make_block_hash_with_group_id(expected, group_id):
                bad.append(pos)
        return bad

    def _lease_covers(self, lease_id: str, group_id: int, block_id: int) -> bool:
        """True while ``lease_id``'s lease is held and protects ``block_id`` in ``group_id``."""
        held = self.ctx.leases.block_ids(lease_id)
        if held is None or not self.ctx.leases.is_held(lease_id) or group_id >= len(held):
            return False
        return block_id in held[group_id]

    def on_heartbeat(self, peer_engine_id: str, request_ids: list[str]) -> None:
        self.ctx.leases.extend(request_ids)

    def on_transfer_done(self, notice: TransferDoneNotice) -> None:
        """The puller is done with a request (or gave up): end its lease now."""
        held = self.ctx.leases.block_ids(notice.request_id)
        if self.ctx.leases.release(notice.request_id) and held is not None:
            self.ctx.stats.add("num_released_leases")
            if notice.success:
                self.ctx.stats.add("bytes_sent", self._held_nbytes(held))

    def _held_nbytes(self, held: tuple[tuple[int, ...], ...]) -> int:
        """KV bytes of the held blocks over every layer (the null block 0 holds none)."""
        total = 0
        for group, ids in zip(self.ctx.kv_cache_config.kv_cache_groups, held, strict=True):
            page = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
            total += page * sum(1 for b in ids if b != 0)
        return total
