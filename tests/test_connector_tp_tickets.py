"""The tensor-parallel fields of a handoff ticket (``transfer_params``, issue 30): what a P of
several ranks writes, what D accepts, and the per-request error naming the field for every bad
value (the ticket comes over the network). A ticket of a P of one rank is unchanged."""

from __future__ import annotations

import pytest
from kvbridge.connector.errors import KVTransferParamsError
from kvbridge.connector.tp_layout import TPLayout
from kvbridge.connector.transfer_params import (
    PrefillRank,
    RemotePrefillParams,
    rank_tickets,
)

D_OF_2 = TPLayout(tp_rank=0, tp_size=2, total_num_kv_heads=8)
RANK_0 = {"host": "10.0.0.1", "port": 5000, "incarnation": "a"}
RANK_1 = {"host": "10.0.0.2", "port": 5001, "incarnation": "b"}


def _ticket(**over) -> dict:
    params = {
        "do_remote_prefill": True, "remote_engine_id": "p", "remote_incarnation": "a",
        "remote_request_id": "p-1", "remote_host": "10.0.0.1", "remote_port": 5000,
        "remote_block_ids": [[1, 2]], "remote_num_tokens": 32, "remote_block_size": 16,
        "lease_expires_at": 1e12, "remote_lease_token": "tok",
        "remote_tp_size": 2, "remote_ranks": [RANK_0, RANK_1], "remote_num_kv_heads": 8,
    }
    return {k: v for k, v in (params | over).items() if v is not ...}


def _parse(params: dict, local_tp: TPLayout | None = D_OF_2) -> RemotePrefillParams:
    return RemotePrefillParams.parse(params, num_groups=1, block_size=16, local_tp=local_tp)


def test_a_tensor_parallel_ticket_names_every_rank_and_round_trips():
    parsed = _parse(_ticket())
    assert parsed.ranks() == (
        PrefillRank("10.0.0.1", 5000, "a"), PrefillRank("10.0.0.2", 5001, "b"))
    assert (parsed.remote_tp_size, parsed.remote_num_kv_heads) == (2, 8)
    assert _parse(parsed.to_dict()) == parsed
    tickets = rank_tickets(parsed)  # the lease on each rank: one id, one token
    assert [(t.host, t.port, t.remote_request_id, t.token) for t in tickets] == [
        ("10.0.0.1", 5000, "p-1", "tok"), ("10.0.0.2", 5001, "p-1", "tok")]


@pytest.mark.parametrize("local_tp", [None, D_OF_2])
def test_a_ticket_of_one_rank_is_unchanged_and_read_by_any_engine(local_tp):
    params = _ticket(remote_tp_size=..., remote_ranks=..., remote_num_kv_heads=...)
    parsed = _parse(params, local_tp)
    assert parsed.ranks() == (PrefillRank("10.0.0.1", 5000, "a"),)
    out = parsed.to_dict()
    assert not {"remote_tp_size", "remote_ranks", "remote_num_kv_heads"} & set(out)
    # the same P written explicitly (size 1, its one rank) is the same ticket
    explicit = _ticket(remote_tp_size=1, remote_ranks=[RANK_0], remote_num_kv_heads=...)
    assert _parse(explicit, local_tp) == parsed


@pytest.mark.parametrize(("over", "field", "problem"), [
    ({"remote_tp_size": True}, "remote_tp_size", "expected int"),
    ({"remote_tp_size": "2"}, "remote_tp_size", "expected int"),
    ({"remote_tp_size": 0}, "remote_tp_size", r"must be in \[1, 1024\]"),
    ({"remote_tp_size": 1025}, "remote_tp_size", r"must be in \[1, 1024\]"),
    ({"remote_ranks": ...}, "remote_ranks", "expected a list of 2 ranks"),
    ({"remote_ranks": [RANK_0]}, "remote_ranks", "1 ranks for remote_tp_size 2"),
    ({"remote_ranks": [RANK_0, RANK_1, RANK_1]}, "remote_ranks", "3 ranks"),
    ({"remote_ranks": [RANK_0, "x"]}, r"remote_ranks\[1\]", "expected a mapping"),
    ({"remote_ranks": [RANK_0, RANK_1 | {"host": ""}]}, r"remote_ranks\[1\].host", "non-empty"),
    ({"remote_ranks": [RANK_0, RANK_1 | {"host": "h" * 513}]}, r"remote_ranks\[1\].host",
     "at most 512"),
    ({"remote_ranks": [RANK_0, RANK_1 | {"port": 0}]}, r"remote_ranks\[1\].port",
     r"\[1, 65535\]"),
    ({"remote_ranks": [RANK_0, RANK_1 | {"port": 65536}]}, r"remote_ranks\[1\].port",
     r"\[1, 65535\]"),
    ({"remote_ranks": [RANK_0, RANK_1 | {"port": True}]}, r"remote_ranks\[1\].port",
     "expected int"),
    ({"remote_ranks": [RANK_0, {"host": "h", "port": 1}]}, r"remote_ranks\[1\].incarnation",
     "expected str"),
    ({"remote_ranks": [RANK_1, RANK_0]}, r"remote_ranks\[0\]", "must be remote_host"),
    ({"remote_num_kv_heads": ...}, "remote_num_kv_heads", "missing"),
    ({"remote_num_kv_heads": 0}, "remote_num_kv_heads", "must be >= 1"),
    ({"remote_num_kv_heads": 1 << 17}, "remote_num_kv_heads", "must be in"),
    ({"remote_num_kv_heads": 4}, "remote_num_kv_heads", "has 4 KV heads, this one 8"),
    ({"remote_tp_size": 3, "remote_ranks": [RANK_0, RANK_1, RANK_1]}, "remote_tp_size",
     "prefill tp_size 3, decode tp_size 2: tp_size 3 with 8 KV heads"),
])
def test_each_bad_tensor_parallel_field_is_named(over, field, problem):
    with pytest.raises(KVTransferParamsError, match=rf"{field}: .*{problem}"):
        _parse(_ticket(**over))


def test_an_engine_that_names_no_heads_takes_tickets_of_one_rank_only():
    with pytest.raises(KVTransferParamsError, match="remote_tp_size: 2: this engine does not"):
        _parse(_ticket(), local_tp=None)


def test_a_layout_that_cannot_take_a_wider_prefill_is_refused_naming_both_sizes():
    one_unsliceable = TPLayout(tp_rank=0, tp_size=1, total_num_kv_heads=8, heads_sliceable=False)
    with pytest.raises(KVTransferParamsError,
                       match="prefill tp_size 2, decode tp_size 1, 8 KV heads"):
        _parse(_ticket(), local_tp=one_unsliceable)
