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


def test_same_host_reads_are_on_unless_turned_off():
    assert _config().cma is True
    assert _config(cma=False).cma is False


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"cma": "no"}, "cma must be true or false, got 'no'"),
        ({"cma": 0}, "cma must be true or false, got 0"),
        ({"transport": "tcp"}, "transport must be one of"),
        ({"lease_s": 1.0, "heartbeat_interval_s": 2.0}, "must be shorter than lease_s"),
    ],
)
def test_bad_values_are_refused_by_name(extra, fragment):
    with pytest.raises(KVTransferConfigError) as info:
        _config(**extra)
    assert fragment in str(info.value)


def test_unknown_outer_key_is_refused():
    with pytest.raises(KVTransferConfigError, match="unknown kv_transfer_config keys"):
        KVTransferConfig.from_dict({"kv_connector": "KVBridgeConnector", "kv_parallel_size": 2})
