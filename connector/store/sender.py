"""Offload's worker half: snapshot the planned blocks' bytes out of the KV tensors into host
staging and write them to the store tier without making the step wait for the network.

``submit`` is called in ``start_load_kv``, before the step's forward: it gathers the items'
blocks into a staging buffer at once (a consistent snapshot: no forward or pull writes a block
while it holds its hash, whether it is free or in use, ``planner.py``; a block reused since the
plan was withdrawn by ``drop_reused``) and hands the write to the connector's loop thread
(``StoreWriter``). Every submitted item gets exactly one ``OffloadOutcome`` (``take_outcomes``),
which the worker half returns to the scheduler half's ``OffloadPlanner``. A store's reply may
also name ancestors it lacks (``missing_ancestors``: blocks it dropped, or never got, which keep
the put's blocks out of the index); each name becomes one more outcome, marked ``missing``
(``num_offload_missing_ancestors`` counts them), after the put's own, so that the planner
writes the block again if its pool still caches it.

A store that cannot be written (unreachable, silent past ``StoreWriter.put_timeout_s``, or
answering garbage) is said once per outage: one WARNING naming the store and the error at the
first failed write, DEBUG for the next ones, one INFO when a write lands again; each failed
write counts in ``num_offload_failures`` and its items are reported not held.

Back-pressure: while ``max_inflight_bytes`` or more of snapshots wait for the store, ``submit``
snapshots nothing; its items are reported not held at once (``num_offload_skipped_blocks``) and
the planner plans them again later.

A store that refuses this node's hello (``StoreRefusedError``: a store of another block
geometry) fails every write: logged once at ERROR, each counted in ``num_offload_failures``; the
writer asks that store again every ``StoreWriter.refused_retry_s``.

The hello goes out at ``bind`` (the engine's start), in an empty put on the loop thread: a store
that is up opens this node's shelf then (allocating its capacity for the geometry, starting its
transport), not inside the first offload's write while requests run; its incarnation is known
from the start; a refusal is logged then. A store not up yet gets one INFO line; the first
write connects again.

A store that restarts empty is noticed from the incarnation in its next reply. So that a node
with nothing new to write notices it too, ``probe_if_due`` sends an empty put (one group of no
blocks, which a store answers like any put) when nothing went to the store for
``probe_interval_s``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from kvbridge.transport import NodeMetadata, format_host_port

from ..errors import KVTransferConfigError
from ..loop_thread import LoopThread, get_loop_thread
from ..stats import KVTransferStats
from .offload_items import OffloadItem, OffloadOutcome
from .profile import StoreProfile
from .staging import StagingPool, snapshot_blocks, staging_nbytes
from .wire import PutGroup, PutReply, PutRequest, StoreRefusedError, StoreWireError
from .writer import StoreWriter

__all__ = ["OffloadSender"]

logger = logging.getLogger(__name__)

_MAX_PENDING_OUTCOMES = 1 << 20
_CLOSE_TIMEOUT_S = 5.0


class OffloadSender:
    """Writes submitted blocks to one store. See the module docstring.

    Threads: ``bind``, ``submit`` and ``take_outcomes`` run on the worker thread (the KV
    tensors' owner); the writes run on the connector loop thread; what both touch (bytes in
    flight, pending outcomes, the send futures) is under one lock. ``wait_idle`` and ``close``
    may be called from any thread but the loop's.

    Args:
        store_address: the store's write server ``(host, port)``.
        max_inflight_bytes: snapshot bytes allowed to wait for the store (>= 1); also the most
            bytes of idle staging buffers kept for reuse.
        stats: the node's ``KVTransferStats`` (offload counters).
        loop_thread: where writes run (default: the process's connector loop).
        probe_interval_s: ``probe_if_due`` asks the store for its incarnation after this many
            seconds without a put (0: never).
    """

    def __init__(
        self,
        *,
        store_address: tuple[str, int],
        max_inflight_bytes: int,
        stats: KVTransferStats,
        loop_thread: LoopThread | None = None,
        probe_interval_s: float = 0.0,
    ) -> None:
        if max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {max_inflight_bytes}")
        if not probe_interval_s >= 0.0:
            raise ValueError(f"probe_interval_s must be >= 0, got {probe_interval_s}")
        self.probe_interval_s = probe_interval_s
        self._last_put_s: float | None = None  # when submit or a probe last sent (worker thread)
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = stats
        self.writer = StoreWriter(*store_address)
        self.writer_address = store_address
        self.profile: StoreProfile | None = None  # set by bind
        self._loop_thread = loop_thread
        self._staging_pool = StagingPool(max_inflight_bytes)
        self._kv_caches_by_group: list[list[torch.Tensor]] | None = None
        self._compat_hash = ""
        self._heads: tuple[int, int] | None = None  # this rank's KV heads (None: all)
        self._closed = False
        self._lock = threading.Lock()
        self._inflight_bytes = 0
        self._outcomes: deque[OffloadOutcome] = deque(maxlen=_MAX_PENDING_OUTCOMES)
        self._store_incarnation = 0  # of the store that answered the latest put
        self._futures: set[Future[None]] = set()
        self._refusals_logged: set[str] = set()  # loop thread only
        self._failing_since_s: float | None = None  # writes failing since (loop thread only)
        self._num_failed_writes = 0

    # ------------------------------------------------------------------ worker thread
    def bind(self, kv_caches_by_group: Sequence[Sequence[torch.Tensor]],
             metadata: NodeMetadata, *, kv_heads_layout: str = "") -> None:
        """Give the sender the node's KV tensors, ``[group][layer]`` tensors
        ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (``register_kv_caches``), and
        its handshake ``metadata`` and ``IndexNamespace.kv_heads_layout``: its store profile
        (``profile.StoreProfile``, of the model's whole blocks: ``full_heads``), logged once
        at INFO and sent in a hello on each connection (a store without a geometry takes it;
        one of another geometry refuses this node), the first one now, in an empty put on the
        loop thread (the module docstring). A rank holding part of the model's KV
        heads (``metadata.kv_heads``, tensor parallel) names them in each put: the store holds
        a block once every rank wrote its heads.

        Raises:
            KVTransferConfigError: a rank holding part of the heads in a layout that does not
                keep them in one byte range of a block (``KVHeads.sliceable`` False).
        """
        heads = metadata.held_heads
        self._heads = None if heads == (0, metadata.total_kv_heads) else heads
        if self._heads is not None and not (metadata.kv_heads and metadata.kv_heads.sliceable):
            raise KVTransferConfigError(
                f"kv_connector_extra_config.store_url: this rank holds KV heads [{heads[0]}, "
                f"{heads[1]}) of {metadata.total_kv_heads} in the layout "
                f"{metadata.identity.kv_layout!r}, which does not keep a rank's heads in one "
                "byte range of a block; the store tier keeps whole blocks written by every rank "
                "(tensor_parallel_size 1 works)")
        self._kv_caches_by_group = [list(group) for group in kv_caches_by_group]
        self.profile = StoreProfile.of_metadata(
            metadata, kv_heads_layout=kv_heads_layout).full_heads()
        self.writer.hello = self.profile  # each connection's hello: a new store takes it
        self._compat_hash = metadata.compat_hash
        logger.info("offload to the store at %s:%d; this node's store profile: kvbridge-store "
                    "--profile '%s'", *self.writer_address, self.profile.to_json())
        self._start(self._hello(self._empty_put()))

    @property
    def is_bound(self) -> bool:
        return self._kv_caches_by_group is not None

    @property
    def inflight_bytes(self) -> int:
        """Snapshot bytes handed to the loop thread whose write has not settled."""
        with self._lock:
            return self._inflight_bytes

    def submit(self, items: Sequence[OffloadItem]) -> int:
        """Snapshot ``items`` now and start writing them to the store; returns how many were
        snapshotted (0: none given, or all skipped for back-pressure). Reads the KV tensors,
        never waits for the network.

        Raises:
            RuntimeError: called before ``bind`` or after ``close``.
            ValueError: an item's group or block id does not exist in the bound KV tensors.
        """
        if not items:
            return 0
        caches_by_group, by_group = self._check(items)
        with self._lock:
            skipped = self._inflight_bytes >= self.max_inflight_bytes
            if skipped:
                self._outcomes.extend(OffloadOutcome(it.group_id, it.block_hash, False)
                                      for it in items)
        if skipped:
            self.stats.add("num_offload_skipped_blocks", len(items))
            return 0
        groups: list[PutGroup] = []
        for group_id, members in by_group.items():
            groups.append(
                PutGroup(
                    group_id=group_id,
                    block_hashes=tuple(item.block_hash for item in members),
                    parent_hashes=tuple(item.parent_hash for item in members),
                    nbytes=staging_nbytes(caches_by_group[group_id], len(members)),
                )
            )
        put = PutRequest(compat_hash=self._compat_hash, groups=tuple(groups), heads=self._heads)
        buffer = self._staging_pool.take(put.payload_nbytes)
        offset = 0
        for group in groups:
            block_ids = [item.block_id for item in by_group[group.group_id]]
            caches = caches_by_group[group.group_id]
            snapshot_blocks(caches, block_ids, buffer[offset : offset + group.nbytes])
            offset += group.nbytes
        with self._lock:
            self._inflight_bytes += put.payload_nbytes
        self._start(self._send(put, buffer), time.monotonic())
        return len(items)

    def probe_if_due(self, now_s: float) -> bool:
        """Send an empty put, whose reply names the store's incarnation (``store_incarnation``),
        when ``probe_interval_s`` (> 0) passed since the last put or probe and none is in flight
        (its reply will name it). ``now_s``: ``time.monotonic()``. Returns whether it sent one.
        Never waits for the network; a failed probe is logged (debug) and counts nothing."""
        if self.probe_interval_s <= 0.0 or self._closed or not self.is_bound:
            return False
        if self._last_put_s is None:
            self._last_put_s = now_s  # the interval counts from the first call
        with self._lock:
            if self._futures or now_s - self._last_put_s < self.probe_interval_s:
                return False
        self._start(self._probe(self._empty_put()), now_s)
        return True

    def take_outcomes(self) -> list[OffloadOutcome]:
        """The outcomes reported since the last call, in the order they settled (for the step's
        worker output)."""
        with self._lock:
            outcomes = list(self._outcomes)
            self._outcomes.clear()
        return outcomes

    @property
    def store_incarnation(self) -> int:
        """The incarnation of the store that answered the latest put (0: no answer yet, or a
        store that does not say). A new one means the store restarted empty: the planner
        forgets what it remembered as written (``OffloadPlanner.apply_outcomes``)."""
        with self._lock:
            return self._store_incarnation

    def _check(
        self, items: Sequence[OffloadItem]
    ) -> tuple[list[list[torch.Tensor]], dict[int, list[OffloadItem]]]:
        """The bound KV tensors and ``items`` by group id (ascending; plan order kept within a
        group). Raises as ``submit``."""
        caches_by_group = self._kv_caches_by_group
        if self._closed:
            raise RuntimeError("OffloadSender.submit after close()")
        if caches_by_group is None:
            raise RuntimeError("OffloadSender.submit before bind()")
        by_group: dict[int, list[OffloadItem]] = {}
        for i, item in enumerate(items):
            if not 0 <= item.group_id < len(caches_by_group):
                raise ValueError(
                    f"offload item [{i}]: group_id {item.group_id} not in "
                    f"[0, {len(caches_by_group)})"
                )
            num_blocks = caches_by_group[item.group_id][0].shape[0]
            if not 1 <= item.block_id < num_blocks:
                raise ValueError(
                    f"offload item [{i}]: block_id {item.block_id} not in [1, {num_blocks})"
                )
            by_group.setdefault(item.group_id, []).append(item)
        return caches_by_group, dict(sorted(by_group.items()))

    def _empty_put(self) -> PutRequest:
        """A put of one group of no blocks (the hello's and the probe's): a store answers it
        like any put, with its incarnation."""
        group = PutGroup(group_id=0, block_hashes=(), parent_hashes=(), nbytes=0)
        return PutRequest(compat_hash=self._compat_hash, groups=(group,))

    def _note_incarnation(self, reply: PutReply) -> None:
        """The incarnation a reply names (none: the one known stays). Loop thread."""
        with self._lock:
            self._store_incarnation = reply.store_incarnation or self._store_incarnation

    def _start(self, write: Coroutine[Any, Any, None], now_s: float | None = None) -> None:
        """Run ``write`` on the loop thread, tracked in ``_futures``; ``now_s``: monotonic,
        when it counts as a put for ``probe_if_due`` (None: the hello, which does not)."""
        if now_s is not None:
            self._last_put_s = now_s
        future = (self._loop_thread or get_loop_thread()).submit(write)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget_future)

    # ------------------------------------------------------------------ loop thread
    async def _probe(self, put: PutRequest) -> None:
        try:
            reply = await self.writer.put(put, [])
        except (TimeoutError, StoreWireError, OSError, EOFError) as exc:
            logger.debug("store probe failed: %s", exc)
            return
        self._note_incarnation(reply)

    async def _hello(self, put: PutRequest) -> None:
        """``bind``'s empty put: the hello, and the store's incarnation."""
        try:
            reply = await self.writer.put(put, [])
        except StoreRefusedError as exc:
            self._refusals_logged.add(str(exc))
            logger.error("offload to the store tier refused at start: %s (counted as store "
                         "write failures; asked again every %.0f s)", exc,
                         self.writer.refused_retry_s)
            return
        except (TimeoutError, StoreWireError, OSError, EOFError) as exc:
            logger.info("the store at %s:%d does not answer yet (%s); offload connects at its "
                        "first write", self.writer.host, self.writer.port, exc)
            return
        self._note_incarnation(reply)

    async def _send(self, put: PutRequest, buffer: torch.Tensor) -> None:
        try:
            view = memoryview(buffer[: put.payload_nbytes].numpy())
            reply = await self.writer.put(put, [view])
        except (TimeoutError, StoreWireError, OSError, EOFError) as exc:
            if not isinstance(exc, StoreRefusedError):
                self._say_failed(put, exc)
            elif str(exc) not in self._refusals_logged:  # the same every time: said once
                self._refusals_logged.add(str(exc))
                logger.error("offload to the store tier stopped: %s (counted as store write "
                             "failures; retried every %.0f s)", exc, self.writer.refused_retry_s)
            self.stats.add("num_offload_failures")
            self._report(put, refused=None)
            return
        except BaseException:  # a bug or a cancelled loop: still one outcome per item
            self._report(put, refused=None)
            raise
        finally:
            with self._lock:
                self._inflight_bytes -= put.payload_nbytes
            self._staging_pool.give(buffer)  # the socket no longer reads it
        self._say_landed()
        num_held, bytes_held = self._report(
            put, refused=set(reply.refused), missing_ancestors=reply.missing_ancestors,
            store_incarnation=reply.store_incarnation,
        )
        self.stats.add("num_offloaded_blocks", num_held)
        self.stats.add("bytes_offloaded", bytes_held)
        self.stats.add("num_offload_refused_blocks", reply.num_refused)

    def _say_failed(self, put: PutRequest, exc: BaseException) -> None:
        """A write failed (the store unreachable, silent, or answering garbage): one WARNING
        naming the store and the error when writes start failing, DEBUG for the later ones of
        the same outage (a write fails every step meanwhile). Loop thread."""
        num_blocks = sum(len(g.block_hashes) for g in put.groups)
        if self._failing_since_s is not None:
            self._num_failed_writes += 1
            logger.debug("offload of %d block(s) failed: %s", num_blocks, exc)
            return
        self._failing_since_s, self._num_failed_writes = time.monotonic(), 1
        logger.warning(
            "offload to the store at %s failed (%s: %s); the blocks stay in this node's cache "
            "and are planned again, each failed write counted in num_offload_failures; said "
            "again once a write lands", format_host_port(*self.writer_address),
            type(exc).__name__, exc)

    def _say_landed(self) -> None:
        """A write was answered: one INFO line if writes were failing until now. Loop thread."""
        if self._failing_since_s is None:
            return
        logger.info("offload to the store at %s works again after %.1f s (%d failed writes)",
                    format_host_port(*self.writer_address),
                    time.monotonic() - self._failing_since_s, self._num_failed_writes)
        self._failing_since_s = None

    def _report(
        self,
        put: PutRequest,
        *,
        refused: set[tuple[int, bytes]] | None,
        missing_ancestors: Sequence[tuple[int, bytes]] = (),
        store_incarnation: int = 0,
    ) -> tuple[int, int]:
        """One outcome per block of ``put`` (``refused`` None: the write failed, none held),
        then a ``missing`` one per ``missing_ancestors`` key (a key of ``put`` too: a later row
        of the put evicted it). Returns the blocks and bytes held."""
        outcomes: list[OffloadOutcome] = []
        num_held = bytes_held = 0
        for group in put.groups:
            block_nbytes = group.nbytes // max(len(group.block_hashes), 1)
            for block_hash in group.block_hashes:
                held = refused is not None and (group.group_id, block_hash) not in refused
                outcomes.append(OffloadOutcome(group.group_id, block_hash, held))
                if held:
                    num_held += 1
                    bytes_held += block_nbytes
        if missing_ancestors:
            outcomes += (OffloadOutcome(g, h, False, True) for g, h in missing_ancestors)
            self.stats.add("num_offload_missing_ancestors", len(missing_ancestors))
        with self._lock:
            self._outcomes.extend(outcomes)
            self._store_incarnation = store_incarnation or self._store_incarnation
        return num_held, bytes_held

    def _forget_future(self, future: Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    # ------------------------------------------------------------------ any thread
    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Block until every started write settled (tests, shutdown); its outcome is then in
        ``take_outcomes``."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            with contextlib.suppress(Exception):  # already logged and counted by _send
                future.result(timeout_s)

    def close(self) -> None:
        """Let started writes settle (up to a few seconds), then close the connection. Never
        raises; idempotent."""
        self._closed = True
        self.wait_idle(_CLOSE_TIMEOUT_S)
        try:
            (self._loop_thread or get_loop_thread()).run(self.writer.close(), _CLOSE_TIMEOUT_S)
        except Exception:  # shutting down: never raise
            logger.exception("closing the store writer failed")
