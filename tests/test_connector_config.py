"""``KVTransferConfig.from_dict``: vLLM-shaped settings, each bad value refused by name."""

from __future__ import annotations

import pytest
from kvbridge.connector.config import KVTransferConfig
from kvbridge.connector.errors import KVTransferConfigError


def _config(**extra) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "KVBridgeConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


def test_same_host_reads_follow_the_environment_unless_set(monkeypatch):
    """``cma`` unset leaves the choice to the transport (on unless ``KVBRIDGE_CMA=0``)."""
    pytest.importorskip("ucxx")
    from _transport_helpers import make_kv_caches, make_metadata
    from kvbridge.transport import UcxxTransport

    assert _config().cma is None
    assert _config(cma=False).cma is False
    caches = make_kv_caches(seed=0)
    metadata = make_metadata("config", caches)
    monkeypatch.setenv("KVBRIDGE_CMA", "0")
    assert not UcxxTransport(metadata, caches, cma=_config().cma).cma_enabled
    assert UcxxTransport(metadata, caches, cma=_config(cma=True).cma).cma_enabled
    monkeypatch.delenv("KVBRIDGE_CMA")
    assert UcxxTransport(metadata, caches, cma=_config().cma).cma_enabled


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"cma": "no"}, "cma must be true, false or null, got 'no'"),
        ({"cma": 0}, "cma must be true, false or null, got 0"),
        ({"transport": "tcp"}, "transport must be one of"),
        ({"lease_s": 1.0, "heartbeat_interval_s": 2.0}, "must be shorter than lease_s"),
        ({"idle_pull_wait_s": -0.1}, "idle_pull_wait_s must be in [0, 1], got -0.1"),
        ({"idle_pull_wait_s": 5}, "idle_pull_wait_s must be in [0, 1], got 5"),
        ({"idle_hold_wait_s": -1}, "idle_hold_wait_s must be in [0, 1], got -1"),
        ({"load_mode": "eager"}, "load_mode must be one of ('auto', 'async', 'sync'), got 'eager'"),
        ({"sync_load_timeout_s": 0}, "sync_load_timeout_s must be > 0, got 0"),
        ({"index_socket_timeout_s": 0}, "index_socket_timeout_s must be > 0, got 0"),
        ({"offload_remember_blocks": 0}, "offload_remember_blocks must be an int >= 1, got 0"),
        ({"min_remote_hit_tokens": -1}, "min_remote_hit_tokens must be an int >= 0, got -1"),
        ({"min_remote_hit_tokens": 1.5}, "min_remote_hit_tokens must be an int >= 0, got 1.5"),
    ],
)
def test_bad_values_are_refused_by_name(extra, fragment):
    with pytest.raises(KVTransferConfigError) as info:
        _config(**extra)
    assert fragment in str(info.value)


def test_unknown_outer_key_is_refused():
    with pytest.raises(KVTransferConfigError, match="unknown kv_transfer_config keys"):
        KVTransferConfig.from_dict({"kv_connector": "KVBridgeConnector", "kv_parallel_size": 2})


@pytest.mark.parametrize(
    ("value", "on"),
    [("0", False), ("false", False), ("OFF", False), ("no", False), ("1", True), ("", True)],
)
def test_kvbridge_cma_environment_values(monkeypatch, value, on):
    pytest.importorskip("ucxx")
    from kvbridge.transport.cma import cma_from_environment

    monkeypatch.setenv("KVBRIDGE_CMA", value)
    assert cma_from_environment() is on


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # a near miss names the key meant
        ({"idx_url": "memory"}, "'idx_url' (did you mean 'index_url'?)"),
        ({"load_timeout": 5}, "'load_timeout' (did you mean 'load_timeout_s'?)"),
        # nothing close: the key alone, then the list to choose from
        ({"colour": "blue"}, "unknown kv_connector_extra_config key(s): 'colour'; remove them"),
    ],
)
def test_an_unknown_extra_key_is_one_line_that_says_what_to_change(extra, expected):
    with pytest.raises(KVTransferConfigError) as info:
        _config(**extra)
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert "use one of the known keys: " in message and "index_url" in message
