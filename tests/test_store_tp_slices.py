"""The store tier for tensor-parallel writers (issue 30 part 3, issue 31 part 4): every rank
writes its own KV heads of a block, the store assembles them and holds (serves, publishes,
lists) a block only once every head is written; bad slices are refused for that writer only;
an incomplete block never pins memory; the ranks' offload outcomes count once per block
(docs/vllm-prefix-reuse.md, "Tensor-parallel engines and the store")."""

from __future__ import annotations

import pytest
import torch
from _store_builders import learning_store
from kvbridge.connector.errors import KVTransferConfigError
from kvbridge.connector.index import open_index
from kvbridge.connector.loop_thread import get_loop_thread
from kvbridge.connector.metadata import KVBridgeWorkerMeta, StatsDelta
from kvbridge.connector.rank_reports import RankReports
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.store import (
    OffloadItem,
    OffloadOutcome,
    OffloadSender,
    PutGroup,
    PutRequest,
    StoreNode,
    StoreWireError,
)
from kvbridge.connector.store.cache import StoreCache
from kvbridge.connector.store.profile import StoreProfile
from kvbridge.connector.store.slices import HeadSlice
from kvbridge.connector.store.writer import StoreWriter
from kvbridge.transport import KVHeads, NodeMetadata

HEADS = 2  # the model's KV heads; two ranks hold one each
BLOCK = (2, 16, HEADS, 8)  # one layer's whole block
BLOCK_BYTES = 2 * 16 * HEADS * 8 * 4
A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def _model_caches() -> list[torch.Tensor]:
    """A TP=1 engine's 2 layers of 8 whole blocks (each block's bytes distinct)."""
    return [torch.randn(8, *BLOCK) for _ in range(2)]


def _rank(caches: list[torch.Tensor], rank: int, *, sliceable: bool = True,
          tp_size: int = 2) -> tuple[list[torch.Tensor], NodeMetadata]:
    """Rank ``rank``'s share of ``caches`` and its handshake metadata. Rows are taken as
    head-major (a sliceable layout's: a run of heads is one byte range of a row, as the CPU
    backend's), so rank ``r``'s row is the ``r``-th run of each whole row's elements."""
    per = HEADS // tp_size
    mine = []
    for cache in caches:
        rows = cache.view(cache.shape[0], -1)
        run = rows.shape[1] // tp_size
        mine.append(rows[:, rank * run:(rank + 1) * run].contiguous()
                    .view(cache.shape[0], 2, 16, per, 8))
    metadata = NodeMetadata.from_kv_caches(
        engine_id=f"engine-r{rank}", kv_caches_by_group=[mine], model_name="m",
        hash_fn_name="sha256", kv_layout="vllm:test", hash_root="0123456789abcdef",
        kv_heads=KVHeads(first=rank * per, total=HEADS, sliceable=sliceable))
    return mine, metadata


@pytest.fixture
def store(redis_url):
    yield from learning_store(redis_url, 8 * 2 * BLOCK_BYTES)


def _sender(store: StoreNode, caches, metadata, *, layout: str = "tp2h2") -> OffloadSender:
    sender = OffloadSender(store_address=store.write_address, max_inflight_bytes=1 << 20,
                           stats=KVTransferStats())
    sender.bind([caches], metadata, kv_heads_layout=layout)
    return sender


def _found(store: StoreNode, hashes: list[bytes]) -> int:
    """Blocks of ``hashes`` the index finds from block 0 (the store's namespace)."""
    index, _ = open_index(store.index_url, store.namespace)
    return index.longest_prefix(hashes).num_blocks


def test_every_rank_has_the_model_s_whole_block_profile_apart_from_the_head_split():
    caches = _model_caches()
    whole = NodeMetadata.from_kv_caches(
        engine_id="tp1", kv_caches_by_group=[caches], model_name="m", hash_fn_name="sha256",
        kv_layout="vllm:test", hash_root="0123456789abcdef",
        kv_heads=KVHeads(first=0, total=HEADS, sliceable=True))
    tp1 = StoreProfile.of_metadata(whole).full_heads()
    ranks = [StoreProfile.of_metadata(_rank(caches, r)[1], kv_heads_layout="tp2h2").full_heads()
             for r in range(2)]
    assert ranks[0] == ranks[1]
    assert ranks[0].groups == tp1.groups and ranks[0].kv_heads == tp1.kv_heads
    assert ranks[0].first_difference(tp1) == "kv_heads_layout: local 'tp2h2', remote ''"
    assert ranks[0].compat_hash == tp1.compat_hash == whole.compat_hash


