"""Fuzzing of ``kv_transfer_params`` and of the holder's block checks (issue 15, "Security").

Properties, each over hypothesis-generated input:

- ``RemotePrefillParams.parse`` of any mapping raises only ``KVTransferParamsError`` (naming a
  field), and what it accepts is in range.
- ``HolderChecks.validate_blocks`` never raises on ids, expected values and leases from the
  network and always refuses an id outside the node's pool or a lease it does not hold.
- Both nodes' HTTP APIs (kvbridge-node, a prefill and a decode node over the loopback
  transport, each behind its engine loop) answer random and mutated ``kv_transfer_params`` with
  200 or 400, never a server error; a 200 from the decode node carries exactly the tokens a
  single node computes (a ticket that names the wrong blocks is refused by P's checks and D
  recomputes, never reads foreign KV); a good request through both nodes is served after; and
  both nodes end with every block free.
"""

from __future__ import annotations

import math
import time
import warnings

import pytest
from _pd_builders import long_prompt, make_pd_pair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvbridge.connector.errors import KVTransferParamsError
from kvbridge.connector.holder import HeldBlockHashes, HolderChecks
from kvbridge.connector.lease import LeaseTable
from kvbridge.connector.stats import KVTransferStats
from kvbridge.connector.transfer_params import RemotePrefillParams
from kvbridge.transport import LeaseRef

pytestmark = pytest.mark.timeout(240)

_KEYS = [
    "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_incarnation",
    "remote_request_id", "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens",
    "remote_block_size", "lease_expires_at", "remote_lease_token",
]
_json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 65536]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=16),
)
_json = st.recursive(
    _json_leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5)
    ),
    max_leaves=16,
)


def _good_params() -> dict:
    return RemotePrefillParams(
        remote_engine_id="p0", remote_incarnation="i0", remote_request_id="p-req",
        remote_host="127.0.0.1", remote_port=4000, remote_block_ids=((1, 2, 3),),
        remote_num_tokens=40, remote_block_size=16, lease_expires_at=1e9,
    ).to_dict()


@st.composite
def _mutated(draw, base: dict) -> dict:
    """``base`` with up to three fields replaced by any JSON value, dropped, or added."""
    params = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(_KEYS))
        action = draw(st.sampled_from(["replace", "drop", "ids"]))
        if action == "replace":
            params[key] = draw(_json)
        elif action == "drop":
            params.pop(key, None)
        else:  # plausible block ids, in and out of every range
            params["remote_block_ids"] = draw(
                st.lists(st.lists(st.integers(-2, 300), max_size=5), max_size=2)
            )
    return params


