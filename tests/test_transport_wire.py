"""Wire schema: round trips, and every malformed input is a WireError naming the field."""

from __future__ import annotations

import msgpack
import pytest
import torch
from _transport_helpers import make_kv_caches, make_metadata
from kvbridge.transport import HandshakeError, WireError, check_compatible
from kvbridge.transport.wire import (
    WIRE_VERSION,
    Cancel,
    CancelOk,
    CmaOffer,
    ErrorMsg,
    GroupReadMsg,
    Heartbeat,
    Hello,
    HelloOk,
    Read,
    ReadCopied,
    ReadDone,
    ReadOk,
    TransferDone,
    decode_message,
    encode_message,
    frame_length,
)


def _read(**overrides) -> dict:
    body = {
        "v": WIRE_VERSION,
        "t": "Read",
        "transfer_id": 1,
        "request_id": "r",
        "tag_base": 0,
        "chunk_bytes": 1 << 20,
        "deadline_ms": 1000,
        "groups": [{"group_id": 0, "block_ids": [1, 2], "expected_hashes": None}],
        "cma": False,
    }
    body.update(overrides)
    return body


def _decode(obj: dict):
    return decode_message(msgpack.packb(obj))


def test_messages_round_trip():
    metadata = make_metadata("p", make_kv_caches(seed=0))
    offer = CmaOffer(
        host_id="boot",
        pid=4242,
        probe_address=1 << 40,
        probe=b"p" * 16,
        regions=[[8, 16, 24], [32, 40]],
    )
    messages = [
        Hello(metadata=metadata, worker_address=b"\x01\x02"),
        HelloOk(metadata=metadata, worker_address=b"\x03", cma=None),
        HelloOk(metadata=metadata, worker_address=b"\x03", cma=offer),
        ReadCopied(transfer_id=3),
        Read(
            transfer_id=3,
            request_id="r",
            tag_base=7,
            chunk_bytes=4096,
            deadline_ms=5,
            groups=[GroupReadMsg(group_id=1, block_ids=[4], expected_hashes=[b"h"])],
            cma=True,
        ),
        ReadOk(transfer_id=3, mismatched=[[0], []]),
        ReadDone(transfer_id=3, mismatched=[[], [1, 4]]),
        Cancel(transfer_id=3, num_chunks_posted=2),
        CancelOk(transfer_id=3, num_chunks_issued=0),
        Heartbeat(request_ids=["a", "b"]),
        TransferDone(request_id="a", success=False, reason="rejected"),
        ErrorMsg(transfer_id=0, code="bad_message", message="x"),
    ]
    for message in messages:
        frame = encode_message(message)
        assert frame_length(frame[:4]) == len(frame) - 4
        assert decode_message(frame[4:]) == message


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        ({"v": 99, "t": "Read"}, "unknown schema version 99"),
        # version 2 had no ReadDone: such a peer could not report late hash mismatches
        (_read(v=2), f"unknown schema version 2, this node speaks {WIRE_VERSION}"),
        # version 3 had no same-host reads: a Read without the field is refused by name
        ({k: v for k, v in _read(v=WIRE_VERSION).items() if k != "cma"}, "missing field 'cma'"),
        (_read(cma=1), "'cma' must be a bool"),
        ({"v": WIRE_VERSION, "t": "ReadCopied", "transfer_id": -3}, "'transfer_id' = -3"),
        (
            {"v": WIRE_VERSION, "t": "ReadDone", "transfer_id": 1, "mismatched": [[0, -1]]},
            "'mismatched'[0] must be a list of block positions",
        ),
        (
            {"v": WIRE_VERSION, "t": "ReadDone", "transfer_id": 1, "mismatched": [3]},
            "'mismatched'[0]",
        ),
        ({"v": WIRE_VERSION, "t": "ReadDone", "mismatched": []}, "missing field 'transfer_id'"),
        ({"t": "Read"}, "missing field 'v'"),
        ({"v": WIRE_VERSION, "t": "Launch"}, "unknown message type 'Launch'"),
        (_read(transfer_id=0), "'transfer_id' = 0 is outside"),
        (_read(transfer_id="1"), "'transfer_id' must be an int"),
        (_read(chunk_bytes=1), "'chunk_bytes' = 1 is outside"),
        (_read(deadline_ms=-1), "'deadline_ms' = -1"),
        (_read(groups=[{"group_id": 0, "block_ids": [-1], "expected_hashes": None}]), "[0] = -1"),
        (_read(groups=[{"group_id": 0, "block_ids": [1, True], "expected_hashes": None}]), "[1]"),
        (
            _read(groups=[{"group_id": 0, "block_ids": [1], "expected_hashes": [b"a", b"b"]}]),
            "2 expected_hashes for 1 block_ids",
        ),
        (_read(groups="x"), "'groups' must be a list"),
        (_read(request_id="x" * 600), "at most 512"),
    ],
)
def test_malformed_message_names_the_field(obj, fragment):
    with pytest.raises(WireError) as info:
        _decode(obj)
    assert fragment in str(info.value)