def test_a_block_is_held_served_and_published_only_once_every_rank_wrote_its_heads(store):
    caches = _model_caches()
    senders = [_sender(store, *_rank(caches, r)) for r in range(2)]
    items = [OffloadItem(1, 0, A, b""), OffloadItem(2, 0, B, A)]
    # Rank 0 alone: its heads are kept, nothing is held, served or published.
    assert senders[0].submit(items) == 2
    senders[0].wait_idle()
    assert [o.held for o in senders[0].take_outcomes()] == [True, True]  # its part is there
    assert store.cache.num_held() == 0 and store.cache.num_incomplete(0) == 2
    assert store.cache.validate(0, [1, 2], [A, B]) == [0, 1]  # no block id serves A or B
    assert store.cache.resync_events()[1:] == [] and _found(store, [A, B]) == 0
    # Rank 0 again: present, nothing rewritten, still incomplete.
    assert senders[0].submit(items[:1]) == 1
    senders[0].wait_idle()
    assert [o.held for o in senders[0].take_outcomes()] == [True]
    assert store.cache.num_incomplete(0) == 2
    # Rank 1: both blocks whole, published parents first, their bytes the model's blocks.
    assert senders[1].submit(items) == 2
    senders[1].wait_idle()
    assert [o.held for o in senders[1].take_outcomes()] == [True, True]
    assert store.cache.num_held() == 2 and store.cache.num_incomplete(0) == 0
    assert _found(store, [A, B]) == 2
    for block_hash, source_id in ((A, 1), (B, 2)):
        held = store.cache.block_id_of(0, block_hash)
        for layer, cache in enumerate(store.cache.groups[0].kv_caches):
            assert torch.equal(cache[held], caches[layer][source_id])
    assert store.profile.kv_heads_layout == "tp2h2" and store.metadata.held_heads == (0, HEADS)
    for sender in senders:
        sender.close()


def _put(metadata: NodeMetadata, heads, nbytes: int, block_hash: bytes = C) -> PutRequest:
    return PutRequest(compat_hash=metadata.compat_hash, heads=heads, groups=(
        PutGroup(group_id=0, block_hashes=(block_hash,), parent_hashes=(b"",), nbytes=nbytes),))


def test_slices_outside_the_model_s_heads_of_the_wrong_size_or_of_another_split_are_refused(
    store
):
    caches = _model_caches()
    _, meta = _rank(caches, 0)
    sender = _sender(store, *_rank(caches, 0))  # gives the store its geometry
    sender.submit([OffloadItem(1, 0, A, b"")])
    sender.wait_idle()
    writer = StoreWriter(*store.write_address)
    half = BLOCK_BYTES  # 2 layers x half a block

    def put(request: PutRequest, nbytes: int):
        payload = memoryview(bytearray(nbytes))
        return get_loop_thread().run(writer.put(request, [payload]), 10.0)

    with pytest.raises(StoreWireError, match=r"heads \[1, 3\) are not within the model's 2"):
        put(_put(meta, (1, 3), half), half)
    with pytest.raises(StoreWireError, match=r"nbytes 100 != 1 blocks x 2048 bytes"):
        put(_put(meta, (0, 1), 100), 100)
    # Heads [0, 1) of C from one writer, then the whole of C: the whole write completes it.
    assert put(_put(meta, (0, 1), half), half).num_incomplete == 1
    assert put(_put(meta, None, 2 * half), 2 * half).num_stored == 1
    assert store.cache.block_id_of(0, C) is not None
    get_loop_thread().run(writer.close(), 10.0)
    assert store.stats.num_put_errors == 2  # each refused for that writer; the store serves on