@settings(max_examples=300, deadline=None)
@given(params=st.one_of(_mutated(_good_params()), _json))
def test_parse_raises_only_params_error_and_accepts_only_bounded_values(params):
    try:
        parsed = RemotePrefillParams.parse(params, num_groups=1, block_size=16)
    except KVTransferParamsError as exc:
        assert exc.args and str(exc)  # names the field
        return
    assert 1 <= parsed.remote_port <= 65535 and parsed.remote_num_tokens >= 1
    assert math.isfinite(parsed.lease_expires_at)
    (ids,) = parsed.remote_block_ids
    assert len(ids) == -(-parsed.remote_num_tokens // 16)
    assert all(0 <= b < 2**31 for b in ids)


@pytest.mark.parametrize(
    "key", ["remote_engine_id", "remote_incarnation", "remote_request_id", "remote_host"]
)
def test_a_string_longer_than_the_wire_allows_is_refused_at_admission(key):
    """Each of these travels in the pull's messages, whose schema caps a string at 512
    characters: a longer one is refused when the request is admitted, naming the field, not
    when the pull is read (where it would only fail the load)."""
    params = _good_params()
    params[key] = "x" * 512
    RemotePrefillParams.parse(params, num_groups=1, block_size=16)  # at the cap: accepted
    params[key] = "x" * 513
    with pytest.raises(KVTransferParamsError, match=f"{key}: at most 512 characters, got 513"):
        RemotePrefillParams.parse(params, num_groups=1, block_size=16)


_POOL_BLOCKS = 32


def _checks() -> tuple[HolderChecks, LeaseTable]:
    leases = LeaseTable(30.0)
    leases.grant("held", [[3, 4, 5]], [b"h3", b"h4"])
    checks = HolderChecks(
        leases=leases, hashes=HeldBlockHashes(), stats=KVTransferStats(),
        num_blocks=_POOL_BLOCKS, bytes_per_block=[1024],
    )
    return checks, leases


_expected_values = st.one_of(st.binary(max_size=12), st.sampled_from([b"", b"h3", b"h4"]))
_leases = st.one_of(
    st.none(),
    st.sampled_from([LeaseRef(request_id="held"), LeaseRef(request_id="other")]),
    st.builds(LeaseRef, request_id=st.text(min_size=1, max_size=8), token=st.text(max_size=8)),
)


@settings(max_examples=300, deadline=None)
@given(
    group_id=st.integers(0, 70),
    pairs=st.lists(
        st.tuples(st.integers(-(2**31), 2**31 + 5) | st.integers(-1, 40), _expected_values),
        max_size=12,
    ),
    lease=_leases,
)
def test_validate_blocks_refuses_every_block_outside_the_pool_or_the_lease(
    group_id, pairs, lease
):
    checks, leases = _checks()
    block_ids = [b for b, _ in pairs]
    expected = [h for _, h in pairs]
    bad = checks.validate_blocks(group_id, block_ids, expected, lease)
    assert bad == sorted(set(bad)) and all(0 <= p < len(pairs) for p in bad)
    for pos, (block_id, value) in enumerate(pairs):
        if not value and lease is None:
            continue  # b"" in a read under no lease: not checked (nothing named)
        if not 0 < block_id < _POOL_BLOCKS:
            assert pos in bad, (block_id, value)
        elif pos not in bad and not value:  # served by the read's lease alone: "held"'s
            assert lease == LeaseRef(request_id="held") and (group_id, block_id) == (0, 5)
        elif pos not in bad:  # served: only under the lease that holds it, at its hash
            assert group_id == 0 and block_id in (3, 4, 5), (block_id, value)
    assert leases.is_held("held")  # checks never end a lease


# ----------------------------------------------------------------------------- HTTP, both nodes

_PROMPT = long_prompt(40)


@pytest.fixture(scope="module")
def http_pair():
    """P and D (loopback transport) behind their engine loops and HTTP apps, and the tokens a
    single node computes for ``_PROMPT``."""
    with warnings.catch_warnings():  # starlette: "install httpx2"; the client works as it is
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    from kvbridge.connector.serve.node.loop import EngineLoop
    from kvbridge.connector.serve.node.server import build_app

    pair = make_pd_pair(lease_s=2.0, heartbeat_interval_s=0.05, load_timeout_s=2.0)
    single = make_pd_pair()
    expected = single.p.generate([_PROMPT], max_tokens=2)[0].token_ids  # no params: one node
    single.close()
    loops = {"p": EngineLoop(pair.p), "d": EngineLoop(pair.d)}
    clients = {}
    for name, role in (("p", "prefill"), ("d", "decode")):
        loops[name].start()
        app = build_app(loops[name], role=role, engine_id=f"{name}0", model_name="tiny")
        clients[name] = TestClient(app)
    yield pair, clients, expected
    # every lease ends (released by D, or expired after lease_s) and the loops go idle
    deadline = time.monotonic() + 15
    while not (pair.d.scheduler.is_empty() and pair.p.scheduler.is_empty()):
        assert time.monotonic() < deadline, (pair.p.scheduler.held_req_ids,
                                             pair.d.scheduler.held_req_ids)
        time.sleep(0.05)
    for loop in loops.values():
        loop.stop()
    for engine in (pair.p, pair.d):
        engine.kv_cache_manager.check_integrity()
        num_free = engine.kv_cache_manager.block_pool.get_num_free_blocks()
        assert num_free == engine.config.num_blocks - 1  # no block leaked


def _ticket(clients) -> dict:
    reply = clients["p"].post(
        "/v1/completions",
        json={"prompt": _PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def _decode(clients, params) -> tuple[int, list[int] | None]:
    reply = clients["d"].post(
        "/v1/completions", json={"prompt": _PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    )
    tokens = reply.json()["choices"][0]["token_ids"] if reply.status_code == 200 else None
    return reply.status_code, tokens


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_both_nodes_answer_random_params_with_200_or_400_and_right_tokens(http_pair, data):
    _, clients, expected = http_pair
    base = _ticket(clients)
    params = data.draw(st.one_of(_mutated(base), _mutated(base), _json))
    status, tokens = _decode(clients, params)
    assert status in (200, 400), status
    if status == 200:
        assert tokens == expected  # pulled the right KV, or recomputed: never foreign KV
    to_p = data.draw(st.one_of(_json, st.just({"do_remote_decode": True}), _mutated(base)))
    reply = clients["p"].post(
        "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": to_p}
    )
    assert reply.status_code in (200, 400), reply.text
    # the ticket's own lease is either used above or ends at its expiry (2 s): both are fine


def test_a_good_request_through_both_nodes_after_the_fuzzing(http_pair):
    pair, clients, expected = http_pair
    status, tokens = _decode(clients, _ticket(clients))
    assert (status, tokens) == (200, expected)
    assert pair.d.scheduler.connector.stats.snapshot()["num_loads"] >= 1
