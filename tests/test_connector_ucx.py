"""1P1D over UCX between two real processes (issue 5): the prefill node runs in a child process
with a ``UcxxTransport``; the decode node runs here and pulls the prompt's KV over UCX into blocks
it allocated up front. D's greedy tokens must equal a single-node run of the same model. The
last test runs both nodes on IPv6 loopback (``::1``, issue 28 item 2)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any

import pytest
from _engine_builders import reference_greedy, tiny_model
from _ipv6 import require_ipv6_loopback
from _pd_builders import assert_node_empty, long_prompt, run_to_completion
from kvbridge.connector.factory import create_engine
from kvbridge.kvmanager import SamplingParams
from kvbridge.kvmanager.engine import Engine, EngineConfig

BLOCK_SIZE = 16
MAX_TOKENS = 4
_REPLY_TIMEOUT_S = 60.0


def _node(
    engine_id: str, role: str, *, hybrid: bool, cma: bool = True, host: str = "127.0.0.1",
    model_name: str = "kvbridge",
) -> Engine:
    config = EngineConfig(num_blocks=128, block_size=BLOCK_SIZE, max_model_len=512)
    kv_transfer_config = {
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "transport": "ucxx",
            "host": host,
            "port": 0,
            "load_timeout_s": 20.0,
            "heartbeat_interval_s": 0.5,
            "cma": cma,
            "model_name": model_name,
        },
    }
    return create_engine(tiny_model(hybrid=hybrid), config, kv_transfer_config)


def _prefill_node_main(conn: Any, hybrid: bool, host: str = "127.0.0.1") -> None:
    """Child process: a prefill node listening on ``host``, answering ("prefill", request_id,
    prompt) with its kv_transfer_params, stepping its engine between commands (leases, release
    notices)."""
    engine = _node("prefill-ucx", "kv_producer", hybrid=hybrid, host=host)
    conn.send("ready")
    try:
        while True:
            if conn.poll(0.01):
                command = conn.recv()
                if command[0] == "stop":
                    break
                if command[0] == "holds":  # the leases and used blocks P holds now
                    pool = engine.kv_cache_manager.block_pool
                    leases = len(engine.runner.connector.worker_half.leases)
                    conn.send((leases, 127 - pool.get_num_free_blocks()))
                    engine.step()
                    continue
                _, request_id, prompt = command
                engine.add_request(
                    request_id,
                    prompt,
                    SamplingParams(max_tokens=1),
                    kv_transfer_params={"do_remote_decode": True},
                )
                output = run_to_completion(engine, request_id)
                engine.step()  # hands the lease grant to the worker half before D can pull
                conn.send(output.kv_transfer_params)
            engine.step()
        engine_ok = engine.scheduler.is_empty()
        engine.kv_cache_manager.check_integrity()
        conn.send(("stopped", engine_ok, engine.kv_cache_manager.block_pool.get_num_free_blocks()))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("path", ["cma", "ucx"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_decode_pulls_over_ucx_from_a_prefill_process(hybrid, path):
    """Both data paths: same-host copy (the default between processes on one host) and UCX
    tag messages (``cma`` off on D, as between hosts)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_node_main, args=(child, hybrid), daemon=True)
    proc.start()
    d = None
    try:
        assert parent.poll(_REPLY_TIMEOUT_S) and parent.recv() == "ready"
        d = _node("decode-ucx", "kv_consumer", hybrid=hybrid, cma=path == "cma")
        # 1 token, block size - 1, block size, block size + 1, many blocks.
        for i, num_tokens in enumerate([1, 15, 16, 17, 150]):
            prompt = long_prompt(num_tokens, salt=f"Prompt {i}. ")  # no shared prefixes
            request_id = f"req-{i}"
            # (1) P prefills in the other process and answers with its kv_transfer_params.
            parent.send(("prefill", request_id, prompt))
            assert parent.poll(_REPLY_TIMEOUT_S)
            params = parent.recv()
            assert params["remote_num_tokens"] == num_tokens
            # (2) D pulls over UCX, recomputes the last token, decodes.
            d.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
            output = run_to_completion(d, request_id, timeout_s=_REPLY_TIMEOUT_S)
            assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=hybrid)
            assert output.num_cached_tokens == num_tokens - 1  # the last token is recomputed
        transport = d.runner.connector.worker_half.transport
        assert {transport.peer_data_path(peer) for peer in transport._conns} == {path}
        # Every same-host pull is checked on P's block board alone (P granted the lease before
        # answering, and nothing changes P's blocks meanwhile), none falls back to asking P.
        one_sided = 4 if path == "cma" else 0
        counts = transport.board_counts
        assert (counts.one_sided, counts.fallbacks) == (one_sided, 0)
        stats = d.scheduler.connector.stats.snapshot()
        # The 1-token prompt has nothing to pull (D only tells P to release); 4 pulls landed.
        assert (stats["num_loads"], stats["num_failed_loads"]) == (4, 0)
        assert stats["bytes_received"] > 0
        same_host = stats["bytes_received"] if path == "cma" else 0
        assert stats["bytes_received_same_host"] == same_host
        assert (stats["num_one_sided_loads"], stats["num_board_fallbacks"]) == (one_sided, 0)
        # load_mode "auto": once D's worker reads P one-sided (connected since the 1-token
        # prompt's release notice), a full-attention handoff loads in the step that computes
        # it; a hybrid model's handoffs always run over later steps
        sync = 4 if path == "cma" and not hybrid else 0
        assert stats["num_sync_loads"] == sync
        assert_node_empty(d)
        # (3) Every completion notice reached P: it ends with nothing held, every block free.
        parent.send(("stop",))
        assert parent.poll(_REPLY_TIMEOUT_S)
        tag, p_empty, p_free = parent.recv()
        assert (tag, p_empty, p_free) == ("stopped", True, 127)
    finally:
        if d is not None:
            d.shutdown()
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("path", ["cma", "ucx"])
def test_decode_pulls_a_handoff_from_a_prefill_process_over_ipv6_loopback(path):
    """Both nodes listen on ``::1``: P's ticket names ``remote_host`` ``"::1"`` (bare; the port
    is a field of its own), D dials it for the handshake, the lease and the read, and the KV
    lands, over UCX or by a same-host copy."""
    require_ipv6_loopback()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_node_main, args=(child, False, "::1"), daemon=True)
    proc.start()
    d = None
    try:
        assert parent.poll(_REPLY_TIMEOUT_S) and parent.recv() == "ready"
        d = _node("decode-ucx", "kv_consumer", hybrid=False, cma=path == "cma", host="::1")
        prompt = long_prompt(3 * BLOCK_SIZE + 5)
        # (1) P prefills in the other process; its ticket names it by its IPv6 address.
        parent.send(("prefill", "req-6", prompt))
        assert parent.poll(_REPLY_TIMEOUT_S)
        params = parent.recv()
        assert params["remote_host"] == "::1"
        # (2) D pulls from [::1]:remote_port, recomputes the last token, decodes.
        d.add_request("req-6", prompt, SamplingParams(max_tokens=MAX_TOKENS), params)
        output = run_to_completion(d, "req-6", timeout_s=_REPLY_TIMEOUT_S)
        assert output.token_ids == reference_greedy(prompt, MAX_TOKENS, hybrid=False)
        assert output.num_cached_tokens == len(prompt) - 1
        transport = d.runner.connector.worker_half.transport
        assert transport.address.host == "::1"
        assert [tuple(peer) for peer in transport._conns] == [("::1", params["remote_port"])]
        stats = d.scheduler.connector.stats.snapshot()
        assert (stats["num_loads"], stats["num_failed_loads"]) == (1, 0)
        assert_node_empty(d)
        # (3) D's completion notice reached P over ::1: nothing held there, every block free.
        parent.send(("stop",))
        assert parent.poll(_REPLY_TIMEOUT_S)
        assert parent.recv() == ("stopped", True, 127)
    finally:
        if d is not None:
            d.shutdown()
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("path", ["cma", "ucx"])
def test_a_refused_handoff_frees_the_prefill_process_blocks_within_a_second(path, caplog):
    """Issue 28, item 3, between processes: D refuses P's handoff (an incompatible D, whose
    pull's handshake P refuses; a malformed ticket refused at admission, where D's notice is
    its first contact with P). P, with the default 30 s lease, holds nothing a second later."""
    caplog.set_level(logging.CRITICAL, logger="kvbridge.connector")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_node_main, args=(child, False), daemon=True)
    proc.start()
    nodes: list[Engine] = []
    try:
        assert parent.poll(_REPLY_TIMEOUT_S) and parent.recv() == "ready"
        incompatible = _node("decode-other", "kv_consumer", hybrid=False, cma=path == "cma",
                             model_name="another-model")
        compatible = _node("decode-ucx", "kv_consumer", hybrid=False, cma=path == "cma")
        nodes += [incompatible, compatible]
        for i, (d, how) in enumerate([(incompatible, "incompatible"), (compatible, "malformed")]):
            prompt = long_prompt(40, salt=f"Prompt {i}. ")
            parent.send(("prefill", f"req-{i}", prompt))
            assert parent.poll(_REPLY_TIMEOUT_S)
            params = parent.recv()
            parent.send(("holds",))
            assert parent.poll(_REPLY_TIMEOUT_S) and parent.recv()[0] == 1
            started = time.monotonic()
            if how == "incompatible":  # its pull fails at the handshake
                d.add_request(f"req-{i}", prompt, SamplingParams(max_tokens=1), params)
            else:
                with pytest.raises(ValueError, match="remote_block_ids"):
                    d.add_request(f"req-{i}", prompt, SamplingParams(max_tokens=1),
                                  params | {"remote_block_ids": [["x"]]})
            holds = (1, -1)
            while holds != (0, 0) and time.monotonic() - started < 1.0:
                d.step()
                parent.send(("holds",))
                assert parent.poll(_REPLY_TIMEOUT_S)
                holds = parent.recv()
            assert holds == (0, 0), f"{how}: P holds {holds} after {time.monotonic() - started}"
            assert_node_empty(d)
        parent.send(("stop",))
        assert parent.poll(_REPLY_TIMEOUT_S)
        assert parent.recv() == ("stopped", True, 127)
    finally:
        for node in nodes:
            node.shutdown()
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
