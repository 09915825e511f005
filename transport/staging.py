"""Reusable staging buffers for chunked transfers, and their UCX-facing byte views.

Buffers are flat ``uint8`` tensors of a fixed capacity on the KV tensors' device, kept in a free
list and reused, because UCX registers memory on first use and a registration hit is much cheaper
than a fresh one. A chunk of ``n`` blocks of ``L`` layers views the first
``L * n * block_nbytes`` bytes as ``[L, n, *block_shape]`` in the KV dtype
(kvbridge.kernels.layout, "staging buffer"); a read of part of each row (the KV heads it names:
``heads.RowSlice``) views ``[L, n, row.nbytes]`` bytes instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from kvbridge.kernels import gather_blocks, scatter_blocks
from kvbridge.kernels.device_binding import bound
from kvbridge.kernels.host_copy import copy_rows, put_rows, take_rows
from kvbridge.kernels.host_memory import host_buffer

from .heads import RowSlice


class StagingPool:
    """Free list of flat byte buffers of ``capacity_bytes`` on ``device``.

    ``acquire`` never fails (allocates when the list is empty); ``release`` returns a buffer.
    ``num_outstanding`` counts buffers acquired and not released (tests check it reaches 0).
    ``pinned``: host buffers in page-locked memory (staging of GPU KV tensors for a UCX without
    CUDA support, ``ucx_memory``); else host buffers on huge pages (``host_buffer``).
    """

    def __init__(self, capacity_bytes: int, device: torch.device, *, pinned: bool = False):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if pinned and device.type != "cpu":
            raise ValueError(f"pinned staging is host memory, not {device}")
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self.num_outstanding = 0

    def acquire(self) -> torch.Tensor:
        self.num_outstanding += 1
        if self._free:
            return self._free.pop()
        if self.pinned:
            return torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=True)
        if self.device.type == "cpu":
            return host_buffer(self.capacity_bytes)
        return torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)

    def in_place(self, kv_caches: Sequence[torch.Tensor]) -> bool:
        """Whether UCX may send from or receive into ``kv_caches`` themselves: only when its
        buffers live where they do (not when GPU KV is staged through host memory)."""
        return self.device == kv_caches[0].device

    def release(self, buffer: torch.Tensor) -> None:
        if self.num_outstanding <= 0:
            raise RuntimeError(f"release with {self.num_outstanding} buffers outstanding")
        self.num_outstanding -= 1
        self._free.append(buffer)

    def forget(self, buffer: torch.Tensor) -> None:
        """Stop tracking a buffer that UCX may still write or read (a send or receive that could
        not be cancelled): it is never handed out again and is freed when UCX drops it."""
        if self.num_outstanding <= 0:
            raise RuntimeError(f"forget with {self.num_outstanding} buffers outstanding")
        self.num_outstanding -= 1
        del buffer


def chunk_view(
    buffer: torch.Tensor,
    num_layers: int,
    num_blocks: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    row: RowSlice | None = None,
) -> torch.Tensor:
    """``[num_layers, num_blocks, *block_shape]`` view of the front of a flat byte buffer, or
    ``[num_layers, num_blocks, row.nbytes]`` uint8 for a partial ``row``.

    Raises:
        ValueError: the buffer is too small.
    """
    if row is not None and not row.whole:
        block_shape, dtype = (row.nbytes,), torch.uint8
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = num_layers * num_blocks
    for size in block_shape:
        numel *= size
    nbytes = numel * itemsize
    if nbytes > buffer.numel():
        raise ValueError(f"chunk of {nbytes} bytes does not fit a {buffer.numel()}-byte buffer")
    return buffer[:nbytes].view(dtype).view(num_layers, num_blocks, *block_shape)


def wire_buffer(tensor: torch.Tensor) -> Any:
    """An object UCX can send from / receive into without a copy: the tensor itself on CUDA
    (``__cuda_array_interface__``), a numpy byte view of host memory on CPU."""
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat.numpy()
    return flat


def run_start(block_ids: Sequence[int]) -> int | None:
    """``block_ids[0]`` when the ids are one ascending run ``a, a+1, ..., a+n-1``, else None.

    A run of one layer is one contiguous byte range of the KV tensor, so UCX can send from or
    receive into the tensor itself (no gather/scatter copy)."""
    if len(block_ids) == 0:
        return None
    first = int(block_ids[0])
    # compared in C: a chunk of thousands of ids costs microseconds, not a Python loop
    if list(block_ids) != list(range(first, first + len(block_ids))):
        return None
    return first


def row_bytes_view(kv_cache: torch.Tensor, row: RowSlice) -> torch.Tensor:
    """``[num_blocks, row.nbytes]`` uint8 view of the ``row`` bytes of every block of a
    contiguous ``[num_blocks, ...]`` tensor (strided: row ``b`` starts at
    ``b * block_nbytes + row.offset``)."""
    rows = kv_cache.reshape(kv_cache.shape[0], -1).view(torch.uint8)
    return rows[:, row.offset : row.offset + row.nbytes]


def _ids_tensor(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(block_ids), dtype=torch.int64).to(device)


def copy_in(
    staging: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    row: RowSlice | None = None,
) -> None:
    """Requester side: ``kv_caches[l][block_ids[i]] = staging[l, i]``; with a partial ``row``
    only those bytes of each block (``staging`` then ``[L, n, row.nbytes]`` uint8). A run of ids
    is one slice copy per layer; other ids go through ``kvbridge.kernels.scatter_blocks`` (a
    partial row: ``host_copy.put_rows``). On CPU every copy runs on the calling thread
    (``kvbridge.kernels.host_copy``: torch's copies wait for descheduled intra-op threads on a
    busy host). ``staging`` in host memory for caches on a GPU (pinned staging, ``ucx_memory``)
    is copied to the GPU first. Mutates the caches.
    """
    if staging.device != kv_caches[0].device:
        staging = staging.to(kv_caches[0].device)
    if row is not None and not row.whole:
        start = run_start(block_ids)
        ids = None if start is not None else _ids_tensor(block_ids, kv_caches[0].device)
        for layer, kv_cache in enumerate(kv_caches):
            rows = row_bytes_view(kv_cache, row)
            if ids is None:
                copy_rows(rows[start : start + len(block_ids)], staging[layer])
            else:
                put_rows(rows, ids, staging[layer])
        synchronize(staging)
        return
    start = run_start(block_ids)
    if start is not None:
        for layer, kv_cache in enumerate(kv_caches):
            copy_rows(kv_cache[start : start + len(block_ids)], staging[layer])
    else:
        ids = torch.tensor(list(block_ids), dtype=torch.int64).to(kv_caches[0].device)
        scatter_blocks(staging, kv_caches, ids)
    synchronize(staging)


def copy_out(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    staging: torch.Tensor,
    row: RowSlice | None = None,
) -> None:
    """Holder side: ``staging[l, i] = kv_caches[l][block_ids[i]]`` (slice copies for a run,
    else ``kvbridge.kernels.gather_blocks``); with a partial ``row`` only those bytes of each
    block (``staging`` ``[L, n, row.nbytes]`` uint8). On CPU on the calling thread, as
    ``copy_in``. ``staging`` in host memory for caches on
    a GPU (pinned staging, ``ucx_memory``): gathered on the GPU, then copied to host (returns
    once the bytes are there). Mutates ``staging`` only."""
    if staging.device != kv_caches[0].device:
        on_device = torch.empty_like(staging, device=kv_caches[0].device)
        copy_out(kv_caches, block_ids, on_device, row)
        staging.copy_(on_device)
        return
    if row is not None and not row.whole:
        start = run_start(block_ids)
        ids = None if start is not None else _ids_tensor(block_ids, kv_caches[0].device)
        for layer, kv_cache in enumerate(kv_caches):
            rows = row_bytes_view(kv_cache, row)
            if ids is None:
                copy_rows(staging[layer], rows[start : start + len(block_ids)])
            else:
                take_rows(staging[layer], rows, ids)
        synchronize(staging)
        return
    start = run_start(block_ids)
    if start is not None:
        for layer, kv_cache in enumerate(kv_caches):
            copy_rows(staging[layer], kv_cache[start : start + len(block_ids)])
    else:
        ids = torch.tensor(list(block_ids), dtype=torch.int64).to(kv_caches[0].device)
        gather_blocks(kv_caches, ids, staging)
    synchronize(staging)


INLINE_COPY_MAX_BYTES = 1 << 20
"""Copies of at most this many bytes run on the event loop thread itself: handing a copy to a
worker thread and back costs two thread wake-ups, each up to a scheduler tick on a loaded host,
more than such a copy takes (docs/architecture.md, "Design measurements"). Larger copies run in
a worker thread (torch releases the GIL), so UCX keeps progressing the chunks in flight."""


_COPY_THREADS = 2
"""Worker threads for large copies (``copy_executor``): one per concurrent gather or scatter of
this process's reads and serves; more only queue for the same memory bandwidth."""


