"""``load_mode`` ``"auto"`` (``connector.load_mode.LoadModePolicy``): a handoff loads inside
the step that computes it only when the worker half reads its holder one-sided, the model has
one KV cache group and the copy is small (and, with ``handoffs_only_alone``, its request is alone
in the engine); every other pull runs over later steps."""

from __future__ import annotations

import pytest
import torch
from kvbridge.connector.config import AUTO_SYNC_MAX_BYTES, KVTransferConfig
from kvbridge.connector.load_mode import LoadModePolicy
from kvbridge.connector.metadata import HolderRef, decode_worker_meta, encode_worker_meta
from kvbridge.connector.worker_half import KVBridgeWorker
from kvbridge.kvmanager.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvbridge.transport import BoardRef

BLOCK_NBYTES_PER_LAYER = 1024  # 2 x 16 tokens x 2 heads x 8 dims x 2 bytes
P = HolderRef(engine_id="prefill-0", incarnation="7", host="127.0.0.1", port=9)
P_BOARD = BoardRef("prefill-0", "7", pid=4321, board_address=4096, board_blocks=(64,),
                   probe_address=8192, probe=bytes(range(16)))


def _config(num_layers: int = 2) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    assert spec.page_size_bytes == BLOCK_NBYTES_PER_LAYER
    layers = [f"layer.{i}" for i in range(num_layers)]
    return KVCacheConfig(num_blocks=64, kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def _policy(load_mode: str = "auto", num_groups: int = 1) -> LoadModePolicy:
    policy = LoadModePolicy(load_mode, num_groups, _config())
    policy.observe([P_BOARD])
    return policy


# the largest handoff that still loads in the step: 2 layers x 1 KiB per block
MAX_BLOCKS = AUTO_SYNC_MAX_BYTES // (2 * BLOCK_NBYTES_PER_LAYER)


def test_a_small_handoff_from_a_one_sided_holder_loads_in_the_step():
    policy = _policy()
    assert policy.loads_in_step(P, 1, alone=False)
    assert policy.loads_in_step(P, MAX_BLOCKS, alone=False)
    assert not policy.loads_in_step(P, MAX_BLOCKS + 1, alone=False)  # a bigger copy stalls it


@pytest.mark.parametrize(
    "case", ["another incarnation", "not reported", "report withdrawn", "async", "sync",
             "several groups", "no config"]
)
def test_anything_else_runs_over_later_steps(case):
    policy = _policy()
    holder = P
    if case == "another incarnation":  # P restarted: its new process is not known yet
        holder = HolderRef(engine_id="prefill-0", incarnation="8", host="127.0.0.1", port=9)
    elif case == "not reported":
        policy = LoadModePolicy("auto", 1, _config())
    elif case == "report withdrawn":  # the worker dropped its connection to P
        policy.observe([])
    elif case in ("async", "sync"):  # "sync" is the scheduler half's own rule, not this one
        policy = _policy(load_mode=case)
    elif case == "several groups":  # vLLM refuses block-level sync load errors there
        policy = _policy(num_groups=2)
    else:
        policy = LoadModePolicy("auto", 1, None)
        policy.observe([P_BOARD])
    assert not policy.loads_in_step(holder, 1, alone=False)


def test_handoffs_only_alone_loads_in_the_step_only_a_request_alone_in_the_engine():
    """vLLM under ``recompute`` (``vllm.load_modes``): another request of the step could share
    a failed in-step load's blocks, so only a request alone in the engine loads in the step."""
    policy = LoadModePolicy("auto", 1, _config(), handoffs_only_alone=True)
    policy.observe([P_BOARD])
    assert not policy.loads_in_step(P, 1, alone=False)
    assert policy.loads_in_step(P, 1, alone=True)
    assert not policy.loads_in_step(P, MAX_BLOCKS + 1, alone=True)  # the size bound still holds


def test_an_unchanged_report_keeps_the_last_one():
    policy = _policy()
    policy.observe(None)
    assert policy.loads_in_step(P, 1, alone=False)


class _HolderListTransport:
    """Stands in for the worker's transport: only the holders it reads one-sided."""

    def __init__(self) -> None:
        self.holders: list[BoardRef] = []

    def one_sided_holders(self) -> list[BoardRef]:
        return list(self.holders)


def test_the_worker_half_reports_its_one_sided_holders_once_per_change():
    """Even in a step with nothing else to report (an engine drops empty reports), and through
    the wire encoding, into the scheduler half's policy."""
    worker = KVBridgeWorker(KVTransferConfig(transport="loopback"), _config(),
                            hash_fn_name="sha256")
    transport = _HolderListTransport()
    worker.transport = transport  # type: ignore[assignment]
    assert worker.build_connector_worker_meta().is_empty()  # none yet, none before
    transport.holders = [P_BOARD]
    meta = worker.build_connector_worker_meta()
    assert not meta.is_empty() and meta.one_sided_holders == [P_BOARD]
    assert worker.build_connector_worker_meta().is_empty()  # unchanged: not sent again
    policy = LoadModePolicy("auto", 1, _config())
    decoded = decode_worker_meta(encode_worker_meta(meta)).one_sided_holders
    assert decoded == [P_BOARD] and isinstance(decoded[0], BoardRef)  # where P's board is
    policy.observe(decoded)
    assert policy.loads_in_step(P, 1, alone=False) and policy.board_of(P) == P_BOARD
    transport.holders = []  # the connection to P was dropped
    meta = worker.build_connector_worker_meta()
    assert not meta.is_empty() and meta.one_sided_holders == []
    policy.observe(meta.one_sided_holders)
    assert not policy.loads_in_step(P, 1, alone=False)
