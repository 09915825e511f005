"""Wire fuzzing of the holder (issue 15, "Security"): random and mutated msgpack frames.

Properties, each over hypothesis-generated input:

- ``decode_message`` of any bytes raises only ``WireError``; what it accepts is in range.
- ``plan.check_read`` accepts a decoded ``Read`` only when every group id and block id it names
  lies inside this node's KV regions (``[1, num_blocks)`` of an existing group).
- A holder process fed ``Hello`` messages whose UCX worker address has another header byte or
  is too short refuses each (``ErrorMsg``) and stays alive: before the fix, UCX stopped the
  whole process on an assertion for a malformed address. One with the right header byte and
  flipped or cut fields behind it passes that check and can still stop UCX (the test once
  asserted otherwise and failed at random): with a cluster key, a stranger's address of any
  kind is refused before UCX sees it, which the keyed holder's test checks.
- A real ``UcxxTransport`` holder fed frames of random bytes, mutated valid messages and
  messages of random field values over one control connection answers each with a reply or
  nothing, never closes on a well-framed message, never starts reading a block outside its
  regions (every block id its serves pick is recorded), and serves a good read, bytes-exact,
  afterwards.

Example counts are kept small (the suite's time matters); the derandomised profile in
``conftest`` is not assumed: each test fixes its own ``max_examples``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import kvbridge.transport.ucx_serve as ucx_serve
import msgpack
import pytest
import pytest_asyncio
from _transport_helpers import NUM_BLOCKS, make_hash_validator, make_kv_caches, make_metadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvbridge.transport import GroupRead, WireError
from kvbridge.transport.auth import NONCE_BYTES
from kvbridge.transport.control import read_frame
from kvbridge.transport.plan import check_read
from kvbridge.transport.wire import (
    WIRE_VERSION,
    AuthChallenge,
    AuthProof,
    Cancel,
    CancelOk,
    ErrorMsg,
    GroupReadMsg,
    Heartbeat,
    Hello,
    LeaseRef,
    Read,
    ReadDone,
    ReadOk,
    TransferDoneNotice,
    decode_message,
    encode_message,
)

pytestmark = pytest.mark.timeout(120)
in_module_loop = pytest.mark.asyncio(loop_scope="module")

_MESSAGE_TAGS = [
    "Hello", "HelloOk", "Read", "ReadOk", "ReadCopied", "ReadDone", "Cancel", "CancelOk",
    "Heartbeat", "TransferDone", "ErrorMsg", "AuthChallenge", "AuthProof", "Bogus",
]
_FIELDS = [
    "transfer_id", "request_id", "tag_base", "chunk_bytes", "deadline_ms", "groups", "cma",
    "group_id", "block_ids", "expected_hashes", "num_chunks_posted", "request_ids", "tokens",
    "token", "peer_engine_id", "success", "reason", "mismatched", "metadata", "nonce", "proof",
    "lease",
]

# Any msgpack value, nested a little: what a stranger may put in any field.
_ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-3, NUM_BLOCKS + 3),  # the edges of the KV regions
)
_leaves = st.one_of(
    st.none(), st.booleans(), _ints, st.floats(allow_nan=True), st.text(max_size=20),
    st.binary(max_size=40),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.sampled_from(_FIELDS), inner, max_size=6)
    ),
    max_leaves=20,
)


_inside = st.integers(1, NUM_BLOCKS - 1)
_block_ids = st.one_of(
    _inside, _inside, _inside, _inside, _inside,  # inside the region, mostly
    st.sampled_from([0, -1, NUM_BLOCKS, NUM_BLOCKS + 1, 2**31 - 1, 2**31, 2**63]),  # its edges
)


@st.composite
def _group_dicts(draw) -> dict:
    """A group entry of a Read as a peer may send it: ids inside, at and far past the edges."""
    group_id = draw(st.sampled_from([0, 1, 0, 1, 0, 1, 2, 63, 64, -1]))
    block_ids = draw(st.lists(_block_ids, max_size=6))
    hashes = draw(st.sampled_from(["none", "right", "random"]))
    expected: object = None
    if hashes == "right":
        expected = [f"{group_id}:{b}".encode() for b in block_ids]
    elif hashes == "random":
        expected = draw(st.lists(st.binary(max_size=8), max_size=6))
    return {"group_id": group_id, "block_ids": block_ids, "expected_hashes": expected}


_transfer_ids = itertools.count(1 << 40)  # never reused over the module's examples


@st.composite
def _read_dicts(draw) -> dict:
    """A Read-shaped message: every field valid at first, then up to two replaced by any
    value and up to one left out."""
    msg = {
        "t": "Read",
        "transfer_id": next(_transfer_ids),
        "request_id": draw(st.text(max_size=12)),
        "tag_base": draw(st.integers(0, 2**40)),
        "chunk_bytes": draw(st.sampled_from([1 << 12, 1 << 14, 1 << 20])),
        "deadline_ms": draw(st.integers(1, 200)),
        "groups": draw(st.lists(_group_dicts(), max_size=3)),
        "cma": draw(st.booleans()),
        "lease": draw(st.none() | st.fixed_dictionaries(
            {"request_id": st.text(max_size=520), "token": st.text(max_size=66)}
        )),
    }
    damage = draw(st.sampled_from(["none", "none", "replace", "replace", "drop"]))
    key = draw(st.sampled_from(sorted(msg)))
    if damage == "replace":
        msg[key] = draw(st.one_of(_ints, _values))
    elif damage == "drop":
        del msg[key]
    return msg


@st.composite
def _any_message_dicts(draw) -> dict:
    fields = draw(st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=6))
    return {"t": draw(st.sampled_from(_MESSAGE_TAGS)), **fields}


def _valid_messages() -> st.SearchStrategy:
    read = Read(
        transfer_id=5, request_id="r", tag_base=1 << 20, chunk_bytes=1 << 14, deadline_ms=100,
        groups=[GroupReadMsg(group_id=0, block_ids=[1, 2, 3], expected_hashes=[b"0:1"] * 3)],
        lease=LeaseRef(request_id="p-req", token="tok"),
    )
    return st.sampled_from([
        read,
        Cancel(transfer_id=5, num_chunks_posted=1),
        Heartbeat(request_ids=["a", "b"]),
        ReadDone(transfer_id=5, mismatched=[[0]]),
    ])


@st.composite
def _mutated_payloads(draw) -> bytes:
    """A valid message's payload with bytes flipped, cut, or inserted."""
    payload = bytearray(encode_message(draw(_valid_messages()))[4:])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(len(payload) - 1, 0)))
        if kind == "flip" and payload:
            payload[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del payload[at:]
        else:
            payload[at:at] = draw(st.binary(min_size=1, max_size=6))
    return bytes(payload) or b"\xc0"


def _packed(msg: dict, version: object = WIRE_VERSION) -> bytes:
    return msgpack.packb({"v": version, "msg": msg}, use_bin_type=True)


_payloads = st.one_of(
    st.binary(min_size=1, max_size=64),
    _mutated_payloads(),
    _read_dicts().map(_packed),
    _any_message_dicts().map(_packed),
    st.tuples(_read_dicts(), st.sampled_from([WIRE_VERSION - 1, WIRE_VERSION + 1, "5", None]))
    .map(lambda pair: _packed(*pair)),
)


_reads_packed = _read_dicts().map(_packed)

# ----------------------------------------------------------------------------- decode alone


@settings(max_examples=300, deadline=None)
@given(payload=_payloads)
def test_decode_raises_only_wire_error_and_accepts_only_bounded_reads(payload):
    try:
        message = decode_message(payload)
    except WireError:
        return
    if isinstance(message, Read):  # decoded: every bound of ``limits`` held
        assert message.transfer_id >= 1 and message.deadline_ms >= 1
        if message.lease is not None:
            assert 1 <= len(message.lease.request_id) <= 512 and len(message.lease.token) <= 64
        for group in message.groups:
            assert 0 <= group.group_id < 64
            assert all(0 <= b < 2**31 for b in group.block_ids)
            if group.expected_hashes is not None:
                assert len(group.expected_hashes) == len(group.block_ids)


@settings(max_examples=300, deadline=None)
@given(msg=_read_dicts())
def test_check_read_accepts_only_blocks_inside_the_kv_regions(msg):
    metadata = make_metadata("fuzz-holder", make_kv_caches(seed=0))
    try:
        read = decode_message(_packed(msg))
    except WireError:
        return
    if not isinstance(read, Read):
        return
    try:
        check_read(metadata, read)
    except WireError:
        return
    for group in read.groups:
        assert group.group_id < len(metadata.groups)
        num_blocks = metadata.groups[group.group_id].num_blocks
        assert all(1 <= b < num_blocks for b in group.block_ids), group


# ----------------------------------------------------------------------------- a real holder


@pytest.fixture(scope="module")
def _ucxx():
    return pytest.importorskip("ucxx")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fuzz_holder(_ucxx):
    from kvbridge.transport import UcxxTransport

    caches = make_kv_caches(seed=31)
    holder = UcxxTransport(make_metadata("fuzz-holder", caches), caches)
    holder.set_callbacks(block_validator=make_hash_validator(set()))
    await holder.start()
    yield holder
    await holder.close()


@pytest.fixture
def picked_block_ids(monkeypatch):
    """Every block id a UCX serve picks to read from the KV tensors, per group entry."""
    picked: list[list[int]] = []
    real_pick = ucx_serve.pick

    def recording_pick(values, good, start, stop):
        ids = real_pick(values, good, start, stop)
        picked.append(list(ids))
        return ids

    monkeypatch.setattr(ucx_serve, "pick", recording_pick)
    return picked


@contextlib.asynccontextmanager
async def _stranger_connection(holder):
    """A hand-driven control connection that completed the handshake (no cluster key)."""
    import ucxx

    metadata = make_metadata("fuzz-peer", make_kv_caches(seed=0))
    reader, writer = await asyncio.open_connection(*holder.address)
    hello = Hello(
        metadata=metadata,
        compat_hash=metadata.compat_hash,
        worker_address=ucxx.get_worker_address().tobytes(),
    )
    writer.write(encode_message(hello))
    decode_message(await asyncio.wait_for(read_frame(reader), 10))
    try:
        yield reader, writer
    finally:
        writer.close()


_REPLIES = (ErrorMsg, ReadOk, ReadDone, CancelOk)


@in_module_loop
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payloads=st.lists(st.one_of(_reads_packed, _reads_packed, _payloads),
                         min_size=1, max_size=8))
