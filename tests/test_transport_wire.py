"""Wire schema: round trips, and every malformed input is a WireError naming the field (its
path in the frame, as msgspec writes it) or the version it came in."""

from __future__ import annotations

import kvbridge.transport
import msgpack
import pytest
import torch
from _transport_helpers import make_kv_caches, make_metadata
from kvbridge.transport import HandshakeError, WireError, check_compatible
from kvbridge.transport.limits import MAX_DEADLINE_MS
from kvbridge.transport.wire import (
    MAX_BLOCKS_PER_READ,
    MAX_GROUPS,
    MAX_HASH_BYTES,
    MAX_STR_LEN,
    WIRE_VERSION,
    Cancel,
    CancelOk,
    CmaOffer,
    ErrorMsg,
    GroupReadMsg,
    Heartbeat,
    Hello,
    HelloOk,
    LeaseRef,
    Read,
    ReadCopied,
    ReadDone,
    ReadOk,
    TransferDoneNotice,
    decode_message,
    encode_message,
    frame_length,
)


def _frame(msg: dict, v: object = WIRE_VERSION) -> dict:
    """A frame's payload as a plain map (``{"v", "msg"}``), for malformed variants."""
    return {"v": v, "msg": msg}


def _read(**overrides) -> dict:
    body = {
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
    return _frame(body)


def _group(**overrides) -> dict:
    return {"group_id": 0, "block_ids": [1, 2], "expected_hashes": None, **overrides}


def _decode(obj: dict):
    return decode_message(msgpack.packb(obj))


def _hello(metadata, **kwargs):
    return Hello(metadata=metadata, compat_hash=metadata.compat_hash, **kwargs)


def test_messages_round_trip():
    metadata = make_metadata("p", make_kv_caches(seed=0))
    offer = CmaOffer(
        host_id="boot",
        pid=4242,
        probe_address=(1 << 64) - 1,  # any user-space address msgpack can carry
        probe=b"p" * 16,
        regions=[[8, 16, 24], [32, 40]],
    )
    ok = {"metadata": metadata, "compat_hash": metadata.compat_hash, "worker_address": b"\x03"}
    messages = [
        _hello(metadata, worker_address=b"\x01\x02"),
        HelloOk(**ok, cma=None),
        HelloOk(**ok, cma=offer),
        ReadCopied(transfer_id=3),
        Read(
            transfer_id=(1 << 64) - 1,
            request_id="r",
            tag_base=7,
            chunk_bytes=4096,
            deadline_ms=5,
            groups=[GroupReadMsg(group_id=1, block_ids=[4], expected_hashes=[b"h"])],
            cma=True,
        ),
        Read(  # under a lease: the block without a hash carries an empty expected hash
            transfer_id=2,
            request_id="d",
            tag_base=0,
            chunk_bytes=4096,
            deadline_ms=5,
            groups=[GroupReadMsg(group_id=0, block_ids=[4, 5], expected_hashes=[b"h", b""])],
            lease=LeaseRef(request_id="p" * MAX_STR_LEN, token="t" * 64),
        ),
        ReadOk(transfer_id=3, mismatched=[[0], []]),
        ReadDone(transfer_id=3, mismatched=[[], [1, 4]]),
        Cancel(transfer_id=3, num_chunks_posted=2),
        CancelOk(transfer_id=3, num_chunks_issued=0),
        Heartbeat(request_ids=["a", "b"]),
        TransferDoneNotice(peer_engine_id="d", request_id="a", success=False, reason="rejected"),
        ErrorMsg(transfer_id=0, code="bad_message", message="x"),
    ]
    for message in messages:
        frame = encode_message(message)
        assert frame_length(frame[:4]) == len(frame) - 4
        assert decode_message(frame[4:]) == message
    # one type per concept: the wire's release notice is the one the holder's callback gets
    assert kvbridge.transport.TransferDoneNotice is TransferDoneNotice


READ_DONE = {"t": "ReadDone", "transfer_id": 1}


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        # versions: refused by number, before (and whatever) the message holds
        (
            _frame({"t": "Read"}, v=99),
            f"unknown schema version 99, this node speaks {WIRE_VERSION}",
        ),
        # version 4 sent flat maps without "msg": still refused by its version
        ({"v": 4, "t": "Read", "transfer_id": 1}, "unknown schema version 4"),
        ({**_read(), "v": 3}, "unknown schema version 3"),
        (_frame({"t": "Read"}, v="5"), "Expected `int`, got `str` - at `$.v`"),
        ({"msg": {"t": "ReadCopied", "transfer_id": 1}}, "missing required field `v`"),
        ({"v": WIRE_VERSION}, "missing required field `msg`"),
        # unknown or missing message type
        (_frame({"t": "Launch"}), "Invalid value 'Launch' - at `$.msg.t`"),
        (_frame({"transfer_id": 1}), "missing required field `t` - at `$.msg`"),
        # missing field, wrong type
        (_frame({"t": "ReadDone", "mismatched": []}), "missing required field `transfer_id`"),
        (_read(cma=1), "Expected `bool`, got `int` - at `$.msg.cma`"),
        (_read(transfer_id="1"), "Expected `int`, got `str` - at `$.msg.transfer_id`"),
        (_read(groups="x"), "Expected `array`, got `str` - at `$.msg.groups`"),
        (
            _read(groups=[_group(block_ids=[1, True])]),
            "got `bool` - at `$.msg.groups[0].block_ids[1]`",
        ),
        (
            _read(groups=[_group(block_ids=[1], expected_hashes=["a"])]),
            "Expected `bytes`, got `str` - at `$.msg.groups[0].expected_hashes[0]`",
        ),
        (
            _frame({"t": "Heartbeat", "request_ids": ["a", 7]}),
            "Expected `str`, got `int` - at `$.msg.request_ids[1]`",
        ),
        # out of range
        (
            _frame({"t": "ReadCopied", "transfer_id": -3}),
            "Expected `int` >= 1 - at `$.msg.transfer_id`",
        ),
        (_read(transfer_id=0), "Expected `int` >= 1 - at `$.msg.transfer_id`"),
        (_read(chunk_bytes=1), "Expected `int` >= 4096 - at `$.msg.chunk_bytes`"),
        (_read(deadline_ms=-1), "Expected `int` >= 1 - at `$.msg.deadline_ms`"),
        (_read(deadline_ms=MAX_DEADLINE_MS + 1), "<= 86400000 - at `$.msg.deadline_ms`"),
        (_read(tag_base=1 << 63), "at `$.msg.tag_base`"),
        (_read(groups=[_group(group_id=MAX_GROUPS)]), "<= 63 - at `$.msg.groups[0].group_id`"),
        (_read(groups=[_group(block_ids=[1, -1])]), ">= 0 - at `$.msg.groups[0].block_ids[1]`"),
        (_read(groups=[_group(block_ids=[1 << 31])]), "at `$.msg.groups[0].block_ids[0]`"),
        (
            _frame({**READ_DONE, "mismatched": [[0, -1]]}),
            "Expected `int` >= 0 - at `$.msg.mismatched[0][1]`",
        ),
        (_frame({**READ_DONE, "mismatched": [3]}), "got `int` - at `$.msg.mismatched[0]`"),
        (
            _frame({"t": "Cancel", "transfer_id": 1, "num_chunks_posted": MAX_BLOCKS_PER_READ + 1}),
            "at `$.msg.num_chunks_posted`",
        ),
        # too long
        (_read(request_id="x" * (MAX_STR_LEN + 1)), "of length <= 512 - at `$.msg.request_id`"),
        (
            _read(groups=[_group(block_ids=[1], expected_hashes=[b"h" * (MAX_HASH_BYTES + 1)])]),
            "of length <= 128 - at `$.msg.groups[0].expected_hashes[0]`",
        ),
        (_read(groups=[_group()] * (MAX_GROUPS + 1)), "of length <= 64 - at `$.msg.groups`"),
        (
            _read(lease={"request_id": "p" * (MAX_STR_LEN + 1), "token": "t"}),
            "of length <= 512 - at `$.msg.lease.request_id`",
        ),
        (
            _read(lease={"request_id": "p", "token": "t" * 65}),
            "of length <= 64 - at `$.msg.lease.token`",
        ),
        (_read(lease={"request_id": "", "token": "t"}), "at `$.msg.lease.request_id`"),
        (_read(lease={"token": "t"}), "missing required field `request_id` - at `$.msg.lease`"),
        (_read(lease="p-req"), "got `str` - at `$.msg.lease`"),
        (
            _frame({"t": "ErrorMsg", "transfer_id": 0, "code": "c" * 65, "message": ""}),
            "of length <= 64 - at `$.msg.code`",
        ),
        # inconsistent fields
        (
            _read(groups=[_group(block_ids=[1], expected_hashes=[b"a", b"b"])]),
            "2 expected_hashes for 1 block_ids - at `$.msg.groups[0]`",
        ),
    ],
)
def test_malformed_message_names_the_field(obj, fragment):
    with pytest.raises(WireError) as info:
        _decode(obj)
    assert fragment in str(info.value)


