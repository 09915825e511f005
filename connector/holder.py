"""The holder side of a node: whether a block may be served to a peer, and when a lease ends.

A holder serves reads from its own KV tensors (the transport does the bytes); the worker half
decides, through the transport's callbacks, whether a block may be served:

- a block read under a handoff's lease (``LeaseTable``) is served while the lease is held and
  protects that block at a position with the hash the requester expects (a ticket handed to
  the wrong request names other hashes: refused, the requester recomputes at once; only a
  lease this node may yet be handed, ``lease_pending``, lets the requester ask again);
- a block read through the block index is served while this node's mirror of its prefix-cache
  identities (``HeldBlockHashes``, fed by the scheduler half's ``BlockHashDelta`` orders) says
  it holds the expected hash, so a block evicted and reused meanwhile is refused (a hit is
  advisory: docs/architecture.md, "Life of an index hit").

``on_heartbeat`` extends the leases a puller depends on; ``on_transfer_done`` ends one. Tickets
are capabilities (``lease``): a heartbeat or a release that does not present the lease's token
is refused, counted (``num_refused_lease_tokens``) and leaves the lease as it was; a read under
a lease (``Read.lease``) without its token is refused the blocks only that lease guards.
Callbacks run on the connector's event-loop thread and never block; nothing here reads the
scheduler half's block pool.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from kvbridge.kvmanager.block_hash import make_block_hash_with_group_id
from kvbridge.transport import LeaseRef, TransferDoneNotice

from .lease import LeaseTable
from .metadata import BlockHashDelta
from .stats import KVTransferStats

__all__ = ["HeldBlockHashes", "HolderChecks"]


def _always() -> bool:
    return True


class HeldBlockHashes:
    """Block id -> the ``BlockHashWithGroupId`` it holds, as the scheduler half reported.

    Thread-safety: the worker thread applies deltas, the loop thread reads; one lock. Order
    (``BlockHashDelta``): removals before the step's forward may overwrite a block, stores once
    the forward has computed it, so at every moment a listed hash describes the bytes there.
    On a GPU the worker thread reaches ``wait_for_save`` when the forward is launched, not
    finished: its stores come with ``done`` (``forward_marker.forward_done_marker``) and are
    listed only once ``done()`` says the device computed them; a later removal of one of
    their blocks drops it from them too, so a block reused in between is never listed.
    """

    def __init__(self) -> None:
        self._block_to_hash: dict[int, bytes] = {}
        self._pending: deque[tuple[Callable[[], bool], dict[int, bytes]]] = deque()
        self._lock = threading.Lock()

    def apply_removals(self, delta: BlockHashDelta) -> None:
        with self._lock:
            self._list_computed()
            if delta.cleared:
                self._block_to_hash.clear()
                self._pending.clear()
            self._drop(delta.removed_block_ids)

    def apply_stores(self, delta: BlockHashDelta, done: Callable[[], bool] | None = None,
                     unlisted: Iterable[int] = ()) -> None:
        """List ``delta``'s stores now (``done`` None: the forward has finished) or once
        ``done()`` is true, after every store given before them (one stream: in order); the
        blocks in ``unlisted`` (a failed sync pull's: vLLM cached them before the load) never."""
        stores = dict(zip(delta.stored_block_ids, delta.stored_hashes, strict=True))
        for block_id in unlisted:
            stores.pop(block_id, None)
        with self._lock:
            if done is None and not self._pending:
                self._block_to_hash.update(stores)
                return
            self._pending.append((done or _always, stores))
            self._list_computed()

    def forget(self, block_ids: Iterable[int]) -> None:
        """Stop listing ``block_ids`` (blocks a pull did not fill: their bytes are not the hash
        vLLM cached them under) until a later delta stores them again."""
        with self._lock:
            self._drop(block_ids)

    def holds(self, block_id: int, block_hash_with_group: bytes) -> bool:
        with self._lock:
            self._list_computed()
            return self._block_to_hash.get(block_id) == block_hash_with_group

    def _drop(self, block_ids: Iterable[int]) -> None:
        """Unlist ``block_ids``, listed or pending (lock held)."""
        for block_id in block_ids:
            self._block_to_hash.pop(block_id, None)
            for _, stores in self._pending:
                stores.pop(block_id, None)

    def _list_computed(self) -> None:
        """Move the pending stores whose forward is done into the map (lock held)."""
        while self._pending and self._pending[0][0]():
            self._block_to_hash.update(self._pending.popleft()[1])

    def __len__(self) -> int:
        with self._lock:
            return len(self._block_to_hash)


class HolderChecks:
    """One node's transport callbacks: ``transport.set_callbacks(**checks.as_kwargs())``.

    Owner: the connector loop thread, the only caller of ``validate_blocks``, ``on_heartbeat``
    and ``on_transfer_done`` (the transport runs its callbacks there). The worker thread builds
    it in ``KVBridgeWorker.register_kv_caches`` and calls nothing of it afterwards. It has no
    mutable state of its own: its fields are set once at construction, and what it reads and
    changes lives in objects that lock themselves and that the worker thread shares (``leases``,
    ``hashes``, ``stats``), so a callback never waits for the worker thread beyond their locks.

    Args:
        leases: the worker half's lease table.
        hashes: the worker half's mirror of cached block hashes.
        stats: the worker half's statistics.
        num_blocks: blocks of the node's pool (ids from the network are range-checked).
        bytes_per_block: per group, KV bytes of one block over all the group's layers.
    """

    def __init__(
        self,
        *,
        leases: LeaseTable,
        hashes: HeldBlockHashes,
        stats: KVTransferStats,
        num_blocks: int,
        bytes_per_block: Sequence[int],
    ) -> None:
        self.leases = leases
        self.hashes = hashes
        self.stats = stats
        self.num_blocks = num_blocks
        self.bytes_per_block = tuple(bytes_per_block)

    def as_kwargs(self) -> dict[str, object]:
        return {
            "block_validator": self.validate_blocks,
            "block_rechecker": self.recheck_blocks,
            "lease_validator": self.validate_by_lease,
            "lease_pin": self.pin_lease,
            "lease_unpin": self.unpin_lease,
            "lease_pending": self.lease_pending,
            "on_heartbeat": self.on_heartbeat,
            "on_transfer_done": self.on_transfer_done,
            "serve_unchecked_reads": False,  # every block served needs a hash or the lease
        }

    def validate_blocks(
        self,
        group_id: int,
        block_ids: list[int],
        expected_hashes: list[bytes],
        lease: LeaseRef | None,
    ) -> list[int]:
        """Positions whose block does not hold the expected content now (a
        ``transport.BlockValidator``; loop thread, never blocks).

        Args:
            group_id: the KV cache group read.
            block_ids: block ids on this node, as the requester sent them.
            expected_hashes: per position, the requester's block hash, or ``b""`` for a block
                without one (the partial last block of a handoff).
            lease: the read's lease (``Read.lease``): a position with an empty expected hash is
                served only while that lease is held, has the presented token and covers the
                block at a position without a hash. None: a position with an empty expected
                hash is refused (nothing vouches for it: a read must name a hash or a lease).

        Returns:
            positions to refuse: unknown hash, the lease ended or not presented with its token,
            or an id outside this pool. Side-effect free, so it also serves the re-check after
            the bytes were copied.
        """

        def vouched(block_id: int, expected: bytes) -> bool:
            if expected:
                return self.hashes.holds(
                    block_id, make_block_hash_with_group_id(expected, group_id)
                ) or self.leases.covers_hash(group_id, block_id, expected)
            # a block without a hash: only the read's lease vouches for it
            return lease is not None and self.leases.covers(
                lease.request_id, group_id, block_id, None, lease.token
            )

        return self._refused(block_ids, expected_hashes, vouched)

    def recheck_blocks(
        self,
        group_id: int,
        block_ids: list[int],
        expected_hashes: list[bytes],
        lease: LeaseRef | None,
    ) -> list[int]:
        """``validate_blocks`` once a read's bytes left (the transport's ``block_rechecker``:
        once per block served, over the chunk just copied out). A read through the block index
        (no lease) counts the blocks that pass here, and their bytes, as served
        (``num_index_blocks_served``, ``bytes_sent``): the requester counts the same blocks as
        landed. Loop thread, never blocks."""
        refused = self.validate_blocks(group_id, block_ids, expected_hashes, lease)
        if lease is None:
            num_served = len(block_ids) - len(refused)
            if num_served:
                self.stats.add("num_index_blocks_served", num_served)
                self.stats.add("bytes_sent", num_served * self.bytes_per_block[group_id])
        return refused

    def validate_by_lease(
        self,
        group_id: int,
        block_ids: list[int],
        expected_hashes: list[bytes],
        lease: LeaseRef | None,
    ) -> list[int]:
        """``validate_blocks`` for a read that copies before the holder checks it
        (``Read.copy_first``, ``transport.HolderCallbacks.lease_validator``; the holder then
        pins the lease, ``pin_lease``): a position is good only while the read's own lease,
        with its token, covers its block with the expected hash (``b""``: the partial last
        block, without one). Loop thread, never blocks."""

        def vouched(block_id: int, expected: bytes) -> bool:
            return lease is not None and self.leases.covers(
                lease.request_id, group_id, block_id, expected or None, lease.token
            )

        return self._refused(block_ids, expected_hashes, vouched)

    def _refused(
        self,
        block_ids: list[int],
        expected_hashes: list[bytes],
        vouched: Callable[[int, bytes], bool],
    ) -> list[int]:
        """Positions whose id is outside this pool (from the network) or that ``vouched``
        refuses."""
        return [
            pos
            for pos, (block_id, expected) in enumerate(zip(block_ids, expected_hashes, strict=True))
            if not (0 < block_id < self.num_blocks and vouched(block_id, expected))
        ]

    def pin_lease(self, lease: LeaseRef, seconds: float) -> bool:
        """Keep ``lease`` from ending for ``seconds`` and until ``unpin_lease`` (a copy-first
        read may be copying its blocks: ``LeaseTable.pin``); False when it is not held with
        that token. Loop thread."""
        return self.leases.pin(lease.request_id, lease.token, seconds)

    def unpin_lease(self, lease: LeaseRef) -> None:
        """Undo one ``pin_lease`` (``LeaseTable.unpin``). Loop thread."""
        self.leases.unpin(lease.request_id)

    def lease_pending(self, lease: LeaseRef) -> bool:
        """Whether ``lease`` may yet be granted here (``LeaseTable.grant_pending``), so a read
        refused under it now may be served when asked again; False for a lease held or ended
        (another prompt's ticket, a stale one): the requester fails the load at once. Loop
        thread."""
        return self.leases.grant_pending(lease.request_id, lease.token)

    def on_heartbeat(self, peer_engine_id: str, request_ids: list[str], tokens: list[str]) -> None:
        """Extend the leases named with their right token (``tokens[i]`` for
        ``request_ids[i]``; an empty list presents none); count the refused ones."""
        tokens = tokens or [""] * len(request_ids)
        pairs = zip(request_ids, tokens, strict=True)
        refused = sum(1 for rid, token in pairs if not self.leases.token_ok(rid, token))
        if refused:
            self.stats.add("num_refused_lease_tokens", refused)
        self.leases.extend(request_ids, tokens)

    def on_transfer_done(self, notice: TransferDoneNotice) -> None:
        """The puller is done with a request (or gave up): end its lease now, if the notice
        presents the lease's token and every rank of the puller has sent one
        (``LeaseTable.release``)."""
        if not self.leases.token_ok(notice.request_id, notice.token):
            self.stats.add("num_refused_lease_tokens")
            return
        held = self.leases.block_ids(notice.request_id)
        ended = self.leases.release(
            notice.request_id, notice.token, notice.puller_rank, notice.num_pullers
        )
        if ended and held is not None:
            self.stats.add("num_released_leases")
            if notice.success:
                self.stats.add("bytes_sent", self._held_nbytes(held))

    def _held_nbytes(self, held: tuple[tuple[int, ...], ...]) -> int:
        """KV bytes of the held blocks over every layer (the null block 0 holds none)."""
        return sum(
            nbytes * sum(1 for b in ids if b != 0)
            for nbytes, ids in zip(self.bytes_per_block, held, strict=True)
        )
