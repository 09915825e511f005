"""Admission of waiting requests: the connector-hook steps of ``schedule()``, in vLLM's order.

``SchedulerAdmission`` is a base of ``Scheduler`` (scheduler.py); ``schedule()`` calls
``_schedule_waiting`` once the running requests are served and nobody was preempted. A waiting
request with no computed tokens goes through::

    KVCacheManager.get_computed_blocks            local prefix hit (APC)
    connector.get_num_new_matched_tokens          external hit; None -> skip, ask next step
    KVCacheManager.allocate_slots(..., num_external_computed_tokens,
                                  delay_cache_blocks=load_kv_async)
    connector.update_state_after_alloc
    load_kv_async ? WAITING_FOR_REMOTE_KVS : RUNNING

Token layout of such a request (docs/architecture.md, "allocate_slots")::

    | local hit (cached) | external (connector) | new tokens (scheduled) |
    0             num_local_computed     num_computed          num_tokens

A request in ``WAITING_FOR_REMOTE_KVS`` whose load has landed is settled first
(``_update_waiting_for_remote_kv``: ``cache_blocks``, then its progress), as vLLM does at the
head of its waiting loop. The rules of external KV live in ``KVTransferTracker``; this module
acts on its answers.

Owning thread: the engine thread, like the rest of ``Scheduler``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .connector_interface import MatchedTokens
from .request import Request, RequestStatus
from .scheduler_queues import SchedulerQueues

__all__ = ["ScheduledWaiting", "SchedulerAdmission"]


@dataclass(slots=True)
class ScheduledWaiting:
    """What ``_schedule_waiting`` admitted: the requests that run this step (in admission
    order) and the token budget left after them."""

    token_budget: int
    new_reqs: list[Request] = field(default_factory=list)


class SchedulerAdmission(SchedulerQueues):
    """Waiting-queue admission of ``Scheduler``; the attributes are set by
    ``Scheduler.__init__`` (see its Args)."""

    max_num_seqs: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int

    def _schedule_waiting(
        self, token_budget: int, num_scheduled_tokens: dict[str, int]
    ) -> ScheduledWaiting:
        """Admit waiting requests, FCFS, while the budget, ``max_num_seqs`` and the free blocks
        allow (mutates queues, request status and progress, allocations; adds each admitted
        request's tokens to ``num_scheduled_tokens``). A request skipped for now (its load not
        landed, the connector asking again) keeps its place at the front. The first request
        that does not fit stops the admission of requests that hold no blocks; behind it, a
        request that already holds its blocks (a parked load, landed or not, or progress kept
        after a load error) is still settled and admitted when it fits: it frees its blocks when
        it finishes, and the head may be waiting for exactly those (issue 15, case 1: a vLLM
        deadlock report). Queue order is kept either way. RuntimeError if a waiting request has
        nothing left to compute (corrupt progress)."""
        admitted = ScheduledWaiting(token_budget)
        skipped: deque[Request] = deque()
        blocked = False  # a request did not fit: only requests holding blocks may pass it
        while self.waiting and admitted.token_budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            if blocked and not self._holds_blocks(request):
                skipped.append(self.waiting.popleft())
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and (
                not self._update_waiting_for_remote_kv(request)
            ):
                skipped.append(self.waiting.popleft())
                continue
            num_tokens_before = request.num_computed_tokens
            num_local = num_external = 0
            load_kv_async = False
            new_computed_blocks = None
            looked_up = self.kv_transfer.needs_lookup(request)
            if looked_up:
                new_computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
                if self.kv_transfer.may_load_external(request.request_id):
                    matched = self.connector.get_num_new_matched_tokens(request, num_local)
                else:
                    matched = MatchedTokens(0, False)
                if matched.num_external_tokens is None:
                    skipped.append(self.waiting.popleft())
                    continue
                num_external = self.kv_transfer.clamp_external(request, num_local, matched)
                load_kv_async = matched.load_kv_async and num_external > 0
            num_computed = num_tokens_before + num_local + num_external

            if load_kv_async:
                num_new_tokens = 0  # everything past the hit comes from the connector
            else:
                num_new_tokens = request.num_tokens - num_computed
                if 0 < self.long_prefill_token_threshold < num_new_tokens:
                    num_new_tokens = self.long_prefill_token_threshold
                if not self.enable_chunked_prefill and num_new_tokens > admitted.token_budget:
                    break
                num_new_tokens = min(num_new_tokens, admitted.token_budget)
                if num_new_tokens < 1:
                    raise RuntimeError(
                        f"request {request.request_id!r}: num_computed_tokens {num_computed} "
                        f">= num_tokens {request.num_tokens} while waiting"
                    )
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_local,
                new_computed_blocks=new_computed_blocks,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=load_kv_async,
            )
            if new_blocks is None:
                # No room: it keeps its place and tries again next step; requests behind it
                # that hold no blocks wait too (FCFS).
                blocked = True
                skipped.append(self.waiting.popleft())
                continue
            if looked_up:
                self.connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_blocks(request.request_id), num_external
                )
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_local + num_external
            self.waiting.popleft()
            self.kv_transfer.record_admission(
                request.request_id,
                num_local=num_local,
                num_external=num_external,
                load_kv_async=load_kv_async,
                num_computed=num_computed,
            )
            if load_kv_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(request)
                continue
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            admitted.new_reqs.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            admitted.token_budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))
        return admitted

    def _holds_blocks(self, request: Request) -> bool:
        """Whether a waiting request already holds blocks: its async load is parked (in flight
        or landed), or it kept progress (a settled load, a truncation after a load error)."""
        return (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            or not self.kv_transfer.needs_lookup(request)
        )

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """If ``request``'s async load landed: publish its blocks' hashes and set its progress
        (``KVTransferTracker.take_landed_load``), or restart it from scratch when a load error
        cut it below what its blocks allow. Returns whether it may run."""
        num_computed = self.kv_transfer.take_landed_load(request)
        if num_computed is None:
            return False
        request.status = RequestStatus.WAITING
        if not self.kv_transfer.can_resume_from(request.request_id, num_computed):
            self._restart_from_scratch(request)
            return True
        if num_computed > 0:
            self.kv_cache_manager.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        self.kv_transfer.skip_lookup(request.request_id)
        return True