def test_too_many_blocks_in_one_read_are_refused():
    half = MAX_BLOCKS_PER_READ // 2 + 1
    groups = [_group(group_id=g, block_ids=[1] * half) for g in range(2)]
    with pytest.raises(WireError, match=f"a read of {2 * half} blocks exceeds"):
        _decode(_read(groups=groups))
    too_long = _read(groups=[_group(block_ids=[1] * (MAX_BLOCKS_PER_READ + 1))])
    with pytest.raises(WireError, match=r"length <= 1048576 - at `\$.msg.groups\[0\].block_ids`"):
        _decode(too_long)


def test_locally_built_inconsistent_messages_are_value_errors():
    with pytest.raises(ValueError, match="1 expected_hashes for 2 block_ids"):
        GroupReadMsg(group_id=0, block_ids=[1, 2], expected_hashes=[b"a"])


def test_garbage_and_bad_frame_lengths():
    with pytest.raises(WireError, match="not a msgpack message"):
        decode_message(b"\xc1")
    with pytest.raises(WireError, match="Expected `object`, got `array`"):
        decode_message(msgpack.packb([1, 2]))
    with pytest.raises(WireError, match="frame length 0"):
        frame_length(b"\x00\x00\x00\x00")
    with pytest.raises(WireError, match="outside"):
        frame_length(b"\xff\xff\xff\xff")


