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
from kvbridge.connector.metadata import (
    BlockHashDelta,
    GroupRead,
    HolderRef,
    KVBridgeConnectorMetadata,
    PullPlan,
)
from kvbridge.connector.puller import Settled
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


def test_a_sync_pull_s_blocks_that_did_not_land_are_not_vouched_for(monkeypatch):
    # vLLM caches a sync load's blocks when it allocates them (before the load), so the step's
    # stores name block 5 with H5 although the pull into it failed: under kv_load_failure_policy
    # "recompute" vLLM keeps that entry until the block is recomputed, and a peer reading block
    # 5 for H5 meanwhile would get bytes that are not H5's KV.
    worker = _worker()
    worker.transport = object()  # start_load_kv's guard; the pull itself is stubbed below
    plan = PullPlan(request_id="r", holder=HolderRef(engine_id="p", incarnation="1",
                                                    host="127.0.0.1", port=9),
                    lease=None, groups=[GroupRead(group_id=0, remote_block_ids=[3, 4],
                                      local_block_ids=[5, 6])],
                    unloadable_block_ids=[], num_external_tokens=32, created_at=0.0, sync=True)
    monkeypatch.setattr(worker.puller, "submit", lambda transport, plan: None)
    monkeypatch.setattr(worker.puller, "wait_settled", lambda request_ids: {5})
    worker.bind_connector_metadata(KVBridgeConnectorMetadata(
        pulls=[plan], block_hashes=_delta(stored={5: H5, 6: H6})))
    worker.start_load_kv()
    worker.wait_for_save()
    assert not _holds(worker, 5, H5) and _holds(worker, 6, H6)
    # an async pull's failure, reported by get_finished, unlists blocks already listed
    monkeypatch.setattr(worker.puller, "pop_settled",
                        lambda: Settled(request_ids={"r2"}, failed_block_ids={6},
                                        failed_request_ids={"r2"}))
    monkeypatch.setattr(worker.puller, "cancel_aborted", lambda transport, ids: None)
    monkeypatch.setattr(worker.puller, "send_deferred_notices", lambda transport: None)
    worker.get_finished(set())
    assert not _holds(worker, 6, H6)
    assert worker.get_block_ids_with_load_errors() == {6}


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


def test_a_step_s_report_names_the_step_its_orders_came_from():
    # The scheduler half publishes a step's blocks once a report names that step: the report is
    # built at the end of the step (after wait_for_save), and numbered steps are never empty.
    worker = _worker()
    assert worker.build_connector_worker_meta().is_empty()  # no orders yet: nothing to say
    for step_id in (1, 2):
        worker.bind_connector_metadata(KVBridgeConnectorMetadata(
            step_id=step_id, block_hashes=_delta(stored={4 + step_id: H5})))
        worker.wait_for_save()
        report = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        assert report.step_id == step_id and not report.is_empty()
