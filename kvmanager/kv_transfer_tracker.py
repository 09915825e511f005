"""``KVTransferTracker``: the scheduler's record of KV moved by the connector, and its rules.

The ``Scheduler`` owns one tracker and keeps the queues; the tracker keeps everything about a
request's external KV (vllm/v1/core/sched/scheduler.py: ``_update_waiting_for_remote_kv``,
``_update_from_kv_xfer_finished``, ``_handle_invalid_blocks``; docs/architecture.md, "The
scheduler"; docs/architecture.md, "Load-failure policies"). Life of a load::

    admitted   record_admission: its external token range [num_local, num_local + external)
      sync  -> the range expires at end_step (the load ran inside this step's forward)
      async -> WAITING_FOR_REMOTE_KVS until the connector reports it in finished_recving:
               settle_load -> LANDED, then take_landed_load when the request's turn comes:
               num_computed_tokens = min(loaded, first bad token, num_tokens - 1)
               (the last prompt token is always recomputed to get logits)

Load errors (``invalid_block_ids``): ``take_failed_sync_loads`` evicts the bad blocks' hashes and
finds, per load range, the first token of the first bad block. An async load remembers it until
it settles; a sync load's step is void and the scheduler applies the policy at once.
``kv_load_failure_policy`` ``"recompute"`` resumes at the first bad block when
``can_resume_from`` allows it (else the request restarts from scratch, local hits only:
``mark_local_only``); ``"fail"`` finishes the request with ``FINISHED_ERROR``.

Held blocks: a finished request keeps its blocks while the connector's ``delay_free`` waits for
``finished_sending``, or while its async load is still in flight (it waits for
``finished_recving``); the last release frees them. An id reported for nothing held is ignored.

The tracker never touches the queues, requests or block references (the scheduler acts on its
answers); it reads block ids from the ``KVCacheManager`` and evicts bad blocks' hashes through
its ``BlockPool``.
"""

from __future__ import annotations

import enum
import logging
from typing import NamedTuple

from .connector_interface import KVLoadFailurePolicy, MatchedTokens
from .kv_cache_manager import KVCacheManager
from .request import Request

__all__ = ["HOLD_RECVING", "HOLD_SENDING", "FailedLoad", "KVTransferTracker", "LoadSettled"]

logger = logging.getLogger(__name__)

HOLD_SENDING = "sending"  # request_finished said delay_free: wait for finished_sending
HOLD_RECVING = "recving"  # finished while its async load was in flight: wait for finished_recving


class LoadSettled(enum.Enum):
    """What ``settle_load`` made of a ``finished_recving`` report."""

    IGNORED = enum.auto()  # no load pending for that id (unknown, duplicate, raced a free)
    LANDED = enum.auto()  # the request resumes at its next turn in the waiting queue
    FAILED = enum.auto()  # a bad block under policy "fail": finish it with FINISHED_ERROR
    HELD = enum.auto()  # finished while loading; another hold still keeps its blocks
    FREE = enum.auto()  # finished while loading; that was its last hold: free its blocks


class FailedLoad(NamedTuple):
    """A sync load that hit a bad block: this step's result for the request is void."""

    req_id: str
    first_bad_token: int  # first token of the first bad block (token index in the request)


