"""Same-host reads by cross-memory attach: the requester copies blocks straight out of the
holder's KV tensors with ``process_vm_readv(2)``, one copy in all.

Why (issue 4, "Performance"; ``benchmarks/bench_transport.py``): over UCX tag messages a read of
random block ids costs three copies (the holder's gather into staging, UCX's own copy, the
requester's scatter), because a tag message is one contiguous buffer on each side. On one host
UCX moves those bytes with the same system call (its ``cma`` transport), one call per message;
called directly, one ``process_vm_readv`` takes up to ``IOV_MAX`` (1,024) source and destination
ranges, so random ids need no staging at all. This is the read-from-the-holder's-memory model of
vLLM's NIXL connector (the decode node reads the prefill node's registered blocks by
descriptor), with the kernel as the data mover.

Set-up, at handshake (``HelloOk.cma``): a holder whose KV tensors are in host memory offers
``CmaOffer``: its boot id, pid, the base address of every layer tensor, and the address and
value of a 16-byte random probe. The requester takes the offer (``CmaPeer.accept``) only when
both nodes are on host memory, the boot ids match, and reading the probe through
``process_vm_readv`` returns the probe's value: that proves the pid names the holder process in
the requester's pid namespace and that the kernel lets this process read it (same user, ptrace
rules, no seccomp filter). Otherwise reads go over UCX, as between hosts.

A read (``Read.cma``): the holder checks ids and hashes as for any read and answers ``ReadOk``;
the requester then copies the good blocks (``CmaPlan``: ranges sorted by source address, runs
merged, spread over ``COPY_PARTS`` copy threads), re-reads the probe (the holder process is
still the one it checked), and, for a read with expected hashes, sends ``ReadCopied``; the
holder re-checks every block it let through and answers ``ReadDone`` (``plan``, "Hash checks on
the holder": a block evicted and reused during the copy is reported, never counted as landed).

Nothing is exposed that the kernel would not already let the requester read: the offer only
says where the KV tensors are.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from .errors import TransportError
from .heads import row_slice
from .metadata import NodeMetadata
from .staging import copy_executor, join_threads
from .wire import CmaOffer

IOV_MAX = 1024
"""Ranges per ``process_vm_readv`` call on each side (Linux ``UIO_MAXIOV``)."""
MAX_BYTES_PER_CALL = 1 << 30
"""Bytes per ``process_vm_readv`` call at most: Linux copies at most ``MAX_RW_COUNT`` (2 GiB
less a page) per call and returns a short count beyond it."""
MAX_SEGMENT_BYTES = 4 << 20
"""Longer contiguous ranges are split, so copy threads share a long run and a cancel is seen
within one call of ``IOV_MAX`` ranges of at most this size."""
COPY_PARTS = 2
"""Copy threads per large read: two threads copy random blocks (each range pays its own page
pinning) much faster than one, and a long range somewhat faster; more threads than cores
gained nothing (docs/architecture.md, "Design measurements"). Ranges are sorted by source
address."""
INLINE_COPY_MAX_BYTES = 4 << 20
"""A read of at most this many bytes is copied on the event loop thread: on a loaded host two
copy threads' wake-ups cost more than such a copy (docs/architecture.md, "Design
measurements")."""
PROBE_BYTES = 16  # the holder's random probe (``CmaOffer.probe``)
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class CmaReadError(TransportError):
    """``process_vm_readv`` failed or copied short (the holder process is gone, or the kernel
    refused); ``errno_name`` is the C errno's name."""

    def __init__(self, message: str, errno_name: str = ""):
        super().__init__(message)
        self.errno_name = errno_name


class CmaCancelled(TransportError):
    """A copy stopped between two ``process_vm_readv`` calls because it was cancelled."""


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_process_vm_readv() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.process_vm_readv
    except (OSError, AttributeError):  # not Linux / no glibc wrapper
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return function


_process_vm_readv = _load_process_vm_readv()


