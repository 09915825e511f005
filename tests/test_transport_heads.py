"""Reads of part of each block's KV heads (tensor parallelism, issue 30), on every data path.

A model of ``TOTAL_HEADS`` KV heads is split the way tensor-parallel ranks split it: a node
holds a run of heads, each block head-major (``[num_blocks, heads, block_size, 2 * head_size]``,
the CPU attention backend's layout, viewed as the transport's block shape). A read names the
model's heads it moves (``heads``): a narrower decode rank reads a slice of a wider holder's
blocks, a wider decode rank reads whole blocks of narrower holders into slices of its own.
The holder refuses a read of heads it does not hold, so one rank's heads never land in
another's blocks. Every path is checked byte for byte: loopback, UCX tag messages, the
same-host copy, and the same-host one-sided read checked on the holder's board.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import torch
from kvbridge.connector.holder import HeldBlockHashes, HolderChecks
from kvbridge.connector.lease import LeaseTable
from kvbridge.connector.stats import KVTransferStats
from kvbridge.transport import (
    GroupRead,
    HandshakeError,
    LeaseRef,
    LoopbackNetwork,
    LoopbackTransport,
    NodeMetadata,
    TransferError,
    check_compatible,
)
from kvbridge.transport.heads import heads_error, row_slice
from kvbridge.transport.metadata import KVHeads

pytestmark = pytest.mark.timeout(120)

TOTAL_HEADS = 4
NUM_BLOCKS = 16
BLOCK_SIZE = 16
HEAD_SIZE = 8
NUM_LAYERS = 2
CHUNK_BYTES = 4096  # one block of two heads over both layers: reads of several blocks chunk
LEASE = LeaseRef(request_id="p-1", token="tok")
PATHS = ["loopback", "ucx", "cma", "one_sided"]
# remote block -> local block: not one run of ids on either side, and one run of ids
SCATTERED = ([3, 4, 5, 9], [7, 2, 8, 11])
RUN = ([3, 4, 5], [10, 11, 12])


def model_kv(seed: int) -> list[torch.Tensor]:
    """The whole model's per-layer KV, head-major ``[num_blocks, TOTAL_HEADS, block_size,
    2 * head_size]`` (zeros for seed 0)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, TOTAL_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return [
        torch.zeros(shape) if seed == 0 else torch.randn(shape, generator=generator)
        for _ in range(NUM_LAYERS)
    ]


def rank_caches(model: list[torch.Tensor], first: int, num_heads: int) -> list[list[torch.Tensor]]:
    """One group: heads ``[first, first + num_heads)`` of ``model`` as a rank holds them,
    viewed as the transport's ``[num_blocks, 2, block_size, num_heads, head_size]``."""
    shape = (NUM_BLOCKS, 2, BLOCK_SIZE, num_heads, HEAD_SIZE)
    return [[layer[:, first : first + num_heads].contiguous().view(shape) for layer in model]]


def head_major(caches: list[list[torch.Tensor]], layer: int) -> torch.Tensor:
    """A rank's layer back as ``[num_blocks, heads held, block_size, 2 * head_size]``."""
    tensor = caches[0][layer]
    return tensor.view(NUM_BLOCKS, tensor.shape[3], BLOCK_SIZE, 2 * HEAD_SIZE)


def metadata(name: str, caches, first: int, *, sliceable: bool = True) -> NodeMetadata:
    return NodeMetadata.from_kv_caches(
        engine_id=name, kv_caches_by_group=caches, model_name="tiny", hash_fn_name="sha256",
        kv_heads=KVHeads(first=first, total=TOTAL_HEADS, sliceable=sliceable),
    )


def _lease_checks(transport, caches) -> LeaseTable:
    """The connector's holder checks over ``transport``, with ``LEASE`` held on blocks
    ``[1, NUM_BLOCKS)`` (no hashes: the lease alone vouches, as for a handoff's last block)."""
    leases = LeaseTable(lease_s=60.0)
    leases.attach_board(transport.block_board)
    checks = HolderChecks(
        leases=leases, hashes=HeldBlockHashes(), stats=KVTransferStats(), num_blocks=NUM_BLOCKS,
        bytes_per_block=[sum(t[0].nbytes for t in caches[0])],
    )
    transport.set_callbacks(**checks.as_kwargs())
    leases.grant(LEASE.request_id, [list(range(1, NUM_BLOCKS))], (), token=LEASE.token)
    return leases


