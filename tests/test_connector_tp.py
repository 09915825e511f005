"""Tensor-parallel handoffs between the connector's halves, without vLLM (issue 30).

A P engine of ``p`` ranks and a D engine of ``d`` ranks of one model (``TOTAL_HEADS`` KV heads,
each rank holding its run of them, head-major as vLLM's CPU backend lays them out): P's
scheduler half names every rank in its ticket, D's scheduler half plans one pull, and every D
rank pulls exactly its own heads from the P rank(s) that hold them. What must hold: D's blocks
equal the model's, each P rank's lease ends once every D rank has let go (and not before), the
node counts the request once whatever its ranks, and a ticket that sends a D rank to a P rank
holding other heads fails the load instead of landing the wrong heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from kvbridge.connector import KVTransferConfig
from kvbridge.connector.lease import LeaseTable
from kvbridge.connector.metadata import KVBridgeConnectorMetadata
from kvbridge.connector.scheduler_half import KVBridgeScheduler
from kvbridge.connector.tp_layout import TPLayout
from kvbridge.connector.vllm.request_view import RequestView
from kvbridge.connector.worker_half import KVBridgeWorker
from kvbridge.kvmanager.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvbridge.kvmanager.request import RequestStatus
from kvbridge.transport import LoopbackNetwork

pytestmark = pytest.mark.timeout(60)

TOTAL_HEADS = 4
BLOCK_SIZE = 2
HEAD_SIZE = 2
NUM_BLOCKS = 16
LAYERS = ("layer.0", "layer.1")
NUM_TOKENS = 7  # P's blocks 0..3, the last one partial
P_BLOCKS = [3, 5, 6, 9]
D_BLOCKS = [12, 2, 7, 4]
NUM_PULLED = 3  # D recomputes the last prompt token: tokens 0..5, blocks 0..2


def _model(seed: int) -> dict[str, torch.Tensor]:
    """Every layer's KV of the whole model, ``[num_blocks, TOTAL_HEADS, block_size,
    2 * head_size]``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, TOTAL_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return {name: torch.randn(shape, generator=generator) for name in LAYERS}