CPU = torch.device("cpu")


def copy_executor(device: torch.device = CPU) -> ThreadPoolExecutor:
    """Worker threads for copies of KV tensors on ``device`` (an indexed CUDA device or the CPU;
    one pool per device), each bound to it at start (``kvbridge.kernels.device_binding``), whose
    torch CPU ops each run on one OpenMP thread.

    Why (``benchmarks/bench_transport.py``, paged case, 2-core host): with torch's default of one
    OpenMP thread per core, each gather/scatter forks onto the core that UCX and the peer process
    keep busy and waits at the OpenMP barrier for a scheduler tick (docs/architecture.md,
    "Design measurements"); a block copy is memory-bound (two copying threads moved no more bytes
    per second than one), so one thread per copy loses nothing."""
    return _copy_executor(torch.device(device))


@functools.cache
def _copy_executor(device: torch.device) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(
        _COPY_THREADS,
        thread_name_prefix="kvbridge-copy",
        initializer=bound(device, _one_openmp_thread),
    )


@contextlib.contextmanager
def _one_openmp_thread_here() -> Iterator[None]:
    """The body's torch CPU ops run on the calling thread alone (see ``_one_openmp_thread``);
    the thread's own OpenMP setting is put back afterwards (no other thread ever sees it)."""
    torch.get_num_threads()  # torch's lazy per-thread set-up first
    runtime = _openmp_runtime()
    previous = runtime.omp_get_max_threads() if runtime is not None else 1
    if previous == 1:
        yield
        return
    runtime.omp_set_num_threads(1)
    try:
        yield
    finally:
        runtime.omp_set_num_threads(previous)