class KVTransferTracker:
    """External-KV bookkeeping of one ``Scheduler`` (see the module docstring for the rules).

    Args:
        kv_cache_manager: the scheduler's manager (read for block ids and sliding windows).
        block_size: tokens per block (the same in every KV cache group).
        kv_load_failure_policy: ``"recompute"`` or ``"fail"`` (checked by ``Scheduler``).
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        block_size: int,
        kv_load_failure_policy: KVLoadFailurePolicy,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.kv_load_failure_policy = kv_load_failure_policy
        # Async loads: request id -> tokens computed once the load lands (local hit + external).
        self._loading_num_tokens: dict[str, int] = {}
        # Start and end token of the external range of every load not yet settled.
        self._load_ranges: dict[str, tuple[int, int]] = {}
        # Sync loads done inside this step's forward (their range expires after the step).
        self._sync_loads_this_step: set[str] = set()
        self._finished_recving_kv_req_ids: set[str] = set()
        # Async load failures: request id -> first token of the first bad block.
        self._failed_recving_first_bad_token: dict[str, int] = {}
        # Requests that already hold blocks while waiting (their async load settled): no lookup.
        self._skip_lookup_req_ids: set[str] = set()
        # Requests that recompute from scratch after a load failure: no connector lookup again.
        self._local_only_req_ids: set[str] = set()
        # Finished requests whose blocks stay referenced, and why (HOLD_*).
        self._held_req_ids: dict[str, set[str]] = {}
        self._sliding_windows = [
            getattr(group.kv_cache_spec, "sliding_window", None)
            for group in kv_cache_manager.kv_cache_config.kv_cache_groups
        ]

    # ------------------------------------------------------------------ admission
    def needs_lookup(self, request: Request) -> bool:
        """Whether a waiting request asks for prefix hits (local and external): only with no
        computed tokens, and not when it already holds the blocks of a settled load."""
        return (
            request.num_computed_tokens == 0
            and request.request_id not in self._skip_lookup_req_ids
        )

    def may_load_external(self, req_id: str) -> bool:
        """False once a load failure made the request recompute from scratch."""
        return req_id not in self._local_only_req_ids

    @staticmethod
    def clamp_external(request: Request, num_local: int, matched: MatchedTokens) -> int:
        """External tokens that fit: a sync load leaves the last token to compute; an async one
        may cover the whole prompt (the last token is recomputed after it lands)."""
        num_external = max(0, int(matched.num_external_tokens))
        limit = request.num_tokens - num_local - (0 if matched.load_kv_async else 1)
        if num_external > limit:
            logger.warning(
                "request %s: connector offered %d external tokens, %d fit",
                request.request_id, num_external, max(limit, 0),
            )
        return max(0, min(num_external, limit))

    def record_admission(
        self,
        req_id: str,
        *,
        num_local: int,
        num_external: int,
        load_kv_async: bool,
        num_computed: int,
    ) -> None:
        """A waiting request got its blocks: record its load, if any (mutates only the
        tracker). ``num_computed`` is the progress once the load is done."""
        self._skip_lookup_req_ids.discard(req_id)
        self._local_only_req_ids.discard(req_id)
        if num_external:
            self._load_ranges[req_id] = (num_local, num_local + num_external)
        if load_kv_async:
            self._loading_num_tokens[req_id] = num_computed
        elif num_external:
            self._sync_loads_this_step.add(req_id)

    def end_step(self) -> None:
        """This step's sync loads are past any error report: forget their ranges."""
        for req_id in self._sync_loads_this_step:
            self._load_ranges.pop(req_id, None)
        self._sync_loads_this_step.clear()

    # ------------------------------------------------------------------ async loads
    def settle_load(self, req_id: str, request: Request | None) -> LoadSettled:
        """Apply a ``finished_recving`` report (mutates only the tracker; the caller acts on
        the answer)."""
        if request is None or req_id not in self._loading_num_tokens:
            logger.debug("ignoring finished_recving of request %s: no load pending", req_id)
            return LoadSettled.IGNORED
        if request.is_finished():  # aborted while loading: the blocks may go now
            self._forget_load(req_id)
            return LoadSettled.FREE if self.release_hold(req_id, HOLD_RECVING) else LoadSettled.HELD
        if (
            req_id in self._failed_recving_first_bad_token
            and self.kv_load_failure_policy == "fail"
        ):
            self._forget_load(req_id)
            return LoadSettled.FAILED
        self._finished_recving_kv_req_ids.add(req_id)
        return LoadSettled.LANDED

    def take_landed_load(self, request: Request) -> int | None:
        """The ``num_computed_tokens`` a WAITING_FOR_REMOTE_KVS request resumes from once its
        load landed (truncated at the first bad block after a load error), or None while it is
        in flight. Consumes the load's record."""
        req_id = request.request_id
        if req_id not in self._finished_recving_kv_req_ids:
            return None
        self._finished_recving_kv_req_ids.discard(req_id)
        self._load_ranges.pop(req_id, None)
        num_loaded = self._loading_num_tokens.pop(req_id)
        first_bad = self._failed_recving_first_bad_token.pop(req_id, None)
        if first_bad is not None:
            num_loaded = min(num_loaded, first_bad)
        return min(num_loaded, request.num_tokens - 1)

    def skip_lookup(self, req_id: str) -> None:
        """The request resumed from a landed load and holds its blocks: no lookup again."""
        self._skip_lookup_req_ids.add(req_id)

    def mark_local_only(self, req_id: str) -> None:
        """The request restarts from scratch after a load failure: local prefix hits only."""
        self._skip_lookup_req_ids.discard(req_id)
        self._local_only_req_ids.add(req_id)

    def _forget_load(self, req_id: str) -> None:
        self._loading_num_tokens.pop(req_id)
        self._load_ranges.pop(req_id, None)

    # ------------------------------------------------------------------ load errors
    def take_failed_sync_loads(self, invalid_block_ids: set[int]) -> list[FailedLoad]:
        """Evict the bad blocks' hashes (a bad block must never be a prefix hit; a sync load
        published its hash already) and find every load into them. An async load remembers its
        first bad token until it settles; the sync ones are returned, their ranges dropped.
        Block ids outside ``(0, num_blocks)`` are ignored. Mutates the block pool's cache."""
        num_blocks = self.kv_cache_manager.kv_cache_config.num_blocks
        bad = {block_id for block_id in invalid_block_ids if 0 < block_id < num_blocks}
        self.kv_cache_manager.block_pool.evict_blocks(sorted(bad))
        failed: list[FailedLoad] = []
        for req_id, (start, end) in list(self._load_ranges.items()):
            first_bad = self._first_bad_token(req_id, start, end, bad)
            if first_bad is None:
                continue
            logger.warning(
                "request %s: KV load failed from token %d (policy %s)",
                req_id, first_bad, self.kv_load_failure_policy,
            )
            if req_id in self._loading_num_tokens:
                self._failed_recving_first_bad_token[req_id] = first_bad
                continue
            self._load_ranges.pop(req_id)
            failed.append(FailedLoad(req_id, first_bad))
        return failed

    def _first_bad_token(self, req_id: str, start: int, end: int, bad: set[int]) -> int | None:
        """First token of the first block in ``[start, end)`` whose id is in ``bad``, over every
        group (positions are paired across groups), or None."""
        first_block = start // self.block_size
        last_block = -(-end // self.block_size)
        first_bad: int | None = None
        for group_ids in self.kv_cache_manager.get_block_ids(req_id):
            for block_index in range(first_block, min(last_block, len(group_ids))):
                if group_ids[block_index] in bad:
                    token = max(block_index * self.block_size, start)
                    first_bad = token if first_bad is None else min(first_bad, token)
                    break
        return first_bad

    def can_resume_from(self, req_id: str, num_computed_tokens: int) -> bool:
        """Whether every block that attention reads or writes from ``num_computed_tokens`` on
        is a real block in every group. A sliding-window group holds null blocks before the
        window of the progress it was allocated for; cutting progress back below that window
        (a load error) would read and write through the null block."""
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        for window, ids in zip(self._sliding_windows, block_ids, strict=True):
            first_token = 0 if window is None else max(0, num_computed_tokens - window + 1)
            if any(block_id == 0 for block_id in ids[first_token // self.block_size :]):
                return False
        return True

    # ------------------------------------------------------------------ held blocks
    @property
    def held_req_ids(self) -> set[str]:
        """Finished requests whose blocks are still referenced (a copy)."""
        return set(self._held_req_ids)

    @property
    def num_held_reqs(self) -> int:
        """How many finished requests still hold blocks."""
        return len(self._held_req_ids)

    def hold_finished(self, req_id: str, *, delay_free: bool) -> bool:
        """A request just finished (after ``request_finished``): forget its lookup state and
        decide whether its blocks stay referenced. Returns True when held (the caller frees
        them otherwise)."""
        self._skip_lookup_req_ids.discard(req_id)
        self._local_only_req_ids.discard(req_id)
        self._failed_recving_first_bad_token.pop(req_id, None)
        holds = set()
        if delay_free:
            holds.add(HOLD_SENDING)
        if req_id in self._loading_num_tokens:
            if req_id in self._finished_recving_kv_req_ids:  # settled, not yet consumed
                self._finished_recving_kv_req_ids.discard(req_id)
                self._forget_load(req_id)
            else:
                holds.add(HOLD_RECVING)
        if holds:
            self._held_req_ids[req_id] = holds
        return bool(holds)

    def release_hold(self, req_id: str, hold: str) -> bool:
        """Drop one reason to hold; True when it was the last (the caller frees the blocks).
        A hold that is not there is ignored (an abort raced a completion)."""
        holds = self._held_req_ids.get(req_id)
        if holds is None or hold not in holds:
            logger.debug("ignoring %s completion of request %s: nothing held", hold, req_id)
            return False
        holds.discard(hold)
        if holds:
            return False
        del self._held_req_ids[req_id]
        return True

    def forget_blocks(self, req_id: str) -> None:
        """The request's blocks were freed: no load error can concern them any more (a sync
        load's range otherwise lives until ``end_step``)."""
        self._load_ranges.pop(req_id, None)