async def test_holder_survives_random_frames_and_reads_only_its_regions(
    fuzz_holder, picked_block_ids, payloads
):
    async with _stranger_connection(fuzz_holder) as (reader, writer):
        for payload in payloads:
            writer.write(len(payload).to_bytes(4, "big") + payload)
        # a sentinel: the holder answers messages in order, so its CancelOk comes last
        sentinel = next(_transfer_ids)
        writer.write(encode_message(Cancel(transfer_id=sentinel, num_chunks_posted=0)))
        while True:
            reply = decode_message(await asyncio.wait_for(read_frame(reader), 10))
            assert isinstance(reply, _REPLIES), reply
            if isinstance(reply, ErrorMsg):
                assert reply.code != "holder_error", reply  # no serve crashed
            if reply == CancelOk(transfer_id=sentinel, num_chunks_issued=0):
                break
    for ids in picked_block_ids:
        assert all(1 <= b < NUM_BLOCKS for b in ids), ids


@in_module_loop
async def test_holder_serves_a_good_read_after_the_fuzzing(fuzz_holder, _ucxx):
    from kvbridge.transport import UcxxTransport

    async with _stranger_connection(fuzz_holder) as (_, writer):
        writer.write(b"\xff\xff\xff\xff")  # a length prefix out of range: that connection ends
    caches = make_kv_caches(seed=0)
    requester = UcxxTransport(make_metadata("fuzz-good", caches), caches, cma=False)
    await requester.start()
    try:
        reads = [GroupRead(group_id=0, remote_block_ids=[1, 63, 7], local_block_ids=[2, 3, 4])]
        result = await requester.read_blocks(fuzz_holder.address, "good", reads, deadline_s=20)
        assert result.ok and result.num_blocks_landed == 3
        source = make_kv_caches(seed=31)
        for layer, dst in enumerate(caches[0]):
            assert dst[[2, 3, 4]].view(-1).equal(source[0][layer][[1, 63, 7]].view(-1))
    finally:
        await requester.close()
    for _ in range(300):  # every serve a fuzzed read started ends (deadline + grace at most)
        if fuzz_holder.num_active_serves == 0:
            break
        await asyncio.sleep(0.05)
    assert fuzz_holder.num_active_serves == 0
    assert fuzz_holder.num_holder_staging_outstanding == 0


