"""One-sided same-host handoff reads: the holder publishes, in its own memory, what each leased
block holds, and a requester on the same host checks that board around its copy instead of
asking the holder.

Why (issue 13, "Performance"): a ``copy_first`` read (``cma_read``) costs one round trip to the
holder's connector loop, overlapped with the copy, and on a busy host that loop answers late,
later than the copy takes (docs/architecture.md, "Design measurements"). The board removes the
holder from the read's critical path the way one-sided
RDMA reads do in FaRM (Dragojević et al., NSDI 2014: validate a version before and after the
read), while the holder still decides what may be read: a block is on the board only while a
lease holds it with the hash the board names.

Layout: ``[num_groups][num_blocks]`` entries of ``ENTRY_WORDS`` ``uint64`` words each::

    word 0: version   odd while the holder rewrites the entry, even when stable
    word 1-2: tag     16 bytes; all zero: nothing readable here
    word 3: unused (an entry is 32 bytes, so entries never straddle a cache line)

Tags (``full_block_tag``, ``lease_block_tag``): a full block held under a lease is tagged with
its block hash's first 16 bytes (the hash names the block's tokens, so every lease holding the
block agrees on it); a lease's partial last block (no hash) with a digest of the lease's
request id and token, so that only that ticket's reader matches it. The holder's lease table
(``connector.lease``) writes the tags; the transport only compares them.

A read (``BoardCheck``), requester side::

    read entries (one process_vm_readv)  ──> every tag matches, every version even?
      ──> copy the blocks  ──> read the entries again  ──> every entry unchanged?

Why that is enough: the holder clears a block's entry (its version changes) before the lease
that holds it ends, and the block can be reused only after that end. A copy that saw a reused
block's new bytes was therefore followed by a second board read that sees the change (the two
reads are separate system calls, in order; the holder's stores are ordered, see
``BlockBoard.set``; on x86-64 the CPU itself keeps loads and stores in order, TSO). Nothing
matches when the lease is not granted yet, was released, or holds other hashes: then the read
takes the holder's own checks (``cma_read``), which name what is wrong. A version is never
reused (64 bits, only incremented), so a block released and held again between the two reads
fails the second check.

Thread-safety: ``BlockBoard`` has one writer at a time (its caller's lock: the lease table's);
readers are other processes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .cma import IOV_MAX, CmaHost, read_ranges

__all__ = [
    "ENTRY_BYTES",
    "ENTRY_WORDS",
    "TAG_BYTES",
    "BlockBoard",
    "BoardCheck",
    "BoardCounts",
    "full_block_tag",
    "lease_block_tag",
    "offer_same_host_reads",
]

ENTRY_WORDS = 4
ENTRY_BYTES = ENTRY_WORDS * 8
TAG_BYTES = 16
_EMPTY_TAG = bytes(TAG_BYTES)


@dataclass(slots=True)
class BoardCounts:
    """A requester's handoff reads by how they ended: ``one_sided`` checked on the board alone,
    ``fallbacks`` tried the board and then asked the holder (a tag did not match, an entry
    moved during the copy). Reads on any thread count through ``add``; the fields are read
    whole."""

    one_sided: int = 0
    fallbacks: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, one_sided: int = 0, fallbacks: int = 0) -> None:
        with self._lock:
            self.one_sided += one_sided
            self.fallbacks += fallbacks


def full_block_tag(block_hash: bytes) -> bytes:
    """The board tag of a full block whose hash is ``block_hash``: its first 16 bytes (padded
    with ``0x01`` when shorter; never zero). A block hash is already a digest of the block's
    tokens and its parent, and the tag is computed for every block of every read, so it is
    not hashed again; a lease tag is a keyed BLAKE2b digest, so the two domains do not meet."""
    tag = bytes(block_hash[:TAG_BYTES]).ljust(TAG_BYTES, b"\x01")
    return tag if tag != _EMPTY_TAG else b"\x01" + tag[1:]


def lease_block_tag(request_id: str, token: str) -> bytes:
    """The board tag of the partial last block of the lease ``request_id`` granted with
    ``token`` (16 bytes, never zero)."""
    data = request_id.encode() + b"\0" + token.encode()
    tag = hashlib.blake2b(data, digest_size=TAG_BYTES, person=b"kvb-lease").digest()
    return tag if tag != _EMPTY_TAG else b"\x01" + tag[1:]


class BlockBoard:
    """The holder's board (module docstring): one entry per block of each KV cache group.

    Args:
        num_blocks_by_group: ``num_blocks`` of each group's KV tensors.

    Owner: whoever holds the lock of the table that decides leases (``LeaseTable``); ``set``
    must not run on two threads at once.
    """

    def __init__(self, num_blocks_by_group: Sequence[int]):
        if not num_blocks_by_group or min(num_blocks_by_group) < 1:
            raise ValueError(f"num_blocks_by_group must be >= 1 each, got {num_blocks_by_group}")
        self.num_blocks_by_group = tuple(int(n) for n in num_blocks_by_group)
        self._first_entry = np.cumsum((0, *self.num_blocks_by_group))[:-1].tolist()
        self._words = np.zeros((sum(self.num_blocks_by_group), ENTRY_WORDS), dtype=np.uint64)
        # a lock's release is a store barrier on every platform (pthread_mutex_unlock), so the
        # version's odd store, the tag and the even store become visible in that order
        self._fence = threading.Lock()

    @property
    def address(self) -> int:
        """Address of the first entry in this process."""
        return int(self._words.ctypes.data)

    def entry_index(self, group_id: int, block_id: int) -> int:
        """Raises IndexError for a group or block outside the board."""
        if not 0 <= block_id < self.num_blocks_by_group[group_id]:
            raise IndexError(f"block {block_id} outside group {group_id}'s board")
        return self._first_entry[group_id] + block_id

    def tag(self, group_id: int, block_id: int) -> bytes | None:
        """The entry's tag as published now (None: nothing readable)."""
        raw = self._words[self.entry_index(group_id, block_id), 1:3].tobytes()
        return None if raw == _EMPTY_TAG else raw

    def set(self, group_id: int, block_id: int, tag: bytes | None) -> None:
        """Publish ``tag`` for the block (None: clear it); the version moves even in both cases.
        Mutates this process's board; call under the owner's lock."""
        if tag is not None and len(tag) != TAG_BYTES:
            raise ValueError(f"a tag is {TAG_BYTES} bytes, got {len(tag)}")
        entry = self._words[self.entry_index(group_id, block_id)]
        version = int(entry[0])
        with self._fence:
            entry[0] = version + 1
        with self._fence:
            entry[1:3] = np.frombuffer(tag or _EMPTY_TAG, dtype=np.uint64)
        with self._fence:
            entry[0] = version + 2