def _one_openmp_thread() -> None:
    """Copy-thread initializer: limit this thread alone to one OpenMP thread.

    ``torch.set_num_threads`` is not used: it also stores a process-wide default that every
    thread initialising torch later inherits (measured: a main thread then ran on 1 thread). The
    OpenMP runtime's own ``omp_set_num_threads`` sets only the calling thread's value; torch's
    lazy per-thread set-up runs first (``torch.get_num_threads``) so it cannot overwrite it."""
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (GNU or Intel), found in ``/proc/self/maps``; None where
    there is none or no such file (then copies keep torch's default thread count)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line]
    except OSError:
        return None
    return ctypes.CDLL(paths[0]) if paths else None


async def run_copy(
    fn: Callable[..., None], *args: Any, nbytes: int, device: torch.device = CPU
) -> None:
    """``fn(*args)`` (a ``copy_in`` / ``copy_out`` of KV tensors on ``device``) on one OpenMP
    thread: inline when ``nbytes`` is at most ``INLINE_COPY_MAX_BYTES`` (the loop thread is
    bound to the KV device already: ``LoopThread.bind``), else in a copy worker thread of
    ``device`` (``copy_executor``). Returns or raises only once the copy has ended, also when
    the caller is cancelled (``join_threads``)."""
    if nbytes <= INLINE_COPY_MAX_BYTES:
        with _one_openmp_thread_here():
            fn(*args)
    else:
        await join_threads([copy_executor(device).submit(fn, *args)])


async def join_threads(
    futures: Sequence[Future[None]], stop: threading.Event | None = None
) -> None:
    """Await copy-thread futures (``copy_executor().submit``).

    On a failure or a cancellation of the caller, ``stop`` is set (copies check it between
    calls) and this waits until every thread has ended before it re-raises: a copy that
    outlived its read could write KV blocks already handed to another request, or staging
    already reused. A future not yet started is cancelled instead.

    Raises:
        whatever the first failing copy raised, or ``asyncio.CancelledError``.
    """
    try:
        await asyncio.gather(*map(_waiter, futures))
    except BaseException:
        if stop is not None:
            stop.set()
        for future in futures:
            future.cancel()  # only succeeds for a copy that has not started
        while pending := [f for f in futures if not f.done()]:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(map(_waiter, pending))
        raise


def _waiter(future: Future[None]) -> asyncio.Future[None]:
    """An asyncio future following ``future`` whose outcome counts as retrieved: the caller
    raises a copy's error once, and an unretrieved one would be logged at garbage collection,
    from whatever code happens to run then."""
    waiter = asyncio.wrap_future(future)
    waiter.add_done_callback(lambda w: w.cancelled() or w.exception())
    return waiter


def synchronize(tensor: torch.Tensor) -> None:
    """Wait for kernels writing ``tensor`` (a no-op on CPU) before UCX reads it."""
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()