def _hello_obj(metadata) -> dict:
    return msgpack.unpackb(encode_message(_hello(metadata, worker_address=b""))[4:])


def test_hello_with_forged_compat_hash_is_refused():
    metadata = make_metadata("p", make_kv_caches(seed=0))
    obj = _hello_obj(metadata)
    obj["msg"]["compat_hash"] = "0" * 64
    with pytest.raises(WireError, match="'compat_hash' does not match the metadata fields it"):
        _decode(obj)
    obj["msg"]["compat_hash"] = "0"
    with pytest.raises(WireError, match=r"length >= 64 - at `\$.msg.compat_hash`"):
        _decode(obj)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"dtype": "complex64"}, "Invalid enum value 'complex64' - at `$.msg.metadata.dtype`"),
        ({"groups": []}, "length >= 1 - at `$.msg.metadata.groups`"),
        ({"engine_id": "e" * 513}, "length <= 512 - at `$.msg.metadata.engine_id`"),
        ({"identity": None}, "Expected `object`, got `None` - at `$.msg.metadata.identity`"),
    ],
)
def test_malformed_metadata_names_the_field(change, fragment):
    obj = _hello_obj(make_metadata("p", make_kv_caches(seed=0)))
    obj["msg"]["metadata"].update(change)
    with pytest.raises(WireError) as info:
        _decode(obj)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"block_size": 0}, "Expected `int` >= 1 - at `$.block_size`"),
        ({"hash_fn_name": None}, "Expected `str`, got `None` - at `$.hash_fn_name`"),
        ({"model_revision": "r" * 513}, "length <= 512 - at `$.model_revision`"),
        ({"kv_cache_dtype": "d" * 65}, "length <= 64 - at `$.kv_cache_dtype`"),
        ({"kv_cache_dtype": ""}, "kv_cache_dtype must be non-empty - at `$`"),
        ({"model_name": ""}, "model_name must be non-empty - at `$`"),
    ],
)
def test_malformed_block_identity_names_the_field(change, fragment):
    obj = _hello_obj(make_metadata("p", make_kv_caches(seed=0)))
    obj["msg"]["metadata"]["identity"].update(change)
    with pytest.raises(WireError) as info:
        _decode(obj)
    assert fragment.replace("`$", "`$.msg.metadata.identity") in str(info.value)