@contextlib.asynccontextmanager
async def nodes(path: str, specs) -> AsyncIterator[list]:
    """Started transports of ``path``, one per ``(name, caches, first_head, sliceable)``;
    each holds ``LEASE`` (``_lease_checks``)."""
    network = LoopbackNetwork()
    transports = []
    try:
        for name, caches, first, sliceable in specs:
            meta = metadata(name, caches, first, sliceable=sliceable)
            if path == "loopback":
                transport = LoopbackTransport(
                    meta, caches, network=network, chunk_bytes=CHUNK_BYTES
                )
            else:
                from kvbridge.transport import UcxxTransport

                transport = UcxxTransport(
                    meta, caches, chunk_bytes=CHUNK_BYTES, cma=path != "ucx",
                    cma_board=path == "one_sided",
                )
            await transport.start()
            transports.append(transport)
            _lease_checks(transport, caches)
        yield transports
    finally:
        for transport in transports:
            await transport.close()


async def _read(requester, holder, ids, heads=None):
    remote, local = ids
    groups = [GroupRead(group_id=0, remote_block_ids=remote, local_block_ids=local,
                        expected_hashes=[b""] * len(remote))]
    return await requester.read_blocks(
        holder.address, "d-1", groups, deadline_s=30, lease=LEASE, heads=heads
    )


def _one_sided_reads(requester) -> int:
    counts = getattr(requester, "board_counts", None)
    return 0 if counts is None else counts.one_sided


def _assert_path(path: str, requester, holder, one_sided_before: int) -> None:
    """The read went the way ``path`` says (one-sided: on the board alone)."""
    if path == "loopback":
        return
    expected = one_sided_before + (path == "one_sided")
    assert _one_sided_reads(requester) == expected
    assert requester.peer_data_path(holder.address) == ("ucx" if path == "ucx" else "cma")


@pytest.mark.asyncio
@pytest.mark.parametrize("ids", [SCATTERED, RUN], ids=["scattered", "run"])
@pytest.mark.parametrize("path", PATHS)
async def test_a_narrower_rank_reads_its_heads_of_a_wider_holders_blocks(path, ids):
    """P of tensor-parallel size 1 (all four heads) -> D rank 1 of 2 (heads 2 and 3): each
    block's bytes of heads 2..3 land, nothing else of D's blocks changes."""
    model = model_kv(seed=5)
    d_caches = rank_caches(model_kv(seed=0), 2, 2)
    async with nodes(path, [("p", rank_caches(model, 0, 4), 0, True),
                            ("d1", d_caches, 2, True)]) as (holder, requester):
        before = _one_sided_reads(requester)
        result = await _read(requester, holder, ids)  # default: the heads D holds
        assert (result.num_blocks_landed, result.failed_local_block_ids) == (len(ids[0]), ())
        head_nbytes = BLOCK_SIZE * 2 * HEAD_SIZE * 4  # float32
        assert result.num_bytes_landed == len(ids[0]) * NUM_LAYERS * 2 * head_nbytes
        _assert_path(path, requester, holder, before)
        remote, local = ids
        for layer in range(NUM_LAYERS):
            mine = head_major(d_caches, layer)
            assert torch.equal(mine[local], model[layer][remote, 2:4])
            untouched = [b for b in range(NUM_BLOCKS) if b not in local]
            assert not mine[untouched].any()


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_a_wider_rank_reads_each_narrower_holders_blocks_into_its_slice(path):
    """P of tensor-parallel size 2 (heads 0..1 and 2..3) -> D of size 1: D reads heads 0..1
    from rank 0 and 2..3 from rank 1, and its blocks equal the model's."""
    model = model_kv(seed=6)
    d_caches = rank_caches(model_kv(seed=0), 0, 4)
    specs = [("p0", rank_caches(model, 0, 2), 0, True), ("p1", rank_caches(model, 2, 2), 2, True),
             ("d", d_caches, 0, True)]
    async with nodes(path, specs) as (p0, p1, requester):
        remote, local = SCATTERED
        for holder, heads in ((p0, (0, 2)), (p1, (2, 4))):
            result = await _read(requester, holder, SCATTERED, heads=heads)
            assert result.failed_local_block_ids == ()
        for layer in range(NUM_LAYERS):
            assert torch.equal(head_major(d_caches, layer)[local], model[layer][remote])


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_a_read_of_heads_the_holder_does_not_hold_is_refused_and_lands_nothing(path):
    """D rank 1 (heads 2..3) sent to P rank 0 (heads 0..1) of the same size, as a pull that
    used rank 0's address for every rank would: refused naming both, D's blocks untouched."""
    model = model_kv(seed=7)
    d_caches = rank_caches(model_kv(seed=0), 2, 2)
    async with nodes(path, [("p0", rank_caches(model, 0, 2), 0, True),
                            ("d1", d_caches, 2, True)]) as (holder, requester):
        with pytest.raises(TransferError, match=r"holds KV heads \[0, 2\) of 4, not \[2, 4\)"):
            await _read(requester, holder, SCATTERED)
        assert not any(t.any() for t in d_caches[0])


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["loopback", "ucx", "cma"])
async def test_a_holder_whose_heads_are_not_one_byte_range_serves_whole_rows_only(path):
    """A holder of a layout where a head run is strided (FlashAttention's "NHD") refuses a
    slice, naming its layout; a read of all its heads still lands."""
    model = model_kv(seed=8)
    d_caches = rank_caches(model_kv(seed=0), 2, 2)
    async with nodes(path, [("p", rank_caches(model, 0, 4), 0, False),
                            ("d1", d_caches, 2, True)]) as (holder, requester):
        with pytest.raises(TransferError, match=r"not one byte range"):
            await _read(requester, holder, SCATTERED)
        assert not any(t.any() for t in d_caches[0])