# ----------------------------------------------------------------------------- a holder process


_FUZZ_KEY = "fuzz-cluster-key-0123456789"


@pytest.fixture(scope="module")
def holder_process(_ucxx):
    from test_transport_ucxx import HolderProcess

    holder = HolderProcess("--seed", "5")
    yield holder
    holder.stop()


@pytest.fixture(scope="module")
def keyed_holder_process(_ucxx):
    from test_transport_ucxx import HolderProcess

    holder = HolderProcess("--seed", "5", "--auth-key", _FUZZ_KEY)
    yield holder
    holder.stop()


@st.composite
def _refused_worker_addresses(draw, real: bytes) -> bytes:
    """Addresses ``check_worker_address`` refuses before UCX sees them: another header byte
    (version and flags) in front of the real bytes or of random ones, or fewer than 16 bytes."""
    kind = draw(st.sampled_from(["header", "random", "short"]))
    if kind == "short":
        return real[: draw(st.integers(0, 15))]
    body = real[1:] if kind == "header" else draw(st.binary(min_size=0, max_size=300))
    return bytes([real[0] ^ draw(st.integers(1, 255))]) + body


@st.composite
def _worker_addresses(draw, real: bytes) -> bytes:
    """A UCX worker address as a stranger may send it: the real one mutated, cut, or random
    bytes behind the right header byte. UCX does not validate one (it stops the process on an
    assertion), so only a holder with a cluster key is safe from these."""
    kind = draw(st.sampled_from(["flip", "cut", "random"]))
    address = bytearray(real)
    if kind == "flip":
        for at in draw(st.lists(st.integers(1, len(real) - 1), min_size=1, max_size=4)):
            address[at] ^= draw(st.integers(1, 255))
    elif kind == "cut":
        del address[draw(st.integers(16, len(real) - 1)) :]
    else:
        address = bytearray(real[:1] + draw(st.binary(min_size=15, max_size=300)))
    return bytes(address)