def test_a_peer_may_leave_out_the_identity_fields_with_defaults():
    # model_revision "" (unknown) and kvbridge's own kv_layout are what a peer that sends
    # neither means: its metadata decodes to the same identity and the same compat_hash.
    metadata = make_metadata("p", make_kv_caches(seed=0))
    obj = _hello_obj(metadata)
    del obj["msg"]["metadata"]["identity"]["model_revision"]
    del obj["msg"]["metadata"]["identity"]["kv_layout"]
    assert _decode(obj).metadata.identity == metadata.identity


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"num_layers": 0}, "at `$.msg.metadata.groups[1].num_layers`"),
        ({"block_shape": [2, 16, 2, 0]}, "at `$.msg.metadata.groups[1].block_shape[3]`"),
        ({"block_shape": [2] * 9}, "length <= 8 - at `$.msg.metadata.groups[1].block_shape`"),
        ({"dtype": "int64"}, "Invalid enum value 'int64' - at `$.msg.metadata.groups[1].dtype`"),
    ],
)
def test_malformed_group_layout_names_the_field(change, fragment):
    obj = _hello_obj(make_metadata("p", make_kv_caches(seed=0)))
    obj["msg"]["metadata"]["groups"][1].update(change)
    with pytest.raises(WireError) as info:
        _decode(obj)
    assert fragment in str(info.value)


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
        ({"regions": [[8, 16, 24]]}, "'cma.regions' has 1 groups, metadata 2 - at `$.msg`"),
        ({"regions": [[8, 16], [32, 40]]}, "'cma.regions[0]' lists 2 addresses for 3 layers"),
        ({"regions": [[8, 16, -1], [32, 40]]}, ">= 1 - at `$.msg.cma.regions[0][2]`"),
        ({"regions": [[8, 16, "24"], [32, 40]]}, "got `str` - at `$.msg.cma.regions[0][2]`"),
        ({"probe": b""}, "length >= 1 - at `$.msg.cma.probe`"),
        ({"probe_address": 0}, ">= 1 - at `$.msg.cma.probe_address`"),
        ({"pid": 0}, "Expected `int` >= 1 - at `$.msg.cma.pid`"),
        ({"pid": 1 << 31}, "<= 2147483647 - at `$.msg.cma.pid`"),
        ({"host_id": 7}, "Expected `str`, got `int` - at `$.msg.cma.host_id`"),
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
    hello_ok = HelloOk(metadata=metadata, compat_hash=metadata.compat_hash, worker_address=b"")
    obj = msgpack.unpackb(encode_message(hello_ok)[4:])
    obj["msg"]["cma"] = {**offer, **change}
    with pytest.raises(WireError) as info:
        _decode(obj)
    assert fragment in str(info.value)