def test_garbage_and_bad_frame_lengths():
    with pytest.raises(WireError, match="not a msgpack message"):
        decode_message(b"\xc1")
    with pytest.raises(WireError, match="must be a map"):
        decode_message(msgpack.packb([1, 2]))
    with pytest.raises(WireError, match="frame length 0"):
        frame_length(b"\x00\x00\x00\x00")
    with pytest.raises(WireError, match="outside"):
        frame_length(b"\xff\xff\xff\xff")


def test_hello_with_forged_compat_hash_is_refused():
    metadata = make_metadata("p", make_kv_caches(seed=0))
    obj = msgpack.unpackb(encode_message(Hello(metadata=metadata, worker_address=b""))[4:])
    obj["metadata"]["compat_hash"] = "0" * 64
    with pytest.raises(WireError, match="compat_hash"):
        _decode(obj)


@pytest.mark.parametrize(
    ("remote_kwargs", "fragment"),
    [
        ({"block_size": 32}, "block_size: local 16, remote 32"),
        ({"dtype": torch.float16}, "dtype: local 'bfloat16', remote 'float16'"),
        ({"layers_per_group": (3, 4)}, "groups[1].num_layers: local 2, remote 4"),
        ({"layers_per_group": (3,)}, "num_groups: local 2, remote 1"),
        ({"head_size": 4}, "groups[0].block_shape"),
    ],
)
def test_incompatible_metadata_names_the_field(remote_kwargs, fragment):
    local = make_metadata("d", make_kv_caches(seed=0))
    remote = make_metadata("p", make_kv_caches(seed=0, **remote_kwargs))
    with pytest.raises(HandshakeError) as info:
        check_compatible(local, remote)
    assert fragment in str(info.value)


def test_num_blocks_and_incarnation_may_differ():
    local = make_metadata("d", make_kv_caches(seed=0, num_blocks=8))
    remote = make_metadata("p", make_kv_caches(seed=0, num_blocks=100))
    assert local.incarnation != remote.incarnation  # a new one per NodeMetadata (per start)
    check_compatible(local, remote)
    assert local.compat_hash == remote.compat_hash


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"regions": [[8, 16, 24]]}, "'regions' has 1 groups, metadata 2"),
        ({"regions": [[8, 16], [32, 40]]}, "'regions'[0] must list 3 addresses"),
        ({"regions": [[8, 16, -1], [32, 40]]}, "'regions'[0] holds a bad address -1"),
        ({"regions": [[8, 16, "24"], [32, 40]]}, "bad address '24'"),
        ({"probe": b""}, "'probe' is empty"),
        ({"pid": 0}, "'pid' = 0 is outside"),
        ({"host_id": 7}, "'host_id' must be a str"),
    ],
)
def test_malformed_cma_offer_names_the_field(change, fragment):
    """A holder's same-host offer points the requester at raw addresses: every field is checked
    against the metadata it arrives with."""
    metadata = make_metadata("p", make_kv_caches(seed=0))  # 3 + 2 layers
    offer = {
        "host_id": "boot",
        "pid": 4242,
        "probe_address": 1 << 40,
        "probe": b"p" * 16,
        "regions": [[8, 16, 24], [32, 40]],
    }
    frame = encode_message(HelloOk(metadata=metadata, worker_address=b""))
    obj = msgpack.unpackb(frame[4:])
    obj["cma"] = {**offer, **change}
    with pytest.raises(WireError) as info:
        _decode(obj)
    assert fragment in str(info.value)
