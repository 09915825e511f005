"""Leases on the prefill side: how long P keeps a finished request's blocks for a puller.

A prefill node that finished a request with ``do_remote_decode`` keeps its blocks referenced
(``delay_free``) until the decode node reports the pull done, or until the lease runs out; each
heartbeat from the puller extends it (docs/architecture.md, "Leases and heartbeats": a prefill
node never pins blocks forever). Expiry and release both hand the request id back once, as
``finished_sending``, so the scheduler frees the blocks exactly once whichever comes first.

Tickets are capabilities (issue 15, "Security"): a lease is granted with the unguessable token
its ticket carries (``secrets.token_urlsafe``, made by the scheduler half); a heartbeat, a
release or a read of a block the lease alone guards must present it (``token_ok``, ``covers``).
A lease granted with the token ``""`` (tests, old tickets) accepts only ``""``.

With a block board (``attach_board``; ``transport.cma_board``), the table also publishes, in
this process's memory, the tag of every block a live lease holds (its block hash, or for the
lease's partial last block the lease itself), so that a same-host reader can check a handoff
without a round trip. An entry is cleared before the lease that holds its block ends, under the
table's lock, so before ``pop_finished`` can hand the request back for its blocks to be freed.

A puller of several ranks (tensor parallel: each rank pulls its own KV heads) sends one release
per rank (``release``'s ``puller_rank`` of ``num_pullers``): the lease ends when every rank's
has come, so a rank still reading keeps the blocks; a release of one rank changes nothing else.

A read refused under a lease is final unless the lease may still be on its way
(``grant_pending``): P hands a lease to its worker half at its next step after answering the
ticket, so a fast puller can arrive before it; a lease that is held (another prompt's ticket
names other hashes) or that ended (a stale ticket) never starts serving later, and the
requester is told at once rather than asking again (``transport.ReadOk.lease_pending``).

A same-host read that copies before the holder's check (``transport``: ``Read.copy_first``)
pins its lease (``pin``): until it unpins, or the pin's own end passes, the lease neither
expires nor ends by a release (deferred to the last unpin), so its blocks stay as they were
when the ticket was issued for as long as the reader may copy them. A pin never moves the
lease's own expiry.

Thread-safety: the worker half grants (from the step's ``LeaseGrant`` orders) and runs
``pop_finished`` on the worker thread; heartbeats, completion notices and the holder's checks
arrive on the connector's event-loop thread; one lock guards the table.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvbridge.transport import BlockBoard, full_block_tag, lease_block_tag

__all__ = ["LeaseTable"]

_MAX_EARLY_RELEASES = 4096
_MAX_ENDED = 4096
"""Ended leases remembered (``grant_pending``); an older one reads as never granted, which
costs its reader a few retries (``lease_reads.LEASE_GRANT_RETRY_S``), never a wrong block."""


@dataclass(slots=True)
class _Lease:
    expires_at: float
    block_ids: tuple[tuple[int, ...], ...]
    # per group: block id -> position in the request's block table
    positions: tuple[dict[int, int], ...]
    block_hashes: tuple[bytes, ...]  # the request's full-block hashes, position order
    token: str = ""  # the ticket's capability (module docstring)
    num_pins: int = 0  # copy-first reads that may still be copying (``pin``)
    pinned_until: float = 0.0  # the latest pin's own end (table clock)
    release_pending: bool = False  # released while pinned: ends at the last unpin
    released_by: set[int] = field(default_factory=set)  # puller ranks done (``release``)

    def pinned(self, now: float) -> bool:
        return self.num_pins > 0 and now < self.pinned_until


@dataclass(slots=True)
class _EarlyRelease:
    """Releases of a lease not granted yet: the token they presented, the puller ranks that
    sent one, and how many ranks the puller has."""

    token: str
    released_by: set[int]
    num_pullers: int


def _same_token(granted: str, presented: str) -> bool:
    """Constant-time comparison (a timing difference must not reveal a token's prefix)."""
    return hmac.compare_digest(granted.encode(), presented.encode())


class LeaseTable:
    """Request id -> lease on its blocks.

    Owner: the worker half (``KVBridgeWorker.leases``) on the worker thread (the model
    runner's), the only caller of ``grant`` (the step's ``LeaseGrant`` orders, in
    ``start_load_kv``), ``pop_finished`` (in ``get_finished``) and ``len``. Other threads: the
    connector loop thread calls ``covers``, ``covers_hash``, ``token_ok``, ``extend``,
    ``block_ids`` and ``release`` (the transport's callbacks, through ``HolderChecks``). One lock
    guards all of the table's state, so every method is safe from any thread; none blocks on
    more than that lock, and none calls out while holding it.

    Args:
        lease_s: lease length in seconds; a grant or heartbeat sets expiry to ``now + lease_s``.
        clock: the table's clock (seconds; only differences matter): monotonic, so that a
            wall-clock step can neither end a lease early nor cut a pin short; injectable for
            tests.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._block_to_leases: dict[tuple[int, int], set[str]] = {}  # (group, block) -> ids
        # released before granted -> the token and puller ranks of those releases
        self._released_early: OrderedDict[str, _EarlyRelease] = OrderedDict()
        # the latest leases that ended (released or expired) -> their token (``grant_pending``)
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._released: list[str] = []
        self._num_expired = 0
        self._num_released = 0
        self._lock = threading.Lock()
        self._released_cond = threading.Condition(self._lock)  # notified by ``_end``
        self._board: BlockBoard | None = None

    def attach_board(self, board: BlockBoard | None) -> None:
        """Publish held blocks on ``board`` from now on (module docstring); call before the
        first ``grant``. Raises RuntimeError when leases are already held."""
        with self._lock:
            if self._leases:
                raise RuntimeError("attach_board after leases were granted")
            self._board = board

    def _publish(self, group_id: int, block_id: int) -> None:
        """Bring the board's entry of one block in line with the leases holding it (under the
        lock): their common tag, or cleared when none holds it or they disagree."""
        board = self._board
        if board is None:
            return
        tags = set()
        for request_id in self._block_to_leases.get((group_id, block_id), ()):
            lease = self._leases[request_id]
            pos = lease.positions[group_id][block_id]
            if pos < len(lease.block_hashes):
                tags.add(full_block_tag(lease.block_hashes[pos]))
            else:
                tags.add(lease_block_tag(request_id, lease.token))
        tag = tags.pop() if len(tags) == 1 else None
        try:
            if board.tag(group_id, block_id) != tag:
                board.set(group_id, block_id, tag)
        except IndexError:
            pass  # a block outside the board is never published, so never read one-sided

    def grant(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        block_hashes: Sequence[bytes] = (),
        token: str = "",
    ) -> float:
        """Start a lease on ``block_ids`` (per group, position order) of a request whose
        full-block hashes are ``block_hashes``, guarded by its ticket's ``token``; returns its
        expiry. Raises ValueError if one is already held."""
        held = tuple(tuple(ids) for ids in block_ids)
        positions = tuple({b: pos for pos, b in enumerate(ids) if b != 0} for ids in held)
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            expires_at = self._clock() + self.lease_s
            early = self._released_early.pop(request_id, None)
            released_by: set[int] = set()
            if early is not None and _same_token(token, early.token):
                if len(early.released_by) >= early.num_pullers:
                    # The puller's notices came before the grant: the lease ends as it starts.
                    self._remember_ended(request_id, token)
                    self._end(request_id)
                    return expires_at
                released_by = early.released_by
            lease = _Lease(expires_at, held, positions, tuple(block_hashes), token,
                           released_by=released_by)
            self._leases[request_id] = lease
            for group_id, group_positions in enumerate(positions):
                for block_id in group_positions:
                    self._block_to_leases.setdefault((group_id, block_id), set()).add(request_id)
                    self._publish(group_id, block_id)
            return expires_at

    def _end(self, request_id: str) -> None:
        """Hand ``request_id`` to the next ``pop_finished`` as released (under the lock)."""
        self._released.append(request_id)
        self._num_released += 1
        self._released_cond.notify_all()

    def _remember_ended(self, request_id: str, token: str) -> None:
        """Keep ``request_id``'s ended lease for ``grant_pending`` (under the lock)."""
        self._ended[request_id] = token
        self._ended.move_to_end(request_id)
        while len(self._ended) > _MAX_ENDED:
            self._ended.popitem(last=False)

    def _drop(self, request_id: str) -> _Lease | None:
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._remember_ended(request_id, lease.token)
            for group_id, group_positions in enumerate(lease.positions):
                for block_id in group_positions:
                    ids = self._block_to_leases.get((group_id, block_id))
                    if ids is not None:
                        ids.discard(request_id)
                        if not ids:
                            del self._block_to_leases[(group_id, block_id)]
                    self._publish(group_id, block_id)
        return lease

    def covers_hash(self, group_id: int, block_id: int, expected: bytes) -> bool:
        """True while some live lease protects ``block_id`` of ``group_id`` at a position whose
        hash is ``expected`` (a handoff's full blocks: the puller names the hash, not the
        lease)."""
        with self._lock:
            for request_id in self._block_to_leases.get((group_id, block_id), ()):
                lease = self._leases[request_id]
                if lease.expires_at <= self._clock() or lease.release_pending:
                    continue
                pos = lease.positions[group_id][block_id]
                if pos < len(lease.block_hashes) and lease.block_hashes[pos] == expected:
                    return True
            return False

    def covers(
        self,
        request_id: str,
        group_id: int,
        block_id: int,
        expected: bytes | None,
        token: str = "",
    ) -> bool:
        """True while ``request_id``'s lease is held, ``token`` is its token, and it protects
        ``block_id`` of ``group_id`` at a position whose hash is ``expected`` (``None``: the
        position has no hash, the partial last block, and must have none under the lease
        either)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if (
                lease is None
                or not _same_token(lease.token, token)
                or lease.expires_at <= self._clock()
                or lease.release_pending
                or group_id >= len(lease.positions)
            ):
                return False
            pos = lease.positions[group_id].get(block_id)
            if pos is None:
                return False
            actual = lease.block_hashes[pos] if pos < len(lease.block_hashes) else None
            return actual == expected

    def extend(self, request_ids: Iterable[str], tokens: Sequence[str] | None = None) -> int:
        """A heartbeat: push the expiry of each named lease to ``now + lease_s``, when
        ``tokens[i]`` (None: ``""`` for every id) is its token. Unknown ids (already released or
        expired) and wrong tokens are ignored. Returns how many were extended."""
        with self._lock:
            expires_at = self._clock() + self.lease_s
            n = 0
            for i, request_id in enumerate(request_ids):
                lease = self._leases.get(request_id)
                token = "" if tokens is None else tokens[i]
                if lease is not None and _same_token(lease.token, token):
                    lease.expires_at = max(lease.expires_at, expires_at)
                    n += 1
            return n

    def pin(self, request_id: str, token: str, seconds: float) -> bool:
        """Keep a held lease from ending (by expiry or release) until ``unpin``, for at most
        ``seconds`` from now; a release meanwhile takes effect at the last unpin. False
        (nothing pinned) when the lease is not held, was released, or ``token`` is not its
        token."""
        with self._lock:
            lease = self._leases.get(request_id)
            now = self._clock()
            if (
                lease is None
                or not _same_token(lease.token, token)
                or lease.expires_at <= now
                or lease.release_pending
            ):
                return False
            lease.num_pins += 1
            lease.pinned_until = max(lease.pinned_until, now + seconds)
            return True

    def unpin(self, request_id: str) -> None:
        """Undo one ``pin``; the last unpin of a lease released meanwhile ends it."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.num_pins == 0:
                return
            lease.num_pins -= 1
            if lease.num_pins == 0:
                lease.pinned_until = 0.0
            if lease.num_pins == 0 and lease.release_pending:
                self._drop(request_id)
                self._end(request_id)

    def token_ok(self, request_id: str, token: str) -> bool:
        """False when ``request_id`` holds a lease whose token is not ``token`` (a heartbeat or
        release from someone without the ticket: refuse it); True otherwise, an unknown id
        included (there is nothing of it to protect)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is None or _same_token(lease.token, token)

    def release(
        self, request_id: str, token: str = "", puller_rank: int = 0, num_pullers: int = 1
    ) -> bool:
        """Rank ``puller_rank`` of a puller of ``num_pullers`` ranks is done (or gave up): end
        the lease now if every rank of it has released, and ``token`` is its token. False if it
        was not held, the token is wrong (the lease is untouched), or other puller ranks have
        not released yet (the rank is remembered); an id not held yet is remembered with the
        token and rank (a bounded number), so a grant with that token that arrives after every
        rank's release notice ends at once instead of waiting out the lease. A pinned lease
        ends at its last ``unpin`` (True now: it vouches for nothing more)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None and not _same_token(lease.token, token):
                return False
            if lease is None:
                early = self._released_early.pop(request_id, None)
                if early is None or not _same_token(early.token, token):
                    early = _EarlyRelease(token, set(), num_pullers)
                early.released_by.add(puller_rank)
                early.num_pullers = num_pullers
                self._released_early[request_id] = early
                while len(self._released_early) > _MAX_EARLY_RELEASES:
                    self._released_early.popitem(last=False)
                return False
            lease.released_by.add(puller_rank)
            if len(lease.released_by) < num_pullers:
                return False  # another rank of the puller may still be reading
            if lease.num_pins:
                if lease.release_pending:
                    return False
                lease.release_pending = True
                return True
            self._drop(request_id)
            self._end(request_id)
            return True

    def grant_pending(self, request_id: str, token: str) -> bool:
        """Whether a lease ``request_id`` with ``token`` may yet be granted here, so that a read
        it refused now may be served when asked again: False when such a lease is held (held
        or expired: its blocks are what they will be), ended (one of the last ``_MAX_ENDED``),
        or was released before its grant by every rank of its puller; True otherwise, a lease
        held with another token included (a read without the ticket's token learns nothing of
        the lease), and a lease only some puller ranks released early (tensor parallel: a fast
        decode rank lets go of every prefill rank, and another decode rank may still have to
        read this one, which has not been handed the lease yet). Any thread.
        """
        with self._lock:
            lease = self._leases.get(request_id)
            early = self._released_early.get(request_id)
            if early is not None and len(early.released_by) < early.num_pullers:
                early = None  # other puller ranks may still read under it
            known = (
                lease.token
                if lease is not None
                else self._ended.get(request_id, None if early is None else early.token)
            )
            return known is None or not _same_token(known, token)

    def is_held(self, request_id: str) -> bool:
        """True while ``request_id``'s lease is granted and not yet expired or released."""
        with self._lock:
            lease = self._leases.get(request_id)
            return (
                lease is not None
                and lease.expires_at > self._clock()
                and not lease.release_pending
            )

    def block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...] | None:
        """The blocks a live lease protects, per group, or None."""
        with self._lock:
            lease = self._leases.get(request_id)
            return None if lease is None else lease.block_ids

    def pop_finished(self) -> tuple[set[str], int]:
        """Ids whose lease ended since the last call (released or expired) and how many of them
        expired. Each id is returned once."""
        with self._lock:
            now = self._clock()
            expired = [
                rid
                for rid, lease in self._leases.items()
                if lease.expires_at <= now and not lease.pinned(now)
            ]
            for rid in expired:
                self._drop(rid)
            self._num_expired += len(expired)
            finished = set(self._released) | set(expired)
            self._released.clear()
            return finished, len(expired)

    def wait_for_release(self, timeout_s: float) -> bool:
        """Block the calling (worker) thread until a lease ends by release (a completion notice,
        or the last unpin of a lease released while pinned) or ``timeout_s`` seconds pass; True
        when a release is waiting for ``pop_finished`` (at once if one already is). An expiry
        does not wake it: expiries are found by ``pop_finished``, to a lease's length, not to
        the millisecond. Holds the table's lock only while it checks."""
        with self._released_cond:
            return self._released_cond.wait_for(lambda: bool(self._released), timeout_s)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
