"""The ``Transport`` protocol: what the connector calls, stated once for both implementations.

Roles. Every node is both a *holder* (serves reads of its KV blocks to peers) and a *requester*
(pulls blocks from peers into its own KV tensors). A read is a pull: "give me these remote block
ids, per group and layer, into these local block ids". Local and remote ids are paired by
position (docs/architecture.md, "Pairing by position").

Lease support. The transport carries the messages; the policy lives in the connector:

- requester side: ``send_heartbeat(peer, request_ids, tokens)`` periodically while a request's
  blocks are needed; ``notify_transfer_done(peer, request_id, success=..., reason=...,
  token=...)`` once per request when the pull finished, failed, or was abandoned (a decode node
  that rejects a request). ``tokens`` / ``token``: the lease tokens of the tickets (opaque here;
  the connector's leases check them).
- holder side: ``on_heartbeat(peer_engine_id, request_ids, tokens)`` extends leases;
  ``on_transfer_done(TransferDoneNotice)`` releases the request's blocks.

Peer authentication (``auth``): a transport built with a cluster key (``auth_key``) proves it to
every peer and demands the proof back in the handshake; a peer that fails is refused before it
can send a read, a heartbeat or a notice, and before it learns this node's layout or addresses.
- holder side, per read that sends expected hashes: ``block_validator(group_id, block_ids,
  expected_hashes, lease)`` returns the positions (into ``block_ids``) whose block no longer
  carries the expected hash. ``lease`` is the read's ``LeaseRef`` (a handoff's lease, presented
  by the requester in its own field) or None; a position with an empty expected hash is guarded
  by that lease alone, or not checked without one. It runs when the read arrives (over all
  blocks of a group: those blocks are not sent) and again over each chunk's blocks right after
  their bytes were copied out, with the same ``lease`` (a block read through the index is not
  referenced on the holder and may be evicted and reused meanwhile: those blocks' bytes were
  sent, but the requester counts them as failed, never as landed; ``plan``, "Hash checks on the
  holder"). Both kinds come back to the requester in
  ``ReadResult.failed_local_block_ids`` (never stale bytes counted as landed). A read under a
  lease whose positions were refused also learns whether asking again may help
  (``lease_pending``: the holder has not been handed that lease yet); otherwise the refusal is
  final. The validator
  must be cheap (dict / attribute reads). A node whose validator has effects meant once per read
  (stats, LRU touches) registers a side-effect-free ``block_rechecker`` (same signature) for the
  re-checks; without one, ``block_validator`` serves both. The transport compares nothing
  itself: hashes are opaque bytes.

Callbacks run on the holder's event loop thread and must not block.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .board_look import BoardRef
from .cma_board import BlockBoard
from .metadata import NodeMetadata
from .wire import LeaseRef, TransferDoneNotice


class PeerAddress(NamedTuple):
    """Where a holder listens for control connections (``kv_transfer_params`` remote_host /
    remote_port)."""

    host: str
    port: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupRead:
    """One KV cache group's part of a read.

    Attributes:
        group_id: index into the node's ``kv_caches_by_group`` (same on both nodes).
        remote_block_ids: block ids on the holder, ``[1, remote num_blocks)``.
        local_block_ids: block ids here, same length, distinct, ``[1, local num_blocks)``;
            ``local_block_ids[i]`` receives ``remote_block_ids[i]`` in every layer of the group.
        expected_hashes: optional opaque bytes per block (``block_hash``) the holder must still
            hold for ``remote_block_ids[i]``; checked by the holder's ``block_validator``. An
            empty one (a block without a hash) is guarded by the read's ``lease`` alone
            (``Transport.read_blocks``), or not checked when the read has none.
    """

    group_id: int
    remote_block_ids: Sequence[int]
    local_block_ids: Sequence[int]
    expected_hashes: Sequence[bytes] | None = None


class ReadResult(NamedTuple):
    """Outcome of a read that reached its end.

    ``failed_local_block_ids``: local ids (all groups, request order) whose remote block failed
    the holder's hash check, so they did not land: failed when the read arrived, their bytes were
    never written here; failed the re-check after the holder copied them out, their rows here
    hold whatever was sent (possibly another request's KV) and must not be used. Every other
    local id did land, bytes-exact. ``num_blocks_landed`` / ``num_bytes_landed`` count landed
    blocks only. ``lease_pending``: the holder refused positions of a read under a lease that
    it has not been handed yet and that has not ended (``HolderCallbacks.lease_pending``), so
    the same read may be served once it is; False: the refusal is final (another prompt's
    hashes, a lease that ended, no lease).
    """

    request_id: str
    num_blocks_landed: int
    num_bytes_landed: int
    failed_local_block_ids: tuple[int, ...]
    lease_pending: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed_local_block_ids


BlockValidator = Callable[[int, list[int], list[bytes], LeaseRef | None], Sequence[int]]
"""``(group_id, block_ids, expected_hashes, lease) -> positions that do not match``; ``lease``
is the read's (``Read.lease``), None for a read under none."""
HeartbeatCallback = Callable[[str, list[str], list[str]], None]
"""``(peer_engine_id, request_ids, tokens) -> None``; ``tokens`` is empty when the peer presented
none, else one per request id."""
TransferDoneCallback = Callable[[TransferDoneNotice], None]
LeasePin = Callable[[LeaseRef, float], bool]
LeaseUnpin = Callable[[LeaseRef], None]
LeasePending = Callable[[LeaseRef], bool]


@dataclass(kw_only=True, slots=True)
class HolderCallbacks:
    """Holder-side hooks the connector registers with ``Transport.set_callbacks``."""

    block_validator: BlockValidator | None = None
    on_heartbeat: HeartbeatCallback | None = None
    on_transfer_done: TransferDoneCallback | None = None
    block_rechecker: BlockValidator | None = None
    lease_validator: BlockValidator | None = None
    """Checks a ``copy_first`` read: a position is good only while the read's own lease covers
    its block with the expected hash (the copy may start before the check, so a hash in the
    prefix cache cannot vouch for the bytes: the block may be reused and recomputed during the
    copy; a lease held at the check was held since before its ticket existed). None, with a
    ``block_validator`` set: such reads are refused whole."""
    lease_pin: LeasePin | None = None
    """``(lease, seconds) -> held``: keep a ``copy_first`` read's lease from ending (released
    or expired) for ``seconds``, until ``lease_unpin``; False when it is not held (the read is
    refused whole). A pinned lease keeps its blocks unchanged from its ticket until after the
    requester's last possible copy, so the read needs no re-check. None, with a
    ``block_validator`` set: ``copy_first`` reads are refused whole."""
    lease_unpin: LeaseUnpin | None = None
    """``(lease) -> None``: undo one ``lease_pin`` (the read's ``ReadCopied``, ``Cancel`` or
    deadline)."""
    lease_pending: LeasePending | None = None
    """``(lease) -> pending``: asked when a read under ``lease`` has refused positions; True
    when the holder may yet be handed that lease (not held with that token, not ended), so
    asking again may succeed (``ReadOk.lease_pending``). None: every refusal is final."""
    serve_unchecked_reads: bool = True
    """Whether a read group sent without expected hashes is served (a raw transport: yes); a
    connector's holder and the store say no, so every block they serve is vouched for by a hash
    or a lease (``plan.find_mismatched``)."""

    @property
    def recheck_validator(self) -> BlockValidator | None:
        """The validator of the re-checks after a copy: ``block_rechecker``, else
        ``block_validator``."""
        return self.block_rechecker if self.block_rechecker is not None else self.block_validator

    def refusal_pending(self, lease: LeaseRef | None, mismatched: Sequence[Sequence[int]]) -> bool:
        """What a holder answers in ``ReadOk.lease_pending`` for a read under ``lease`` whose
        refused positions are ``mismatched`` (per group entry): True only when some position
        was refused and ``lease_pending`` says the lease may yet be granted."""
        return (
            lease is not None
            and self.lease_pending is not None
            and any(mismatched)
            and self.lease_pending(lease)
        )

    def validators_for(self, copy_first: bool) -> tuple[BlockValidator | None, ...]:
        """``(check, re-check)`` validators of a read: a ``copy_first`` read is checked by the
        ``lease_validator`` (or refused whole when only a ``block_validator`` is set) and never
        re-checked; another read's are ``block_validator`` and ``recheck_validator``."""
        if not copy_first:
            return self.block_validator, self.recheck_validator
        if self.lease_validator is not None or self.block_validator is None:
            return self.lease_validator, None
        return _refuse_every_position, None

    @property
    def vouches(self) -> bool:
        """Whether this holder checks what it serves (a raw transport with no validator serves
        every block as it is)."""
        return self.block_validator is not None or self.lease_validator is not None


def _refuse_every_position(
    group_id: int, block_ids: list[int], expected_hashes: list[bytes], lease: LeaseRef | None
) -> list[int]:
    """A ``BlockValidator`` that vouches for nothing."""
    return list(range(len(block_ids)))


DEFAULT_CHUNK_BYTES = 4 << 20
"""Staging chunk size: large enough that per-message cost is small (one message per block is
far slower: docs/architecture.md, "Design measurements"), small enough to pipeline the chunks."""


class Transport(abc.ABC):
    """Moves paged KV blocks between nodes. Both ``UcxxTransport`` and ``LoopbackTransport``
    implement this contract with the same semantics.

    Construction: ``Impl(metadata, kv_caches_by_group, *, host=..., port=0, ...)`` where
    ``kv_caches_by_group[g][layer]`` is that layer's KV tensor
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (kvbridge.kernels.layout), on CPU or
    CUDA. The tensors are read (holder) and mutated (requester: the local block rows of a read)
    by the transport; nothing else is mutated.
    """

    metadata: NodeMetadata
    callbacks: HolderCallbacks
    block_board: BlockBoard | None = None
    """Where this holder publishes its leased blocks for one-sided same-host reads
    (``cma_board``; the lease table writes it), or None when it offers none."""

    @property
    def engine_id(self) -> str:
        return self.metadata.engine_id

    @property
    @abc.abstractmethod
    def address(self) -> PeerAddress:
        """Host and port peers connect to (valid after ``start``)."""

    def one_sided_holders(self) -> list[BoardRef]:
        """The connected holders ``read_one_sided`` may read (a hint: a read can still be
        declined), each with where its block board is (``board_look.BoardRef``: a scheduler
        may look at it before planning a read); any thread. This default: none."""
        return []

    def read_one_sided(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        groups: Sequence[GroupRead],
        *,
        lease: LeaseRef,
        incarnation: str,
        heads: tuple[int, int] | None = None,
    ) -> ReadResult | None:
        """A handoff read done on the calling thread (any thread) with no message to the
        holder (``heads`` as for ``read_blocks``; the holder's handshake must say it holds
        them), where the transport can vouch for it by itself (``UcxxTransport``: a same-host
        holder with a block board, ``cma_board``); every block lands, bytes-exact, before it
        returns. None, with nothing counted, where it cannot (no connection to ``peer`` yet, a
        peer whose incarnation is not ``incarnation``, no board, a board that does not vouch
        for every block, a read too large to copy without stalling the caller): the caller
        then uses ``read_blocks``, and the read's own local blocks may hold partial bytes
        meanwhile. This default never can."""
        return None

    def set_callbacks(
        self,
        *,
        block_validator: BlockValidator | None = None,
        on_heartbeat: HeartbeatCallback | None = None,
        on_transfer_done: TransferDoneCallback | None = None,
        block_rechecker: BlockValidator | None = None,
        lease_validator: BlockValidator | None = None,
        lease_pin: LeasePin | None = None,
        lease_unpin: LeaseUnpin | None = None,
        lease_pending: LeasePending | None = None,
        serve_unchecked_reads: bool = True,
    ) -> None:
        """Register the holder-side hooks (see the module docstring); ``None`` leaves one unset.
        Replaces every hook registered before; a read already being served keeps the
        re-check it arrived with (``UcxxTransport``)."""
        self.callbacks = HolderCallbacks(
            block_validator=block_validator,
            on_heartbeat=on_heartbeat,
            on_transfer_done=on_transfer_done,
            block_rechecker=block_rechecker,
            lease_validator=lease_validator,
            lease_pin=lease_pin,
            lease_unpin=lease_unpin,
            lease_pending=lease_pending,
            serve_unchecked_reads=serve_unchecked_reads,
        )

    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving on ``address``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving, fail in-flight reads (``TransferError``), release staging. Idempotent."""

    def peer_data_path(self, peer: PeerAddress | tuple[str, int]) -> str | None:
        """How reads from ``peer`` move their bytes (``UcxxTransport``: ``"ucx"`` or ``"cma"``,
        a same-host copy), or None where the transport does not say or has not connected."""
        return None

    @abc.abstractmethod
    async def connect(self, peer: PeerAddress | tuple[str, int]) -> NodeMetadata:
        """Handshake with ``peer`` (cached per peer; a new incarnation reconnects).

        Returns:
            the peer's ``NodeMetadata``.

        Raises:
            HandshakeError: incompatible peer (names the differing field) or no answer.
            TransportError: peer unreachable.
        """

    @abc.abstractmethod
    async def read_blocks(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        groups: Sequence[GroupRead],
        *,
        deadline_s: float,
        lease: LeaseRef | None = None,
        heads: tuple[int, int] | None = None,
    ) -> ReadResult:
        """Pull ``remote_block_ids`` of each group from ``peer`` into ``local_block_ids`` here.

        ``lease``: the handoff's lease on ``peer`` this read is made under (sent as
        ``Read.lease``; the holder's validator guards the positions with an empty expected
        hash by it), None for a read through the block index.

        ``heads``: the model's KV heads ``(start, stop)`` to move of each block (``Read.heads``,
        ``transport.heads``): both nodes must hold them, the holder refuses the read otherwise
        (``TransferError`` naming what it holds). None: the heads this node holds when its
        metadata names them (``NodeMetadata.kv_heads``), else whole rows. A tensor-parallel
        rank reading from a holder of another tensor-parallel size passes the part it reads
        from that holder.

        Blocks are gathered on the holder into staging chunks of about ``DEFAULT_CHUNK_BYTES``,
        sent, and scattered here chunk by chunk (kvbridge.kernels gather/scatter).

        Returns:
            ``ReadResult``; blocks the holder's ``block_validator`` rejected, when the read
            arrived or after the holder copied their bytes out, are in
            ``failed_local_block_ids``. A read with expected hashes returns only after the
            holder's ``ReadDone`` (its re-check results) arrived.

        Raises:
            ValueError: caller mistake (unknown group, lengths differ, local id out of
                ``[1, num_blocks)`` or repeated, ``deadline_s <= 0``, heads this node does not
                hold).
            HandshakeError: incompatible peer.
            TransferTimeoutError: ``deadline_s`` passed (holder hung or dead).
            TransferCancelledError: ``cancel(request_id)`` was called.
            TransferError: the holder refused (e.g. remote id out of range), died, or closed,
                or its ``ReadDone`` never came or did not fit the read (then every block of the
                groups read with expected hashes counts as not landed).
                ``local_block_ids`` names every local block that did not land; blocks of a
                partially landed read may hold any bytes.
            asyncio.CancelledError: the task was cancelled; staging is released and the holder
                told, as for ``cancel``.
        """

    @abc.abstractmethod
    async def cancel(self, request_id: str) -> int:
        """Cancel this node's in-flight reads for ``request_id``; returns how many. The holder is
        told and stops sending; both sides release staging before the reads return."""

    @abc.abstractmethod
    async def send_heartbeat(
        self,
        peer: PeerAddress | tuple[str, int],
        request_ids: Sequence[str],
        tokens: Sequence[str] = (),
    ) -> None:
        """Tell ``peer`` that these request ids are still wanted (its ``on_heartbeat``);
        ``tokens``: one lease token per id, or none.

        Raises:
            TransportError: peer unreachable.
        """

    @abc.abstractmethod
    async def notify_transfer_done(
        self,
        peer: PeerAddress | tuple[str, int],
        request_id: str,
        *,
        success: bool,
        reason: str = "",
        token: str = "",
        puller_rank: int = 0,
        num_pullers: int = 1,
    ) -> None:
        """Completion notice for ``request_id`` (its ``on_transfer_done``), presenting the
        lease ``token`` of its ticket; from rank ``puller_rank`` of a puller of ``num_pullers``
        ranks (tensor parallel: the lease ends once every rank's notice came). It reaches a peer
        that is incompatible with this node too (a node that refused a handoff for that must
        still free the holder's blocks): ``UcxxTransport`` then sends it over a notices-only
        connection (``wire.Hello``), the loopback twin checks the cluster key alone; a peer
        with another cluster key refuses it.

        Raises:
            TransportError: peer unreachable.
            HandshakeError: the peer refused even a notices-only connection (the cluster key).
        """


def check_kv_caches_match(
    metadata: NodeMetadata, kv_caches_by_group: Sequence[Sequence[torch.Tensor]]
) -> None:
    """Raise ``ValueError`` unless ``metadata.groups`` describes ``kv_caches_by_group``."""
    from .metadata import KVGroupLayout

    if len(kv_caches_by_group) != len(metadata.groups):
        raise ValueError(
            f"metadata has {len(metadata.groups)} groups, kv_caches_by_group has "
            f"{len(kv_caches_by_group)}"
        )
    for group_id, (layout, caches) in enumerate(
        zip(metadata.groups, kv_caches_by_group, strict=False)
    ):
        actual = KVGroupLayout.from_kv_caches(caches)
        if actual != layout:
            raise ValueError(f"group {group_id}: metadata says {layout}, tensors are {actual}")
        for layer_idx, kv_cache in enumerate(caches):
            if not kv_cache.is_contiguous():
                raise ValueError(f"group {group_id} layer {layer_idx}: KV tensor not contiguous")