@pytest.mark.asyncio
async def test_a_requester_asking_for_heads_it_does_not_hold_is_a_caller_mistake():
    async with nodes("loopback", [("p", rank_caches(model_kv(1), 0, 4), 0, True),
                                  ("d1", rank_caches(model_kv(0), 2, 2), 2, True)]) as (p, d):
        with pytest.raises(ValueError, match=r"holds KV heads \[2, 4\) of 4, not \[0, 2\)"):
            await _read(d, p, SCATTERED, heads=(0, 2))


def test_row_slices_and_errors_at_the_edges():
    """Slices are whole rows for a node's own heads and byte ranges per head otherwise."""
    caches = rank_caches(model_kv(0), 1, 2)  # heads [1, 3) of 4
    meta = metadata("x", caches, 1)
    head_nbytes = BLOCK_SIZE * 2 * HEAD_SIZE * 4
    assert row_slice(meta, 0, (1, 3)) == (0, 2 * head_nbytes, True)
    assert row_slice(meta, 0, None) == (0, 2 * head_nbytes, True)
    assert row_slice(meta, 0, (2, 3)) == (head_nbytes, head_nbytes, False)
    assert row_slice(meta, 0, (1, 2)) == (0, head_nbytes, False)
    assert heads_error(meta, (1, 3)) is None
    assert "not [0, 2)" in heads_error(meta, (0, 2))
    assert "not [2, 4)" in heads_error(meta, (2, 4))
    assert "must name the heads" in heads_error(meta, None)
    whole = metadata("w", rank_caches(model_kv(0), 0, 4), 0)
    assert heads_error(whole, None) is None  # every head held: whole rows need no name


def test_nodes_of_one_model_pair_whatever_heads_each_holds_and_refuse_another_model():
    p = metadata("p", rank_caches(model_kv(0), 0, 4), 0)
    d = metadata("d", rank_caches(model_kv(0), 2, 2), 2)
    check_compatible(d, p)
    assert p.compat_hash == d.compat_hash
    other = NodeMetadata.from_kv_caches(
        engine_id="o", kv_caches_by_group=rank_caches(model_kv(0), 0, 2), model_name="tiny",
        hash_fn_name="sha256", kv_heads=KVHeads(first=0, total=2),
    )
    with pytest.raises(HandshakeError, match="total_kv_heads: local 4, remote 2"):
        check_compatible(d, other)


def test_kv_heads_that_do_not_fit_the_blocks_are_refused():
    with pytest.raises(ValueError, match="not below"):
        KVHeads(first=4, total=4)
    with pytest.raises(ValueError, match="do not fit"):  # heads [3, 5) of 4
        metadata("x", rank_caches(model_kv(0), 0, 2), 3)
