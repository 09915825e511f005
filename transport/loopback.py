"""In-process twin of ``UcxxTransport`` for unit tests, with injectable delays and failures.

Same protocol object (``Transport``), same validation (``plan``), same wire messages (every
control message is encoded and decoded through ``wire``), the same chunk plan and the same
gather/scatter kernels; only the bytes move by a tensor copy instead of UCX. Nodes find each
other through a ``LoopbackNetwork`` keyed by ``PeerAddress``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from kvbridge.kernels import gather_blocks, scatter_blocks

from .auth import check_auth_key, holder_proof, new_nonce, proof_matches, requester_proof
from .base import (
    DEFAULT_CHUNK_BYTES,
    GroupRead,
    HolderCallbacks,
    PeerAddress,
    ReadResult,
    Transport,
    check_kv_caches_match,
)
from .errors import HandshakeError, TransferError, TransportError, WireError
from .metadata import NodeMetadata, check_compatible
from .plan import (
    block_nbytes_by_entry,
    check_read,
    check_read_done,
    expects_read_done,
    find_mismatched,
    good_positions,
    plan_chunks,
    recheck_blocks,
)
from .transfer import (
    ReadState,
    begin_read,
    drive_read,
)
from .wire import (
    GroupReadMsg,
    Heartbeat,
    LeaseRef,
    Read,
    ReadDone,
    decode_message,
    encode_message,
    transfer_done_notice,
)


def _roundtrip(message):  # type: ignore[no-untyped-def]
    """Encode and decode a message, as the wire would."""
    return decode_message(encode_message(message)[4:])


class LoopbackNetwork:
    """Registry of started loopback nodes; ports are handed out from 1 upwards when 0 is asked."""

    def __init__(self) -> None:
        self._nodes: dict[PeerAddress, LoopbackTransport] = {}
        self._ports = itertools.count(1)

    def register(self, host: str, port: int, node: LoopbackTransport) -> PeerAddress:
        address = PeerAddress(host, port if port else next(self._ports))
        if address in self._nodes:
            raise ValueError(f"address {address} already in use")
        self._nodes[address] = node
        return address

    def unregister(self, address: PeerAddress) -> None:
        self._nodes.pop(address, None)

    def lookup(self, peer: PeerAddress | tuple[str, int]) -> LoopbackTransport | None:
        return self._nodes.get(PeerAddress(*peer))


@dataclass(kw_only=True)
class LoopbackFaults:
    """Holder-side faults, read at the start of every read this node serves (mutable).

    Attributes:
        serve_delay_s: sleep this long before serving a read (and before answering it).
        chunk_delay_s: sleep this long before each chunk.
        fail_block_ids: remote block ids this holder rejects as if their hash no longer matched
            (they come back in ``ReadResult.failed_local_block_ids``).
        refuse_block_ids: remote block ids this holder treats as out of range (the whole read
            fails with ``TransferError``, as for a bad id).
        evict_during_copy_block_ids: remote block ids that pass the hash check when a read
            arrives and are evicted and reused while their chunk is copied out, so the re-check
            after the copy fails them (``ReadDone``): their bytes are moved but they come back
            in ``ReadResult.failed_local_block_ids``, never as landed. Only groups read with
            expected hashes are re-checked, as on the real holder.
        drop_after_chunks: after sending this many chunks of a read, the holder drops off the
            network (as ``drop()``), so the read fails naming the blocks not landed.
        stall: accept reads and never send (the requester's deadline must fire).
        stall_after_chunks: after sending this many chunks of a read, send nothing more and
            keep the read open (no completion, no error, still on the network): the
            requester's deadline must fire with part of the data landed.
    """

    serve_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    fail_block_ids: set[int] = field(default_factory=set)
    evict_during_copy_block_ids: set[int] = field(default_factory=set)
    refuse_block_ids: set[int] = field(default_factory=set)
    drop_after_chunks: int | None = None
    stall: bool = False
    stall_after_chunks: int | None = None


class LoopbackTransport(Transport):
    """``Transport`` inside one process. See ``Transport`` for the contract.

    Args:
        metadata: this node's ``NodeMetadata`` (must describe ``kv_caches_by_group``).
        kv_caches_by_group: ``[group][layer]`` KV tensors.
        network: the shared ``LoopbackNetwork``.
        host, port: the address to register (port 0: next free one).
        faults: holder-side faults (``LoopbackFaults``); mutable at any time.
        chunk_bytes: staging chunk size of reads this node makes.
        auth_key: the cluster key (``auth``): both sides run the same proofs as over the wire.
    """

    def __init__(
        self,
        metadata: NodeMetadata,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        *,
        network: LoopbackNetwork,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: LoopbackFaults | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        auth_key: bytes | None = None,
    ):
        check_kv_caches_match(metadata, kv_caches_by_group)
        check_auth_key(auth_key)
        self.auth_key = auth_key
        self.num_refused_peers = 0  # peers refused for want of the cluster key
        self.metadata = metadata
        self.kv_caches_by_group = [list(g) for g in kv_caches_by_group]
        self.network = network
        self.faults = faults if faults is not None else LoopbackFaults()
        self.callbacks = HolderCallbacks()
        self.chunk_bytes = chunk_bytes
        self._host, self._port = host, port
        self._address: PeerAddress | None = None
        self._reads: dict[int, ReadState] = {}
        self._dropped = asyncio.Event()
        # holder side: transfer ids of reads being served, for tests' leak checks
        self.serving_transfer_ids: set[int] = set()
        self.num_cancels_received = 0
        self.num_reads_received = 0  # holder side: every ``Read`` that reached it, for tests

    @property
    def address(self) -> PeerAddress:
        if self._address is None:
            raise RuntimeError("LoopbackTransport.address read before start()")
        return self._address

    async def start(self) -> None:
        self._dropped = asyncio.Event()
        self._address = self.network.register(self._host, self._port, self)

    async def close(self) -> None:
        self.drop()
        for state in list(self._reads.values()):
            state.cancel_event.set()

    def drop(self) -> None:
        """Vanish from the network, as a killed holder process: reads it serves fail."""
        if self._address is not None:
            self.network.unregister(self._address)
        self._dropped.set()

    @property
    def num_inflight_reads(self) -> int:
        """Reads this node is making right now (0 after every read returned)."""
        return len(self._reads)

    # ------------------------------------------------------------------ requester side

    def _holder(self, peer: PeerAddress | tuple[str, int]) -> LoopbackTransport:
        holder = self.network.lookup(peer)
        if holder is None or holder._dropped.is_set():
            raise TransportError(f"peer {tuple(peer)} unreachable")
        return holder

    def _authenticate(self, holder: LoopbackTransport) -> None:
        """The handshake's challenge-response (``auth``), both sides in one call.

        Raises:
            HandshakeError: as ``UcxxTransport`` raises it (the holder counts a refusal).
        """
        if holder.auth_key is None and self.auth_key is None:
            return
        if holder.auth_key is None:
            raise HandshakeError("peer did not prove the cluster key (a holder without auth_key?)")
        hello = b"loopback hello " + self.engine_id.encode()
        requester_nonce = new_nonce() if self.auth_key is not None else b""
        holder_nonce = new_nonce()
        if self.auth_key is not None:
            expected = holder_proof(self.auth_key, requester_nonce, holder_nonce, hello)
            if not proof_matches(expected, holder_proof(holder.auth_key, requester_nonce,
                                                        holder_nonce, hello)):
                raise HandshakeError("peer failed the cluster key check")
            proof = requester_proof(self.auth_key, requester_nonce, holder_nonce, hello)
        else:
            proof = b""
        wanted = requester_proof(holder.auth_key, requester_nonce, holder_nonce, hello)
        if not requester_nonce or not proof_matches(wanted, proof):
            holder.num_refused_peers += 1
            raise HandshakeError("refused by peer: this node requires the cluster key (auth_key)")

    async def connect(self, peer: PeerAddress | tuple[str, int]) -> NodeMetadata:
        holder = self._holder(peer)
        self._authenticate(holder)
        remote = holder.metadata
        # Both sides check, as over the wire; the holder's refusal names the field too.
        try:
            check_compatible(holder.metadata, self.metadata)
        except HandshakeError as exc:
            raise HandshakeError(f"refused by peer: {exc}") from None
        check_compatible(self.metadata, remote)
        await asyncio.sleep(0)
        return remote

    async def read_blocks(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        groups: Sequence[GroupRead],
        *,
        deadline_s: float,
        lease: LeaseRef | None = None,
    ) -> ReadResult:
        read, state = begin_read(
            self.metadata,
            request_id,
            groups,
            deadline_s=deadline_s,
            chunk_bytes=self.chunk_bytes,
            lease=lease,
        )
        transfer_id = read.transfer_id
        self._reads[transfer_id] = state
        try:
            try:
                holder = self._holder(peer)
                await self.connect(peer)
            except TransportError as exc:
                if isinstance(exc, HandshakeError):
                    raise
                raise state.error(TransferError, str(exc)) from None
            return await drive_read(
                state,
                self._run_read(holder, read, state),
                self._make_abort(holder, read),
                deadline_s,
            )
        finally:
            del self._reads[transfer_id]

    def _make_abort(self, holder: LoopbackTransport, read: Read):  # type: ignore[no-untyped-def]
        async def abort(reason: str) -> None:
            holder.num_cancels_received += 1
            holder.serving_transfer_ids.discard(read.transfer_id)

        return abort

    async def _run_read(
        self, holder: LoopbackTransport, read: Read, state: ReadState
    ) -> ReadResult:
        read = _roundtrip(read)
        holder.num_reads_received += 1
        holder.serving_transfer_ids.add(read.transfer_id)
        try:
            return await holder._serve(read, self, state)
        finally:
            holder.serving_transfer_ids.discard(read.transfer_id)

    async def cancel(self, request_id: str) -> int:
        states = [s for s in self._reads.values() if s.request_id == request_id]
        for state in states:
            state.cancel_event.set()
        await asyncio.sleep(0)
        return len(states)

    async def send_heartbeat(
        self,
        peer: PeerAddress | tuple[str, int],
        request_ids: Sequence[str],
        tokens: Sequence[str] = (),
    ) -> None:
        holder = self._holder(peer)
        self._authenticate(holder)  # as the control connection's handshake would
        message = _roundtrip(Heartbeat(request_ids=list(request_ids), tokens=list(tokens)))
        await asyncio.sleep(0)
        if holder.callbacks.on_heartbeat is not None:
            holder.callbacks.on_heartbeat(self.engine_id, message.request_ids, message.tokens)

    async def notify_transfer_done(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        *,
        success: bool,
        reason: str = "",
        token: str = "",
    ) -> None:
        holder = self._holder(peer)
        self._authenticate(holder)  # as the control connection's handshake would
        notice = _roundtrip(
            transfer_done_notice(
                peer_engine_id=self.engine_id, request_id=request_id, success=success,
                reason=reason, token=token,
            )
        )
        await asyncio.sleep(0)
        if holder.callbacks.on_transfer_done is not None:
            holder.callbacks.on_transfer_done(notice)

    # ------------------------------------------------------------------ holder side

    async def _wait_or_drop(self, delay_s: float, state: ReadState) -> None:
        if delay_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._dropped.wait(), delay_s)
        if self._dropped.is_set():
            raise state.error(TransferError, f"holder {self.engine_id!r} went away")

    async def _serve(
        self, read: Read, requester: LoopbackTransport, state: ReadState
    ) -> ReadResult:
        faults = self.faults
        await self._wait_or_drop(faults.serve_delay_s, state)
        try:
            check_read(self.metadata, read)
            for entry, group in enumerate(read.groups):
                for position, block_id in enumerate(group.block_ids):
                    if block_id in faults.refuse_block_ids:
                        raise WireError(
                            f"groups[{entry}]: block id {block_id} at position {position} refused"
                        )
        except WireError as exc:
            raise state.error(TransferError, f"holder refused the read: {exc}") from None
        mismatched = find_mismatched(
            read,
            self.callbacks.block_validator,
            serve_unchecked=self.callbacks.serve_unchecked_reads,
        )
        for entry, group in enumerate(read.groups):
            extra = [p for p, b in enumerate(group.block_ids) if b in faults.fail_block_ids]
            mismatched[entry] = sorted(set(mismatched[entry]) | set(extra))
        state.mismatched = mismatched
        state.lease_pending = self.callbacks.refusal_pending(read.lease, mismatched)
        if faults.stall:
            await self._dropped.wait()
            raise state.error(TransferError, f"holder {self.engine_id!r} went away")
        good = [good_positions(len(g.block_ids), mismatched[i]) for i, g in enumerate(read.groups)]
        group_ids = [g.group_id for g in read.groups]
        chunks = plan_chunks(self.metadata, group_ids, [len(p) for p in good], read.chunk_bytes)
        late: list[list[int]] = [[] for _ in read.groups]
        for chunk_idx, chunk in enumerate(chunks):
            if faults.drop_after_chunks is not None and chunk_idx >= faults.drop_after_chunks:
                self.drop()
            if faults.stall_after_chunks is not None and chunk_idx >= faults.stall_after_chunks:
                await self._dropped.wait()
                raise state.error(TransferError, f"holder {self.engine_id!r} went away")
            await self._wait_or_drop(faults.chunk_delay_s, state)
            group = read.groups[chunk.entry]
            positions = good[chunk.entry][chunk.start : chunk.stop]
            src_caches = self.kv_caches_by_group[group.group_id]
            dst_caches = requester.kv_caches_by_group[group.group_id]
            src_ids = torch.tensor([group.block_ids[p] for p in positions], dtype=torch.int64)
            dst_ids = torch.tensor(
                [state.local_block_ids[chunk.entry][p] for p in positions], dtype=torch.int64
            )
            staging = gather_blocks(src_caches, src_ids.to(src_caches[0].device))
            # the bytes are copied out: re-check, as the UCX holder does after each gather
            late[chunk.entry].extend(self._recheck(group, positions, read.lease))
            scatter_blocks(
                staging.to(dst_caches[0].device), dst_caches, dst_ids.to(dst_caches[0].device)
            )
            state.landed[chunk.entry].update(positions)
            state.num_bytes_landed += staging.numel() * staging.element_size()
            await asyncio.sleep(0)
        if expects_read_done(read):
            done = _roundtrip(ReadDone(transfer_id=read.transfer_id, mismatched=late))
            try:
                check_read_done(read, state.mismatched, done.mismatched)
            except WireError as exc:
                raise state.error(TransferError, f"no valid ReadDone: {exc}") from None
            state.fail_late(done.mismatched, block_nbytes_by_entry(self.metadata, read))
        return state.result()

    def _recheck(
        self, group: GroupReadMsg, positions: list[int], lease: LeaseRef | None
    ) -> list[int]:
        """Holder side, after a chunk's copy: positions that fail the validator now (under the
        read's ``lease``), or that ``faults.evict_during_copy_block_ids`` evicts (groups with
        expected hashes only)."""
        if group.expected_hashes is None:
            return []
        late = set(recheck_blocks(group, positions, self.callbacks.recheck_validator, lease))
        evicted = self.faults.evict_during_copy_block_ids
        late.update(p for p in positions if group.block_ids[p] in evicted)
        return sorted(late)
