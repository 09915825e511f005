"""The holder side of a read found through the block index: when it stops vouching for a block,
and what it counts as served.

- The worker half applies a step's hash removals when it is handed the step's orders
  (``bind_connector_metadata``), not in ``start_load_kv``: vLLM 0.32 calls ``start_load_kv``
  after the forward when a step has no sync load, and that forward may overwrite an evicted
  block that a peer is reading meanwhile.
- A block served to an index read (no lease) is counted once, at the re-check after its bytes
  left (``HolderChecks.recheck_blocks``), with its bytes in ``bytes_sent``, so holder and
  puller count the same blocks.
"""

from __future__ import annotations

import torch
from kvbridge.connector.config import KVTransferConfig
from kvbridge.connector.holder import HeldBlockHashes, HolderChecks
from kvbridge.connector.lease import LeaseTable
from kvbridge.connector.metadata import BlockHashDelta, KVBridgeConnectorMetadata
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.worker_half import KVBridgeWorker
from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.kvmanager.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvbridge.transport import LeaseRef

H5, H6, H7 = (bytes([i]) * 32 for i in (5, 6, 7))
BYTES_PER_BLOCK = 4096


def _delta(*, stored: dict[int, bytes] | None = None, removed: list[int] | None = None
           ) -> BlockHashDelta:
    stored = stored or {}
    return BlockHashDelta(
        removed_block_ids=list(removed or []), stored_block_ids=list(stored),
        stored_hashes=[make_block_hash_with_group_id(h, 0) for h in stored.values()])


def _worker() -> KVBridgeWorker:
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_both", "engine_id": "holder",
         "kv_connector_extra_config": {"transport": "loopback"}})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=16,
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KVBridgeWorker(config, kv_cache_config, hash_fn_name="sha256")


def _holds(worker: KVBridgeWorker, block_id: int, block_hash: bytes) -> bool:
    return worker.hashes.holds(block_id, make_block_hash_with_group_id(block_hash, 0))


def test_a_removal_is_applied_when_the_orders_arrive_before_any_forward():
    worker = _worker()
    # (1) a step caches block 5 with H5: vouched for once its forward has run (wait_for_save)
    worker.bind_connector_metadata(KVBridgeConnectorMetadata(block_hashes=_delta(stored={5: H5})))
    assert not _holds(worker, 5, H5)  # its KV is not computed yet
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert _holds(worker, 5, H5)
    # (2) the next step evicts block 5 and reuses it for H6: from the moment the orders arrive
    # (vLLM may run the forward that rewrites block 5 before start_load_kv), nothing vouches
    # for block 5 until that forward is done.
    worker.bind_connector_metadata(KVBridgeConnectorMetadata(
        block_hashes=_delta(removed=[5], stored={5: H6})))
    assert not _holds(worker, 5, H5) and not _holds(worker, 5, H6)
    worker.wait_for_save()
    assert _holds(worker, 5, H6) and not _holds(worker, 5, H5)


def _checks() -> tuple[HolderChecks, KVTransferStats]:
    hashes = HeldBlockHashes()
    hashes.apply_stores(_delta(stored={5: H5, 6: H6}))
    leases = LeaseTable(30.0)
    leases.grant("handoff", [[7]], [H7], "tok")
    stats = KVTransferStats()
    checks = HolderChecks(leases=leases, hashes=hashes, stats=stats, num_blocks=16,
                          bytes_per_block=[BYTES_PER_BLOCK])
    return checks, stats


def test_an_index_read_counts_each_block_served_once_at_its_recheck():
    checks, stats = _checks()
    assert checks.as_kwargs()["block_rechecker"] == checks.recheck_blocks
    # The check at arrival counts nothing (it runs again, over the same blocks, at the recheck).
    assert checks.validate_blocks(0, [5, 6, 9], [H5, H6, H5], None) == [2]
    assert stats.num_index_blocks_served == 0
    # Block 6 was evicted and reused while its bytes were copied out: refused, not counted.
    checks.hashes.apply_removals(_delta(removed=[6]))
    assert checks.recheck_blocks(0, [5, 6], [H5, H6], None) == [1]
    assert (stats.num_index_blocks_served, stats.bytes_sent) == (1, BYTES_PER_BLOCK)


def test_a_handoff_read_under_a_lease_is_not_counted_as_an_index_read():
    checks, stats = _checks()
    lease = LeaseRef(request_id="handoff", token="tok")
    assert checks.recheck_blocks(0, [7], [H7], lease) == []
    # A handoff's bytes are counted when its lease is released (on_transfer_done).
    assert (stats.num_index_blocks_served, stats.bytes_sent) == (0, 0)
