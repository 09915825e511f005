"""The harness checked against vLLM's own NixlConnector: the same P/D flow, no kvbridge in it.

If this passes and a kvbridge test fails, the fault is kvbridge's, not the node runner's
(``_node.py``), the prompts' or the reference's. It checks what the kvbridge tests rely on:
two engine processes alive at once, P's ticket travelling through ``kv_transfer_params``, D's
greedy tokens equal to the session's plain engine, and an in-process P that is stepped
between commands (``_node.py``): NixlConnector frees P's blocks only when a step sees D's
notification, so P's scheduler drains only if the node loop keeps stepping it.

Skipped when ``nixl`` is not in the venv (``KVBRIDGE_VLLM_NIXL=0 tests/vllm/make_venv.sh``).
"""

from __future__ import annotations

import importlib.util

import pytest
from _harness import Node, free_port, nixl_config, prefill_requests, request, start_nodes, tokens
from _prompts import N_NEW, PROMPTS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                reason="nixl is not installed in the vLLM venv")

NAMES = ["nixl_a", "nixl_b", "nixl_c", "t33"]
WARM_UP = tokens(9_901, 40)  # a prompt of no test's: only opens D's NIXL handshake to P
HANDSHAKE_TRIES = 3
NIXL_LEASE_S = 30  # NixlConnector's default kv_lease_duration: P frees a dropped ticket by then


def open_handshake(p: Node, d: Node) -> None:
    """One throwaway handover, retried, so D's handshake with P is open before the tokens the
    test compares; returns once P holds nothing again.

    vLLM's NIXL handshake waits at most a hard-coded 5 s for P's side-channel reply (its
    ``base_worker.py``, ``zmq.RCVTIMEO``); P's listener is a thread of a busy engine process,
    and on a loaded 2-core CI host it once answered late, which failed that request's load (a
    failure of the host, not of the flow this module checks). A failed handshake is retried
    by NIXL on the next request, and P frees the dropped ticket's blocks at its lease's end.
    """
    for failed in range(HANDSHAKE_TRIES):
        params = p.generate(prefill_requests([WARM_UP]))[0]["kv_transfer_params"]
        if d.generate([request(WARM_UP, 1, params)])[0]["finish_reason"] != "error":
            drained = p.wait_drained(timeout_s=30 + NIXL_LEASE_S * (failed > 0))
            assert drained["requests"] == 0, drained
            return
    raise AssertionError(f"D's NIXL handshake with P failed {HANDSHAKE_TRIES} times")


@pytest.fixture(scope="module")
def nixl_pair(tiny_llama, log_dir, reference):  # reference first: its engine is gone
    p = Node("nixl-p", model=tiny_llama, log_dir=log_dir,
             kv_transfer_config=nixl_config("producer", "nixl-prefill"),
             env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    d = Node("nixl-d", model=tiny_llama, log_dir=log_dir,
             kv_transfer_config=nixl_config("consumer", "nixl-decode"),
             env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    start_nodes(p, d)
    open_handshake(p, d)
    yield p, d
    d.stop()
    p.stop()


def test_nixl_handover_gives_single_instance_tokens(nixl_pair, reference):
    p, d = nixl_pair
    p_out = p.generate(prefill_requests([PROMPTS[n] for n in NAMES]))
    for name, o in zip(NAMES, p_out, strict=True):
        assert o["token_ids"] == reference[name][:1], name
        assert o["kv_transfer_params"]["do_remote_prefill"], o
    held = p.state()
    assert held["requests"] == len(NAMES), held  # delay-freed until D has read them
    d_out = d.generate([request(PROMPTS[n], N_NEW, o["kv_transfer_params"])
                        for n, o in zip(NAMES, p_out, strict=True)])
    assert {n: o["token_ids"] for n, o in zip(NAMES, d_out, strict=True)} == {
        n: reference[n] for n in NAMES}
    drained = p.wait_drained(timeout_s=30)
    assert drained["requests"] == 0, drained  # the idle loop stepped P