@dataclass
class Engine:
    """One engine: its scheduler half and one worker half per rank, the model's KV as each
    rank holds it (``head_major[rank][layer]``)."""

    scheduler: KVBridgeScheduler
    workers: list[KVBridgeWorker]
    head_major: list[dict[str, torch.Tensor]]

    def step(self, meta: KVBridgeConnectorMetadata) -> list[tuple[set[str], set[str]]]:
        """One step of every rank with the same orders (vLLM broadcasts them); each rank's
        report goes to the scheduler half. Returns each rank's (sending, recving)."""
        finished = []
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv()
            worker.wait_for_save()
            sending, recving = worker.get_finished(set())
            worker.clear_connector_metadata()
            self.scheduler.update_connector_output(worker.build_connector_worker_meta())
            finished.append((sending or set(), recving or set()))
        return finished

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def _engine(name: str, role: str, tp_size: int, model: dict[str, torch.Tensor] | None,
            network: LoopbackNetwork, sliceable: bool = True) -> Engine:
    config = KVTransferConfig.from_dict({
        "engine_id": name, "kv_role": role,
        "kv_connector_extra_config": {"transport": "loopback", "model_name": "tiny",
                                      "load_failure_policy": "recompute"},
    })
    workers, head_major = [], []
    for rank in range(tp_size):
        layout = TPLayout(tp_rank=rank, tp_size=tp_size, total_num_kv_heads=TOTAL_HEADS,
                          heads_sliceable=sliceable)
        first, stop = layout.heads
        held = stop - first
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=held, head_size=HEAD_SIZE,
                                 dtype=torch.float32)
        kv_config = KVCacheConfig(num_blocks=NUM_BLOCKS,
                                  kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
        rank_kv = {
            layer: (torch.zeros(NUM_BLOCKS, held, BLOCK_SIZE, 2 * HEAD_SIZE) if model is None
                    else model[layer][:, first:stop].contiguous())
            for layer in LAYERS
        }
        worker = KVBridgeWorker(config, kv_config, hash_fn_name="sha256",
                                loopback_network=network)
        views = {layer: t.view(NUM_BLOCKS, 2, BLOCK_SIZE, held, HEAD_SIZE)
                 for layer, t in rank_kv.items()}
        worker.register_kv_caches(views, tp_layout=layout)
        workers.append(worker)
        head_major.append(rank_kv)
    scheduler = KVBridgeScheduler(config, block_size=BLOCK_SIZE, num_groups=1,
                                  hash_fn_name="sha256")
    scheduler.set_xfer_handshake_metadata(
        {rank: worker.get_handshake_metadata() for rank, worker in enumerate(workers)}
    )
    return Engine(scheduler, workers, head_major)


def _request(request_id: str, params: dict, status=RequestStatus.WAITING) -> RequestView:
    hashes = [f"h{i}".encode() for i in range(NUM_TOKENS // BLOCK_SIZE)]
    return RequestView(request_id=request_id, kv_transfer_params=params,
                       num_prompt_tokens=NUM_TOKENS, num_tokens=NUM_TOKENS + 1,
                       block_hashes=hashes, skip_reading_prefix_cache=False, status=status)


class _Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(D_BLOCKS),)


def _prefill(p: Engine) -> dict:
    """P finished its request: the ticket D gets; every P rank now holds the lease."""
    done = _request("p-1", {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED)
    result = p.scheduler.request_finished(done, ([*P_BLOCKS, 0],))
    assert result.delay_free
    p.step(p.scheduler.build_connector_meta(None))
    assert all(len(w.leases) == 1 for w in p.workers)
    return result.kv_transfer_params


def _decode(d: Engine, p: Engine, params: dict, timeout_s: float = 20.0,
            wait_for_p: bool = True) -> list[set[str]]:
    """D plans and runs the pull, P steps meanwhile; returns each P rank's finished_sending
    once every D rank reported the request (and, with ``wait_for_p``, every P rank too)."""
    view = _request("d-1", params)
    d.scheduler.validate_kv_transfer_params("d-1", params, NUM_TOKENS)
    matched = d.scheduler.get_num_new_matched_tokens(view, 0)
    assert matched.num_external_tokens == NUM_TOKENS - 1
    d.scheduler.update_state_after_alloc(view, _Blocks(), matched.num_external_tokens)
    meta = d.scheduler.build_connector_meta(None)
    assert len(meta.pulls) == 1
    recving = [r for _, r in d.step(meta)]
    sending: list[set[str]] = [set() for _ in p.workers]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (
        all("d-1" in r for r in recving) and (not wait_for_p or all("p-1" in s for s in sending))
    ):
        time.sleep(0.01)
        for rank, (_, r) in enumerate(d.step(KVBridgeConnectorMetadata())):
            recving[rank] |= r
        for rank, (s, _) in enumerate(p.step(KVBridgeConnectorMetadata())):
            sending[rank] |= s
    assert all("d-1" in r for r in recving), recving
    return sending


def _assert_d_holds_the_models_heads(d: Engine, model: dict[str, torch.Tensor]) -> None:
    for rank, worker in enumerate(d.workers):
        first, stop = worker.tp_layout.heads
        for layer in LAYERS:
            expected = model[layer][P_BLOCKS[:NUM_PULLED]][:, first:stop]
            landed = d.head_major[rank][layer][D_BLOCKS[:NUM_PULLED]]
            assert torch.equal(landed, expected), (rank, layer)


@pytest.fixture
def engines():
    made: list[Engine] = []
    network = LoopbackNetwork()

    def make(p_size: int, d_size: int, seed: int = 3, p_sliceable: bool = True):
        model = _model(seed)
        p = _engine("prefill", "kv_producer", p_size, model, network, p_sliceable)
        made.append(p)
        d = _engine("decode", "kv_consumer", d_size, None, network)
        made.append(d)
        return p, d, model

    yield make
    for engine in made:
        engine.close()


@pytest.mark.parametrize(("p_size", "d_size"), [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2), (1, 4)])
def test_each_decode_rank_pulls_its_heads_and_every_prefill_rank_lets_go_once(
        engines, p_size, d_size):
    p, d, model = engines(p_size, d_size)
    params = _prefill(p)
    if p_size > 1:
        assert params["remote_tp_size"] == p_size and len(params["remote_ranks"]) == p_size
    else:  # a ticket of one rank is as it always was
        assert "remote_tp_size" not in params and "remote_ranks" not in params
    sending = _decode(d, p, params)
    assert sending == [{"p-1"}] * p_size  # each rank's lease ended, once
    assert all(not w.get_block_ids_with_load_errors() for w in d.workers)
    _assert_d_holds_the_models_heads(d, model)
    stats = d.scheduler.stats
    assert (stats.num_loads, stats.num_failed_loads) == (1, 0)  # once, not once per rank
    assert stats.num_blocks_received == NUM_PULLED
    head_nbytes = BLOCK_SIZE * 2 * HEAD_SIZE * 4
    heads_per_rank = TOTAL_HEADS // d_size
    for rank in range(d_size):
        by_rank = d.scheduler.rank_reports.by_rank[rank]
        assert by_rank.num_loads == 1
        assert by_rank.bytes_received == NUM_PULLED * len(LAYERS) * heads_per_rank * head_nbytes
    assert stats.bytes_received == NUM_PULLED * len(LAYERS) * TOTAL_HEADS * head_nbytes
    assert p.scheduler.stats.num_released_leases == 1


def test_a_prefill_rank_keeps_its_lease_until_every_decode_rank_let_go(engines):
    """P of one rank read by D of two: D rank 0's notice alone ends nothing."""
    p, _, _ = engines(1, 2)
    params = _prefill(p)
    leases = p.workers[0].leases
    assert not leases.release("p-1", params["remote_lease_token"], 0, 2)
    assert leases.is_held("p-1")
    assert not leases.release("p-1", params["remote_lease_token"], 0, 2)  # a repeat: still held
    assert leases.release("p-1", params["remote_lease_token"], 1, 2)
    assert leases.pop_finished() == ({"p-1"}, 0)


@pytest.mark.parametrize("early_ranks", [[0], [0, 1]])
def test_releases_that_come_before_the_grant_count_per_puller_rank(early_ranks):
    """A fast puller's notices may reach a rank before its lease grant (the grant waits for
    the holder's next step): the grant then ends at once only if every puller rank's came;
    a release presenting another token counts for nothing."""
    leases = LeaseTable(lease_s=30.0)
    assert not leases.release("p-1", "bad", 1, 2)
    for rank in early_ranks:
        assert not leases.release("p-1", "tok", rank, 2)
    leases.grant("p-1", [[1, 2]], token="tok")
    if early_ranks == [0, 1]:
        assert not leases.is_held("p-1") and leases.pop_finished() == ({"p-1"}, 0)
        return
    assert leases.is_held("p-1")
    assert leases.release("p-1", "tok", 1, 2)
    assert leases.pop_finished() == ({"p-1"}, 0)


def _swap_ranks(params: dict, a: int, b: int) -> dict:
    """The ticket with P's ranks ``a`` and ``b`` swapped, consistently (rank 0's fields too):
    what a proxy or a P that mixed up its ranks would hand D."""
    ranks = list(params["remote_ranks"])
    ranks[a], ranks[b] = ranks[b], ranks[a]
    first = ranks[0]
    return {**params, "remote_ranks": ranks, "remote_host": first["host"],
            "remote_port": first["port"], "remote_incarnation": first["incarnation"]}


def test_a_ticket_naming_the_wrong_prefill_ranks_fails_the_load_never_loads_other_heads(
        engines):
    """Every D rank is sent to the P rank holding the other heads: each holder refuses, every
    block is a load error (D recomputes), and D's blocks are untouched."""
    p, d, _ = engines(2, 2)
    params = _swap_ranks(_prefill(p), 0, 1)
    sending = _decode(d, p, params)
    assert sending == [{"p-1"}, {"p-1"}]  # the failed pulls still release both ranks
    for rank, worker in enumerate(d.workers):
        assert worker.get_block_ids_with_load_errors() == set(D_BLOCKS[:NUM_PULLED]), rank
        for layer in LAYERS:
            assert not d.head_major[rank][layer].any()
    assert (d.scheduler.stats.num_loads, d.scheduler.stats.num_failed_loads) == (0, 1)


def test_a_decode_rank_that_plans_another_ranks_heads_fails_its_load(engines):
    """D rank 1 plans its pull as if it were rank 0 (its reads ask for heads its blocks do not
    hold): refused before anything moves; rank 0's part lands; the request fails once."""
    p, d, _ = engines(2, 2)
    d.workers[1].puller.tp_layout = d.workers[0].tp_layout
    _decode(d, p, _prefill(p), wait_for_p=False)  # its notices also name rank 0: P waits
    assert d.workers[1].get_block_ids_with_load_errors() == set(D_BLOCKS[:NUM_PULLED])
    assert not d.workers[0].get_block_ids_with_load_errors()
    assert not any(d.head_major[1][layer].any() for layer in LAYERS)
    assert (d.scheduler.stats.num_loads, d.scheduler.stats.num_failed_loads) == (0, 1)


def test_an_engine_that_names_no_heads_refuses_a_tensor_parallel_ticket(engines):
    p, _, _ = engines(2, 1)
    params = _prefill(p)
    config = KVTransferConfig.from_dict({
        "engine_id": "plain", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"transport": "loopback", "model_name": "tiny"},
    })
    plain = KVBridgeScheduler(config, block_size=BLOCK_SIZE, num_groups=1, hash_fn_name="sha256")
    from kvbridge.connector.errors import KVTransferParamsError
    from kvbridge.connector.metadata import WorkerHandshake
    from kvbridge.transport import BlockIdentity

    identity = BlockIdentity(model_name="tiny", kv_cache_dtype="float32", block_size=BLOCK_SIZE,
                             hash_fn_name="sha256")
    plain.set_xfer_handshake_metadata(WorkerHandshake(engine_id="plain", incarnation="1",
                                                      host="127.0.0.1", port=1,
                                                      identity=identity))
    with pytest.raises(KVTransferParamsError, match="remote_tp_size: 2: this engine does not"):
        plain.validate_kv_transfer_params("d-1", params, NUM_TOKENS)


def test_a_prefill_whose_layout_cannot_serve_a_head_slice_fails_naming_both_sizes(
        engines, caplog):
    """P of one rank whose blocks do not keep a run of heads in one byte range (FlashAttention's
    "NHD"), D of two ranks: each D rank's pull fails before any read, its warning naming both
    tensor-parallel sizes and the head count; D recomputes; P is released."""
    p, d, _ = engines(1, 2, p_sliceable=False)
    sending = _decode(d, p, _prefill(p))
    assert sending == [{"p-1"}]
    assert all(w.get_block_ids_with_load_errors() == set(D_BLOCKS[:NUM_PULLED]) for w in d.workers)
    assert "prefill tp_size 1, decode tp_size 2, 4 KV heads: KV heads [0, 2) of this node's " \
        "[0, 4) are not one byte range" in caplog.text