def test_a_slice_overlapping_heads_another_split_wrote_is_refused_by_the_cache():
    caches = [torch.zeros(5, 2, 16, 4, 8) for _ in range(2)]
    cache = StoreCache([caches], read_guard_s=0.0)
    quarter = torch.ones(2, 1, 2 * 16 * 2 * 8 * 4 // 1, dtype=torch.uint8)  # 2 of 4 heads
    cache.put(0, [A], [b""], quarter, HeadSlice(0, 2, 4))
    message = cache.head_conflict(0, [A], HeadSlice(1, 3, 4))
    assert message is not None and "overlap its heads [0, 2)" in message
    with pytest.raises(ValueError, match="overlap"):
        cache.put(0, [A], [b""], quarter, HeadSlice(1, 3, 4))
    assert cache.head_conflict(0, [A], HeadSlice(2, 4, 4)) is None
    result = cache.put(0, [A], [b""], quarter, HeadSlice(2, 4, 4))
    assert (result.num_stored, result.num_incomplete, cache.num_held()) == (1, 0, 1)


def test_an_incomplete_block_is_dropped_first_once_stale_and_never_before():
    now = [0.0]
    caches = [torch.zeros(3, 2, 16, 2, 8)]  # 2 store blocks
    cache = StoreCache([caches], read_guard_s=0.0, clock=lambda: now[0], incomplete_ttl_s=5.0)
    half = torch.ones(1, 1, 16 * 16 * 4 // 1, dtype=torch.uint8)  # 1 layer, 1 of 2 heads
    whole = torch.ones(1, 1, 2, 16, 2, 8)
    cache.put(0, [A], [b""], half, HeadSlice(0, 1, 2))  # a rank's part; its peer never writes
    cache.put(0, [B], [b""], whole)
    # Room needed while A's part is fresh: the held LRU block goes, A's part stays.
    cache.put(0, [C], [b""], whole)
    assert (cache.block_id_of(0, B), cache.num_incomplete(0)) == (None, 1)
    # Once A's part is older than the bound, it goes before any held block.
    now[0] = 6.0
    result = cache.put(0, [B], [b""], whole)
    assert result.num_stored == 1 and cache.num_incomplete(0) == 0
    assert cache.block_id_of(0, C) is not None and cache.block_id_of(0, B) is not None


def test_a_rank_holding_part_of_the_heads_in_a_layout_that_cannot_slice_them_refuses_the_store():
    mine, metadata = _rank(_model_caches(), 1, sliceable=False)
    sender = OffloadSender(store_address=("127.0.0.1", 9), max_inflight_bytes=1 << 20,
                           stats=KVTransferStats())
    with pytest.raises(KVTransferConfigError, match=r"store_url: .* holds KV heads \[1, 2\)"):
        sender.bind([mine], metadata, kv_heads_layout="tp2h2")


def _report(rank: int, outcomes) -> KVBridgeWorkerMeta:
    return KVBridgeWorkerMeta(tp_rank=rank, stats=StatsDelta(counters={
        "num_offloaded_blocks": sum(o[2] for o in outcomes)}, transfer_s=[], queue_s=[]),
        offload_outcomes=[tuple(o) for o in outcomes])


def test_the_ranks_offload_outcomes_settle_once_per_block_held_only_if_every_rank_s_was():
    stats = KVTransferStats()
    reports = RankReports(stats)
    reports.set_num_ranks(2)
    settled = reports.apply(_report(0, [OffloadOutcome(0, A, True), OffloadOutcome(0, B, True),
                                        OffloadOutcome(0, C, False, True)]))
    assert settled == [OffloadOutcome(0, C, False, True)]  # the store's name passes at once
    settled = reports.apply(_report(1, [OffloadOutcome(0, A, True), OffloadOutcome(0, B, False)]))
    assert settled == [OffloadOutcome(0, A, True), OffloadOutcome(0, B, False)]
    assert stats.num_offloaded_blocks == 1  # A once, not once per rank; B not at all
    assert reports.by_rank[0].num_offloaded_blocks == 2
    assert reports.by_rank[1].num_offloaded_blocks == 1
    # One step's reports: a missing name both ranks' puts met passes once; one only rank 1's
    # put met (it completed the child) passes too.
    settled = reports.apply_step([
        _report(0, [OffloadOutcome(0, C, True), OffloadOutcome(0, A, False, True)]),
        _report(1, [OffloadOutcome(0, A, False, True), OffloadOutcome(0, B, False, True),
                    OffloadOutcome(0, C, True)]),
    ])
    assert settled == [OffloadOutcome(0, A, False, True), OffloadOutcome(0, B, False, True),
                       OffloadOutcome(0, C, True)]
    assert stats.num_offloaded_blocks == 2


def test_a_writer_of_another_tensor_parallel_size_is_refused_by_the_store(store):
    caches = _model_caches()
    tp2 = _sender(store, *_rank(caches, 0))
    tp2.submit([OffloadItem(1, 0, A, b"")])
    tp2.wait_idle()
    whole = NodeMetadata.from_kv_caches(
        engine_id="tp1", kv_caches_by_group=[caches], model_name="m", hash_fn_name="sha256",
        kv_layout="vllm:test", hash_root="0123456789abcdef",
        kv_heads=KVHeads(first=0, total=HEADS, sliceable=True))
    tp1 = _sender(store, caches, whole, layout="")
    tp1.submit([OffloadItem(2, 0, B, b"")])
    tp1.wait_idle()
    assert tp1.take_outcomes() == [OffloadOutcome(0, B, False)]
    assert tp1.stats.num_offload_failures == 1
    assert store.profile.kv_heads_layout == "tp2h2" and store.cache.num_incomplete(0) == 1
    for sender in (tp1, tp2):
        sender.close()
