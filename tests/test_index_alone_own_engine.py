"""Which requests count as in the engine for the index's lone-request rules
(``IndexMatcher.admit`` / ``forget``: ``idle_lookup_wait_s``, a lone hit loaded inside its step)
on kvbridge's own engine: every queued request, with or without ``kv_transfer_params``, and
never one refused at admission (it never reaches ``request_finished``)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from _engine_builders import tiny_model
from _pd_builders import long_prompt
from kvbridge.connector.factory import create_engine
from kvbridge.kvmanager import SamplingParams
from kvbridge.kvmanager.engine import EngineConfig
from kvbridge.transport import LoopbackNetwork

BLOCK_SIZE = 16
_names = itertools.count()


def _node(network, **extra):
    config = EngineConfig(num_blocks=160, block_size=BLOCK_SIZE, max_model_len=1100,
                          max_num_batched_tokens=1100)
    kv = {"kv_role": "kv_both", "engine_id": f"alone-{next(_names)}",
          "kv_connector_extra_config": {
              "transport": "loopback", "index_url": "memory",
              "model_name": f"alone-{time.time_ns()}", "index_ttl_s": 60.0, **extra}}
    return create_engine(tiny_model(hybrid=False), config, kv, loopback_network=network)


def _matcher(engine):
    return engine.scheduler.connector.scheduler_half._index_matcher


def test_a_request_refused_at_admission_is_not_left_live():
    # A malformed ticket is refused by kvmanager.Engine.add_request: nothing is queued and
    # request_finished never comes, so the request must never have counted as live (one id
    # left per refusal would make no request ever alone again).
    engine = _node(LoopbackNetwork())
    try:
        for i in range(3):
            with pytest.raises(ValueError):
                engine.add_request(f"bad-{i}", long_prompt(40),
                                   SamplingParams(max_tokens=1),
                                   kv_transfer_params={"do_remote_prefill": True})
        assert not engine.scheduler.requests
        assert _matcher(engine)._live == set()
    finally:
        engine.shutdown()


def test_no_alone_wait_while_a_plain_request_is_running():
    # A plain request (no kv_transfer_params) decoding in the engine counts as live: a request
    # arriving with params (a P/D proxy's do_remote_decode) is not alone, so its lookup never
    # holds up schedule() (up to idle_lookup_wait_s) while the other has a step to run.
    engine = _node(LoopbackNetwork(), idle_lookup_wait_s=0.5, index_lookup_timeout_s=5.0)
    try:
        engine.add_request("plain", long_prompt(40, salt="plain "), SamplingParams(max_tokens=20))
        engine.step()  # its prefill; it decodes in the next steps
        index = engine.scheduler.connector.scheduler_half.index_client.index
        released = threading.Event()
        for name in ("longest_prefix", "longest_prefixes"):
            original = getattr(index, name)

            def held(*args, _original=original, **kwargs):
                released.wait(5.0)
                return _original(*args, **kwargs)

            setattr(index, name, held)
        engine.add_request("with-params", long_prompt(20 * BLOCK_SIZE + 3),
                           SamplingParams(max_tokens=1),
                           kv_transfer_params={"do_remote_decode": True})  # a P/D proxy's
        started = time.monotonic()
        engine.step()  # "plain" decodes here
        took = time.monotonic() - started
        released.set()
        assert took < 0.3, f"a step with a running request waited {took:.3f} s for a lookup"
    finally:
        released.set()
        engine.shutdown()