def host_id() -> str:
    """This boot of this machine (``/proc/sys/kernel/random/boot_id``); ``""`` where unknown."""
    try:
        with open(_BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""


def cma_from_environment() -> bool:
    """Same-host reads unless ``KVBRIDGE_CMA`` says ``0``, ``false``, ``off`` or ``no``."""
    return os.environ.get("KVBRIDGE_CMA", "1").strip().lower() not in {"0", "false", "off", "no"}


def available() -> bool:
    """Whether this process can make ``process_vm_readv`` calls at all."""
    return _process_vm_readv is not None and bool(host_id())


class CmaHost:
    """Holder side: the offer, and the probe buffer it points to (kept alive here).

    Args:
        kv_caches_by_group: the holder's ``[group][layer]`` KV tensors.
        board_address: the holder's block board (``cma_board.BlockBoard``, kept alive by the
            caller), or None to offer none.
    """

    def __init__(
        self,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        board_address: int | None = None,
    ):
        self._probe = ctypes.create_string_buffer(os.urandom(PROBE_BYTES), PROBE_BYTES)
        self._offer = CmaOffer(
            host_id=host_id(),
            pid=os.getpid(),
            probe_address=ctypes.addressof(self._probe),
            probe=self._probe.raw,
            regions=[[int(t.data_ptr()) for t in caches] for caches in kv_caches_by_group],
            board_address=board_address,
        )

    @property
    def offer(self) -> CmaOffer:
        """The offer, naming the process that makes it: a child forked after this host was
        built has the same probe at the same address, but must send its own pid, or requesters
        would copy the parent's tensors."""
        pid = os.getpid()
        if pid != self._offer.pid:
            self._offer = msgspec.structs.replace(self._offer, pid=pid)
        return self._offer

    @classmethod
    def for_caches(
        cls,
        kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        board_address: int | None = None,
    ) -> CmaHost | None:
        """A host for these KV tensors, or None when they are not all in host memory or this
        system has no ``process_vm_readv``."""
        on_host = all(t.device.type == "cpu" for caches in kv_caches_by_group for t in caches)
        return cls(kv_caches_by_group, board_address) if on_host and available() else None


@dataclass(frozen=True, slots=True)
class CmaPlan:
    """The ranges of one read: ``parts[k]`` is ``(local, remote)``, two C-contiguous ``uint64``
    arrays ``[n, 2]`` of ``(address, length)`` pairs with equal lengths row by row (the
    ``struct iovec`` layout); each part goes to one copy thread."""

    parts: list[tuple[np.ndarray, np.ndarray]]
    nbytes: int


class CmaPeer:
    """Requester side: a holder whose offer this process accepted."""

    def __init__(self, offer: CmaOffer, remote: NodeMetadata):
        self.offer = offer
        self.remote = remote

    @classmethod
    def accept(
        cls,
        offer: CmaOffer | None,
        remote: NodeMetadata,
        local_kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
    ) -> tuple[CmaPeer | None, str]:
        """The peer, or None and why not (for the log): no offer, not host memory here,
        another host, an offer that does not fit the holder's metadata, or a probe that does not
        read back (another pid namespace, ptrace rules, seccomp)."""
        if offer is None:
            return None, "the holder offers no same-host reads"
        if not all(t.device.type == "cpu" for g in local_kv_caches_by_group for t in g):
            return None, "local KV tensors are not in host memory"
        if not available() or offer.host_id != host_id():
            return None, "the holder is on another host"
        layers = [g.num_layers for g in remote.groups]
        if [len(r) for r in offer.regions] != layers:
            return None, f"offer regions {[len(r) for r in offer.regions]} != layers {layers}"
        peer = cls(offer, remote)
        try:
            probe = peer.read_probe()
        except CmaReadError as exc:
            return None, f"the probe read failed: {exc}"
        if probe != offer.probe:
            return None, "the probe read back different bytes (another process)"
        return peer, ""

    def read_probe(self) -> bytes:
        """The holder's probe bytes as they are now.

        Raises:
            CmaReadError: the read failed (the holder process is gone).
        """
        buffer = ctypes.create_string_buffer(PROBE_BYTES)
        local = _IoVec(ctypes.addressof(buffer), PROBE_BYTES)
        remote = _IoVec(self.offer.probe_address, PROBE_BYTES)
        assert _process_vm_readv is not None  # accept() checked
        got = _process_vm_readv(self.offer.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != PROBE_BYTES:
            raise _read_error(got, PROBE_BYTES, "probe")
        return buffer.raw

    def plan(
        self,
        local_kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
        entries: Sequence[tuple[int, Sequence[int], Sequence[int]]],
        parts: int = COPY_PARTS,
        *,
        heads: tuple[int, int] | None = None,
        local: NodeMetadata | None = None,
    ) -> CmaPlan:
        """Ranges copying, per ``(group_id, remote_block_ids, local_block_ids)`` entry, every
        layer of remote block ``remote_block_ids[i]`` into local block ``local_block_ids[i]``:
        the whole block, or of a read of ``heads`` (``Read.heads``) the bytes of those heads
        on each side (``heads.row_slice``; ``local`` is this node's metadata, which it then
        needs).

        Ids must already be checked (``plan.check_read`` on the holder, ``build_group_msgs``
        here), and so must ``heads`` (``heads.heads_error`` on both sides). Ranges are sorted by
        source address (neighbouring pages pin together), runs that are contiguous on both
        sides merge into one range, ranges above ``MAX_SEGMENT_BYTES`` split, and the list is
        cut into ``parts`` pieces of about equal bytes.
        """
        remote_addrs, local_addrs, lengths = [], [], []
        for group_id, remote_ids, local_ids in entries:
            if not len(remote_ids):
                continue
            remote_row = row_slice(self.remote, group_id, heads)
            local_row = remote_row if local is None else row_slice(local, group_id, heads)
            remote_stride = self.remote.groups[group_id].block_nbytes
            remote_offsets = np.asarray(remote_ids, dtype=np.uint64) * np.uint64(remote_stride)
            remote_offsets += np.uint64(remote_row.offset)
            for remote_base, local_tensor in zip(
                self.offer.regions[group_id], local_kv_caches_by_group[group_id], strict=True
            ):
                local_stride = local_tensor.stride(0) * local_tensor.element_size()
                local_offsets = np.asarray(local_ids, dtype=np.uint64) * np.uint64(local_stride)
                remote_addrs.append(remote_offsets + np.uint64(remote_base))
                local_addrs.append(
                    local_offsets + np.uint64(local_tensor.data_ptr() + local_row.offset)
                )
                lengths.append(np.full(len(remote_offsets), remote_row.nbytes, dtype=np.uint64))
        if not lengths:
            return CmaPlan(parts=[], nbytes=0)
        remote_all = np.concatenate(remote_addrs)
        order = np.argsort(remote_all, kind="stable")
        remote_all = remote_all[order]
        local_all = np.concatenate(local_addrs)[order]
        length_all = np.concatenate(lengths)[order]
        merged = _merge_runs(remote_all, local_all, length_all)
        remote_seg, local_seg, length_seg = _split_long(*merged)
        nbytes = int(length_seg.sum())
        cuts = _cuts(length_seg, parts if nbytes > INLINE_COPY_MAX_BYTES else 1)
        plan_parts = []
        for start, stop in itertools.pairwise(cuts):
            if stop > start:
                lens = length_seg[start:stop]
                plan_parts.append(
                    (
                        np.ascontiguousarray(np.stack([local_seg[start:stop], lens], axis=1)),
                        np.ascontiguousarray(np.stack([remote_seg[start:stop], lens], axis=1)),
                    )
                )
        return CmaPlan(parts=plan_parts, nbytes=nbytes)

    async def copy(self, plan: CmaPlan, on_batch: Callable[[], None] | None = None) -> None:
        """Run ``plan``: inline when it is one small part, else one copy thread per part
        (``staging.copy_executor``). Returns or raises only once every thread has stopped, also
        when cancelled: no thread writes the local KV tensors after that (their blocks may be
        handed to another request).

        ``on_batch`` runs before every ``process_vm_readv`` call (tests use it to interleave a
        failure).

        Raises:
            CmaReadError: a call failed or copied short (then the whole read counts as failed).
            asyncio.CancelledError: the caller was cancelled (the threads were stopped first).
        """
        if not plan.parts:
            return
        stop = threading.Event()
        if plan.nbytes <= INLINE_COPY_MAX_BYTES and len(plan.parts) == 1:
            _copy_part(self.offer.pid, *plan.parts[0], stop, on_batch)
            return
        executor = copy_executor()
        futures = [
            executor.submit(_copy_part, self.offer.pid, local, remote, stop, on_batch)
            for local, remote in plan.parts
        ]
        await join_threads(futures, stop)


    def copy_here(self, plan: CmaPlan) -> None:
        """Run ``plan`` on the calling thread (any thread), part after part.

        Raises:
            CmaReadError: a call failed or copied short.
        """
        never = threading.Event()
        for local, remote in plan.parts:
            _copy_part(self.offer.pid, local, remote, never, None)


def _merge_runs(
    remote: np.ndarray, local: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges that continue the previous one on both sides join it."""
    continues = (remote[1:] == remote[:-1] + length[:-1]) & (local[1:] == local[:-1] + length[:-1])
    starts = np.concatenate([[0], np.flatnonzero(~continues) + 1])
    return remote[starts], local[starts], np.add.reduceat(length, starts)


def _split_long(
    remote: np.ndarray, local: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges longer than ``MAX_SEGMENT_BYTES`` become pieces of at most that size."""
    limit = np.uint64(MAX_SEGMENT_BYTES)
    pieces = ((length + limit - np.uint64(1)) // limit).astype(np.int64)
    if int(pieces.max()) == 1:
        return remote, local, length
    owner = np.repeat(np.arange(len(length)), pieces)
    first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (np.arange(len(owner)) - first_piece).astype(np.uint64) * limit
    piece_length = np.minimum(limit, length[owner] - offset)
    return remote[owner] + offset, local[owner] + offset, piece_length


def _cuts(length: np.ndarray, parts: int) -> list[int]:
    """Range indices cutting ``length`` into ``parts`` runs of about equal bytes."""
    if parts <= 1 or len(length) <= 1:
        return [0, len(length)]
    ends = np.cumsum(length)
    targets = ends[-1] * np.arange(1, parts) // parts
    inner = np.searchsorted(ends, targets, side="left") + 1
    return [0, *sorted({int(i) for i in inner if 0 < i < len(length)}), len(length)]


def _copy_part(
    pid: int,
    local: np.ndarray,
    remote: np.ndarray,
    stop: threading.Event,
    on_batch: Callable[[], None] | None,
) -> None:
    """Copy one part in calls of at most ``IOV_MAX`` ranges and ``MAX_BYTES_PER_CALL`` bytes
    (runs in a copy thread; ctypes releases the GIL for the call)."""
    assert _process_vm_readv is not None
    ends = np.cumsum(local[:, 1])
    start, copied = 0, 0
    while start < len(local):
        if stop.is_set():
            raise CmaCancelled("copy stopped")
        if on_batch is not None:
            on_batch()
        by_bytes = int(np.searchsorted(ends, copied + MAX_BYTES_PER_CALL, side="right"))
        stop_row = max(start + 1, min(len(local), start + IOV_MAX, by_bytes))
        want = int(ends[stop_row - 1]) - copied
        rows = slice(start, stop_row)
        read_ranges(pid, local[rows], remote[rows], want, f"ranges {start}..{stop_row - 1}")
        start, copied = stop_row, copied + want


def read_ranges(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int, what: str) -> None:
    """One ``process_vm_readv`` call: the ``(address, length)`` rows of ``remote`` in process
    ``pid`` into those of ``local`` (C-contiguous ``uint64`` ``[n, 2]``, at most ``IOV_MAX``
    rows, ``nbytes`` in all). Runs on any thread; ctypes releases the GIL for the call.

    Raises:
        CmaReadError: the call failed or copied short (``what`` names the ranges).
    """
    assert _process_vm_readv is not None
    count = len(local)
    got = _process_vm_readv(pid, local.ctypes.data, count, remote.ctypes.data, count, 0)
    if got != nbytes:
        raise _read_error(got, nbytes, what)


def _read_error(got: int, want: int, what: str) -> CmaReadError:
    if got < 0:
        code = ctypes.get_errno()
        name = errno.errorcode.get(code, str(code))
        hint = " (the holder process is gone)" if code == errno.ESRCH else ""
        return CmaReadError(f"process_vm_readv of {what} failed: {name}{hint}", name)
    return CmaReadError(f"process_vm_readv of {what} copied {got} of {want} bytes", "short")