async def _hello(holder_address, address: bytes, *, nonce: bytes = b"", proof: bytes = b""):
    """Send a ``Hello`` with worker address ``address`` (and, to a keyed holder, ``nonce``
    and then an ``AuthProof`` of ``proof``); the holder's last answer."""
    metadata = make_metadata("fuzz-peer", make_kv_caches(seed=0))
    reader, writer = await asyncio.open_connection(*holder_address)
    try:
        hello = Hello(metadata=metadata, compat_hash=metadata.compat_hash, worker_address=address,
                      auth_nonce=nonce)
        writer.write(encode_message(hello))
        reply = decode_message(await asyncio.wait_for(read_frame(reader), 10))
        if isinstance(reply, AuthChallenge):
            writer.write(encode_message(AuthProof(proof=proof)))
            reply = decode_message(await asyncio.wait_for(read_frame(reader), 10))
        return reply
    finally:
        writer.close()


@in_module_loop
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_a_holder_process_refuses_hellos_with_malformed_worker_addresses(
    holder_process, data
):
    """Without a cluster key: what ``check_worker_address`` covers is refused for that
    connection, never handed to UCX, and the process serves on (docs/operations.md,
    "What is validated")."""
    import ucxx

    address = data.draw(_refused_worker_addresses(ucxx.get_worker_address().tobytes()))
    reply = await _hello(holder_process.address, address)
    assert isinstance(reply, ErrorMsg) and reply.code == "bad_message", reply
    assert "worker_address" in reply.message
    assert holder_process.proc.poll() is None  # the process is alive


@in_module_loop
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_a_keyed_holder_never_hands_a_strangers_worker_address_to_ucx(
    keyed_holder_process, data
):
    """With a cluster key a stranger's address, however crafted (right header byte, flipped
    or cut fields: UCX would stop the process on some), is never parsed: without the key the
    peer is refused first (no nonce, or a wrong proof)."""
    import ucxx

    address = data.draw(_worker_addresses(ucxx.get_worker_address().tobytes()))
    nonce = data.draw(st.sampled_from([b"", None]))
    if nonce is None:
        nonce = data.draw(st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES))
    proof = data.draw(st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES))
    reply = await _hello(keyed_holder_process.address, address, nonce=nonce, proof=proof)
    assert isinstance(reply, ErrorMsg) and reply.code == "unauthenticated", reply
    assert keyed_holder_process.proc.poll() is None  # the process is alive


@in_module_loop
async def test_the_holder_process_serves_a_good_read_after(holder_process):
    from kvbridge.transport import UcxxTransport

    caches = make_kv_caches(seed=0)
    requester = UcxxTransport(make_metadata("fuzz-after", caches), caches, cma=False)
    await requester.start()
    try:
        reads = [GroupRead(group_id=1, remote_block_ids=[9, 8], local_block_ids=[1, 2])]
        result = await requester.read_blocks(holder_process.address, "ok", reads, deadline_s=20)
        assert result.ok and result.num_blocks_landed == 2
        source = make_kv_caches(seed=5)
        for layer, dst in enumerate(caches[1]):
            assert dst[[1, 2]].view(-1).equal(source[1][layer][[9, 8]].view(-1))
    finally:
        await requester.close()


def test_a_transfer_done_built_locally_still_round_trips():
    """The fuzzing's own baseline: a well-formed notice decodes to itself."""
    notice = TransferDoneNotice(peer_engine_id="d", request_id="r", success=True, reason="")
    assert decode_message(encode_message(notice)[4:]) == notice