def offer_same_host_reads(
    kv_caches_by_group: Sequence[Sequence[torch.Tensor]], *, board: bool
) -> tuple[CmaHost | None, BlockBoard | None]:
    """The holder's same-host offer over its KV tensors and, with ``board``, the block board the
    offer names (the caller's lease table writes it; the host keeps no reference, so the
    caller keeps it alive). ``(None, None)`` where same-host reads are impossible
    (``CmaHost.for_caches``)."""
    block_board = BlockBoard([caches[0].shape[0] for caches in kv_caches_by_group])
    host = CmaHost.for_caches(kv_caches_by_group, block_board.address if board else None)
    if host is None:
        return None, None
    return host, block_board if board else None


class BoardCheck:
    """One read's check against a holder's board (requester side; module docstring).

    Args:
        pid: the holder process.
        board_address: its board's address (``CmaOffer.board_address``).
        num_blocks_by_group: its board's shape (``CmaOffer.board_blocks``).
        blocks: per read entry, ``(group_id, block_ids, expected_tags)``.

    Raises:
        ValueError: a block outside the board (the read's ids were checked against the holder's
            metadata, so this is a caller mistake).
    """

    def __init__(
        self,
        pid: int,
        board_address: int,
        num_blocks_by_group: Sequence[int],
        blocks: Sequence[tuple[int, Sequence[int], Sequence[bytes]]],
    ):
        self._pid = pid
        first = np.cumsum((0, *num_blocks_by_group))[:-1]
        indices, tags = [], []
        for group_id, block_ids, expected in blocks:
            ids = np.asarray(block_ids, dtype=np.int64)
            if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks_by_group[group_id]):
                raise ValueError(f"group {group_id}: block ids outside the holder's board")
            indices.append(ids + int(first[group_id]))
            tags.extend(expected)
        index = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
        self._expected = np.frombuffer(b"".join(tags), dtype=np.uint64).reshape(-1, 2)
        if len(self._expected) != len(index):
            raise ValueError(f"{len(self._expected)} tags for {len(index)} blocks")
        self._local = np.zeros((len(index), ENTRY_WORDS), dtype=np.uint64)
        remote = index.astype(np.uint64) * np.uint64(ENTRY_BYTES) + np.uint64(board_address)
        self._iov_remote = np.ascontiguousarray(
            np.stack([remote, np.full(len(index), ENTRY_BYTES, dtype=np.uint64)], axis=1)
        )
        local_base = np.uint64(self._local.ctypes.data)
        local = np.arange(len(index), dtype=np.uint64) * np.uint64(ENTRY_BYTES) + local_base
        self._iov_local = np.ascontiguousarray(
            np.stack([local, self._iov_remote[:, 1]], axis=1)
        )
        self._versions: np.ndarray | None = None

    def before_copy(self) -> bool:
        """Read the entries; True when every tag is the expected one and no entry is being
        rewritten.

        Raises:
            CmaReadError: the holder's memory could not be read (``errno_name`` says why).
        """
        self._read()
        versions = self._local[:, 0].copy()
        if np.any(versions & np.uint64(1)) or not np.array_equal(
            self._local[:, 1:3], self._expected
        ):
            return False
        self._versions = versions
        return True

    def verdict(self) -> bool | None:
        """Read the entries once, for a look before any copy (``board_look``): True when
        ``before_copy`` would pass; False when a stable entry (even version) names another
        block (a tag neither empty nor the expected one); None otherwise (an entry empty or
        being rewritten). Raises CmaReadError as ``before_copy``."""
        self._read()
        stable = (self._local[:, 0] & np.uint64(1)) == 0
        tags = self._local[:, 1:3]
        expected = np.all(tags == self._expected, axis=1)
        if bool(np.all(stable & expected)):
            return True
        other = stable & ~expected & np.any(tags != 0, axis=1)
        return False if bool(np.any(other)) else None

    def after_copy(self) -> bool:
        """Read the entries again; True when every entry is as ``before_copy`` read it, its
        version and its (expected) tag. The tag is compared again because the first read
        copies an entry's words in no promised order: a version from one write and a tag from
        an earlier one would pass the first check alone.

        Raises:
            CmaReadError: as ``before_copy``.
            RuntimeError: ``before_copy`` did not pass first.
        """
        if self._versions is None:
            raise RuntimeError("BoardCheck.after_copy before a passing before_copy")
        self._read()
        return bool(
            np.array_equal(self._local[:, 0], self._versions)
            and np.array_equal(self._local[:, 1:3], self._expected)
        )

    def _read(self) -> None:
        n = len(self._local)
        for start in range(0, n, IOV_MAX):
            stop = min(n, start + IOV_MAX)
            read_ranges(
                self._pid,
                self._iov_local[start:stop],
                self._iov_remote[start:stop],
                (stop - start) * ENTRY_BYTES,
                "the holder's block board",
            )
