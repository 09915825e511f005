"""What the two halves of a node's connector tell each other, and nothing else.

The halves share no object (docs/architecture.md, "The two connector halves"; in vLLM they are
separate objects, with a multiprocess executor separate processes). Each step:

    scheduler half --- KVBridgeConnectorMetadata (build_connector_meta) ---> worker half
    worker half ---- finished_sending / finished_recving / load errors ----> scheduler half
                ---- KVBridgeWorkerMeta (build_connector_worker_meta) ------>

Both are ``msgspec`` structs of plain values (ints, strings, bytes, lists), so a step's messages
cross a process boundary as msgpack (``encode_metadata`` / ``decode_metadata``), never pickle.
The decoders check every field's type; a message of another schema version is refused.
"""

from __future__ import annotations

from typing import Any

import msgspec
from kvbridge.transport import BlockIdentity, BoardRef, GroupRead, LeaseRef

__all__ = [
    "METADATA_SCHEMA_VERSION",
    "BlockHashDelta",
    "HolderRef",
    "KVBridgeConnectorMetadata",
    "KVBridgeWorkerMeta",
    "LeaseGrant",
    "PullPlan",
    "PullReport",
    "ReleaseNotice",
    "StatsDelta",
    "Ticket",
    "WorkerHandshake",
    "decode_metadata",
    "decode_worker_meta",
    "encode_metadata",
    "encode_worker_meta",
]

METADATA_SCHEMA_VERSION = 5
# 2: offload outcomes carry ``missing``
# 3: WorkerHandshake.identity; tensor parallelism: PullPlan.remote_ranks, WorkerHandshake's
#    layout, reports by rank
# 4: KVBridgeWorkerMeta.one_sided_holders carry the holders' boards (``BoardRef``)
# 5: ``step_id`` in the step's orders and in the worker's report of that step


class HolderRef(msgspec.Struct, frozen=True, kw_only=True):
    """The node a pull reads from: who it must be (``engine_id``, ``incarnation``: a restarted
    holder no longer holds the blocks) and where it listens. ``tier`` is ``"store"`` for the
    store tier (its pulls count as restores)."""

    engine_id: str
    incarnation: str
    host: str
    port: int
    tier: str = "device"


class Ticket(msgspec.Struct, frozen=True):
    """A P/D handoff's lease on its prefill node: ``remote_request_id`` names it there and
    ``token`` (``remote_lease_token``) is the capability its heartbeats, release notice and
    reads present (``lease``)."""

    host: str
    port: int
    remote_request_id: str
    token: str = ""

    def lease_ref(self) -> LeaseRef:
        """How a read under this ticket names its lease to the holder (``Read.lease``)."""
        return LeaseRef(request_id=self.remote_request_id, token=self.token)


class PullPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the worker half needs to pull one request's external KV.

    Attributes:
        request_id: the request here (the decode side).
        holder: where from.
        lease: the handoff's lease on the holder (its heartbeats, release notice and reads,
            which present it as ``Read.lease``: the positions without a hash are served under
            it), or None for a pull found through the block index (nothing is held for it: the
            holder's hash re-check is its only guard).
        groups: per KV cache group, the paired blocks (``pull_plan.plan_group_pulls``).
        unloadable_block_ids: local blocks the holder cannot supply (its null block there).
        num_external_tokens: tokens the pull covers.
        created_at: ``time.monotonic()`` of the scheduler half when it planned the pull (the
            same clock as the worker's only when both share a host; used for queueing time).
        sync: the pull feeds this step's forward (``load_mode`` ``"sync"``): the worker half
            waits for it in ``start_load_kv`` and reports only its failed blocks, never the
            request in ``finished_recving`` (vLLM's synchronous external load).
        remote_ranks: every rank of a tensor-parallel holder by tp rank (``holder`` is rank 0;
            each holds ``lease`` under the same id and token at its own address); empty: a
            holder of one rank. Each local rank reads the KV heads it holds from the ranks
            that hold them (``tp_layout.head_sources``).
        refused: why the scheduler half refused the ticket itself (another prompt's, under
            the ``"fail"`` policy): every block is in ``unloadable_block_ids``, nothing is
            read, and the load fails with this error; ``""`` otherwise.
    """

    request_id: str
    holder: HolderRef
    lease: Ticket | None
    groups: list[GroupRead]
    unloadable_block_ids: list[int]
    num_external_tokens: int
    created_at: float
    sync: bool = False
    remote_ranks: list[HolderRef] = msgspec.field(default_factory=list)
    refused: str = ""

    def holders(self) -> list[HolderRef]:
        """The holder's ranks by tp rank (``[holder]`` for a holder of one rank)."""
        return self.remote_ranks or [self.holder]

    def rank_leases(self) -> list[Ticket]:
        """``lease`` at every rank of the holder (empty for a pull without a lease)."""
        lease = self.lease
        if lease is None:
            return []
        request_id, token = lease.remote_request_id, lease.token
        return [Ticket(h.host, h.port, request_id, token) for h in self.holders()]

    def local_block_ids(self) -> list[int]:
        """Every local block this pull writes or was meant to write."""
        return [b for g in self.groups for b in g.local_block_ids] + self.unloadable_block_ids


class ReleaseNotice(msgspec.Struct, frozen=True, kw_only=True):
    """Tell a prefill node it may release a request's blocks (no pull needed, or gave up)."""

    ticket: Ticket
    success: bool
    reason: str


class LeaseGrant(msgspec.Struct, frozen=True, kw_only=True):
    """A finished prefill request whose blocks this node keeps for a puller.

    Attributes:
        request_id: the request here (the prefill side); the lease's name.
        block_ids: per KV cache group, the held blocks in position order (0: the null block).
        block_hashes: the request's full-block hashes (plain ``BlockHash``, position order);
            a position at or past ``len(block_hashes)`` (the partial last block) has none and
            is served only under this lease.
        lease_s: how long the lease lasts without a heartbeat.
        token: the ticket's capability (``RemotePrefillParams.remote_lease_token``).
    """

    request_id: str
    block_ids: list[list[int]]
    block_hashes: list[bytes]
    lease_s: float
    token: str = ""


class BlockHashDelta(msgspec.Struct, frozen=True, kw_only=True):
    """How the prefix-cache identity of this node's blocks changed in one step (from the block
    pool's events), for the holder's re-check of pulls found through the index.

    ``removed_block_ids`` lost their hash before this step's forward may overwrite them (apply
    before the forward); ``stored_block_ids[i]`` holds ``stored_hashes[i]`` (a
    ``BlockHashWithGroupId``) once this step's forward has computed it (apply after the
    forward); ``cleared``: every hash went (``reset_prefix_cache``), applied first.
    """

    cleared: bool = False
    removed_block_ids: list[int] = msgspec.field(default_factory=list)
    stored_block_ids: list[int] = msgspec.field(default_factory=list)
    stored_hashes: list[bytes] = msgspec.field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.cleared or self.removed_block_ids or self.stored_block_ids)


class KVBridgeConnectorMetadata(msgspec.Struct, kw_only=True):
    """One step's orders from the scheduler half to the worker half.

    Attributes:
        pulls: pulls to start.
        notices: release notices to send.
        lease_grants: leases to start (prefill side).
        tickets_to_watch: admitted requests' handoff leases to heart-beat while they wait for
            their pull; ``tickets_to_forget`` stop (the pull took over, or the request ended).
        block_hashes: this step's prefix-cache identity changes (only with a block index).
        offload_items: cold blocks to write to the store tier
            (``store.offload_items.OffloadItem`` records: block id, group id, hash, parent
            hash); snapshotted before this step's forward.
        num_scheduled_tokens: tokens this step computes (``SchedulerOutput``'s
            ``total_num_scheduled_tokens``); 0 marks an idle step, in which the worker half may
            wait briefly for pulls in flight (``idle_pull_wait_s``); None: unknown.
        step_id: which ``build_connector_meta`` made these orders (1, 2, ... per scheduler
            half; 0: not numbered). The worker half's report of the step names it back, so the
            scheduler half publishes a step's blocks after that step's forward even when vLLM
            schedules the next step first (async scheduling).
    """

    version: int = METADATA_SCHEMA_VERSION
    num_scheduled_tokens: int | None = None
    step_id: int = 0
    pulls: list[PullPlan] = msgspec.field(default_factory=list)
    notices: list[ReleaseNotice] = msgspec.field(default_factory=list)
    lease_grants: list[LeaseGrant] = msgspec.field(default_factory=list)
    tickets_to_watch: list[Ticket] = msgspec.field(default_factory=list)
    tickets_to_forget: list[Ticket] = msgspec.field(default_factory=list)
    block_hashes: BlockHashDelta = msgspec.field(default_factory=BlockHashDelta)
    offload_items: list[tuple[int, int, bytes, bytes]] = msgspec.field(default_factory=list)


class StatsDelta(msgspec.Struct, kw_only=True):
    """Counter increments and duration samples of ``KVTransferStats`` since the last report."""

    counters: dict[str, int] = msgspec.field(default_factory=dict)
    transfer_s: list[float] = msgspec.field(default_factory=list)
    queue_s: list[float] = msgspec.field(default_factory=list)


class PullReport(msgspec.Struct, frozen=True, array_like=True):
    """How one rank's part of one request's pull settled (``stats.PullTally`` counts the
    request once, when every rank's report is in): ``num_blocks`` local blocks planned, of
    which ``num_failed_blocks`` did not land; seconds the pull took and queued."""

    request_id: str
    num_blocks: int
    num_failed_blocks: int
    transfer_s: float
    queue_s: float


class KVBridgeWorkerMeta(msgspec.Struct, kw_only=True):
    """What the worker half reports each step besides finished ids and load errors: its
    statistics since its last report (``tp_rank``: which rank's), the pulls that settled since
    (``pulls``: the node counts each request once, whatever its number of ranks), what became
    of the offload items it was given (``store.offload_items.OffloadOutcome`` records) with the
    incarnation of the store that answered the latest put
    (``OffloadSender.store_incarnation``; 0: none), and, when they changed, the holders it can
    read handoffs from one-sided, with where their block boards are
    (``Transport.one_sided_holders``; None: unchanged), for ``load_mode`` ``"auto"`` and the
    scheduler's look at a ticket's blocks (``ticket_board``). ``step_id``: the orders' step
    this report ends (``KVBridgeConnectorMetadata.step_id``; 0: not numbered)."""

    version: int = METADATA_SCHEMA_VERSION
    tp_rank: int = 0
    step_id: int = 0
    stats: StatsDelta = msgspec.field(default_factory=StatsDelta)
    pulls: list[PullReport] = msgspec.field(default_factory=list)
    offload_outcomes: list[tuple[int, bytes, bool, bool]] = msgspec.field(default_factory=list)
    store_incarnation: int = 0
    one_sided_holders: list[BoardRef] | None = None

    def is_empty(self) -> bool:
        """Nothing to tell the scheduler half (an engine may skip sending such a report; a
        report that only changes ``one_sided_holders``, or that ends a numbered step, is not
        empty)."""
        stats = self.stats
        return not (stats.counters or stats.transfer_s or self.pulls or self.offload_outcomes
                    or self.one_sided_holders is not None or self.step_id)


class WorkerHandshake(msgspec.Struct, frozen=True, kw_only=True):
    """The worker half's transport, told once to the scheduler half when the transport has
    started (vLLM: ``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``, one per
    rank): the scheduler half advertises it in tickets and in the block index. ``identity`` is
    the one the transport's handshake announces (the worker half alone sees the KV tensors:
    their dtype and layout); the scheduler half's index namespace is made of it.

    A rank of a tensor-parallel engine also says its place: ``tp_rank`` of ``tp_size``, the
    model's ``total_num_kv_heads`` and whether its blocks keep a run of heads in one byte range
    (``heads_sliceable``); ``total_num_kv_heads`` 0: a worker that does not name its heads
    (kvbridge's own engine)."""

    version: int = METADATA_SCHEMA_VERSION
    engine_id: str
    incarnation: str
    host: str
    port: int
    identity: BlockIdentity
    tp_rank: int = 0
    tp_size: int = 1
    total_num_kv_heads: int = 0
    heads_sliceable: bool = False


class _Versioned(msgspec.Struct):
    """Any of the structs above, read for its version alone (other fields ignored)."""

    version: int = METADATA_SCHEMA_VERSION


_META_DECODER = msgspec.msgpack.Decoder(KVBridgeConnectorMetadata)
_WORKER_META_DECODER = msgspec.msgpack.Decoder(KVBridgeWorkerMeta)
_VERSION_DECODER = msgspec.msgpack.Decoder(_Versioned)
_ENCODER = msgspec.msgpack.Encoder()


def _check_version(version: int, what: str) -> None:
    if version != METADATA_SCHEMA_VERSION:
        raise ValueError(
            f"{what}: schema version {version}, this node speaks {METADATA_SCHEMA_VERSION}"
        )


def _decode(decoder: msgspec.msgpack.Decoder, payload: bytes, what: str) -> Any:
    """``payload`` decoded, its version checked first: a payload of another schema version
    raises ValueError naming both versions even where its fields do not decode."""
    try:
        decoded = decoder.decode(payload)
    except msgspec.ValidationError:
        try:
            version = _VERSION_DECODER.decode(payload).version
        except msgspec.DecodeError:
            version = METADATA_SCHEMA_VERSION  # not even a versioned map: the error says more
        _check_version(version, what)
        raise
    _check_version(decoded.version, what)
    return decoded


def encode_metadata(metadata: KVBridgeConnectorMetadata) -> bytes:
    """msgpack bytes of one step's metadata."""
    return _ENCODER.encode(metadata)


def decode_metadata(payload: bytes) -> KVBridgeConnectorMetadata:
    """The metadata ``encode_metadata`` wrote. Raises ``msgspec.ValidationError`` naming the bad
    field, or ValueError for another schema version."""
    return _decode(_META_DECODER, payload, "connector metadata")


def encode_worker_meta(meta: KVBridgeWorkerMeta) -> bytes:
    """msgpack bytes of one step's worker report."""
    return _ENCODER.encode(meta)


def decode_worker_meta(payload: bytes) -> KVBridgeWorkerMeta:
    """The report ``encode_worker_meta`` wrote (same errors as ``decode_metadata``)."""
    return _decode(_WORKER_META_DECODER, payload, "worker metadata")
