"""``Scheduler``: the engine loop's control half (vllm/v1/core/sched/scheduler.py, its order).

Per step, ``schedule()`` spends a token budget (``max_num_batched_tokens``) on the running
requests first, then, if nobody was preempted, on waiting requests (at most ``max_num_seqs``
running). A waiting request with no computed tokens goes through::

    KVCacheManager.get_computed_blocks            local prefix hit (APC)
    connector.get_num_new_matched_tokens          external hit; None -> skip, ask next step
    KVCacheManager.allocate_slots(..., num_external_computed_tokens,
                                  delay_cache_blocks=load_kv_async)
    connector.update_state_after_alloc
    load_kv_async ? WAITING_FOR_REMOTE_KVS : RUNNING

Token layout of such a request (DESIGN.md, "kvmanager contract")::

    | local hit (cached) | external (connector) | new tokens (scheduled) |
    0             num_local_computed     num_computed          num_tokens

``update_from_output()`` appends sampled tokens, applies stop rules, frees finished requests
(``connector.request_finished`` first; ``delay_free`` keeps the blocks until
``finished_sending``), settles async loads (``finished_recving`` -> ``cache_blocks``) and applies
the load-failure policy to ``invalid_block_ids``. The rules of external KV (load ranges, when a
landed load resumes and from which token, the failure policy, held blocks) live in
``KVTransferTracker`` (kv_transfer_tracker.py); this module keeps the queues and acts on its
answers.

Preemption is by recompute: when ``allocate_slots`` returns None for a running request, the last
running request is the victim; its blocks are freed, its progress reset and it goes to the front
of the waiting queue.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from .connector_interface import (
    KVConnectorBase,
    KVConnectorOutput,
    KVConnectorRole,
    KVLoadFailurePolicy,
    MatchedTokens,
    NoOpConnector,
)
from .kv_cache_manager import KVCacheManager
from .kv_transfer_tracker import HOLD_SENDING, KVTransferTracker, LoadSettled
from .request import Request, RequestStatus
from .scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)


class Scheduler:
    """Waiting and running queues over one ``KVCacheManager``.

    Args:
        kv_cache_manager: the node's manager (the scheduler is its only caller).
        block_size: tokens per block (the same in every KV cache group).
        max_model_len: a request stops (``"length"``) once it holds this many tokens.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget of one step.
        enable_chunked_prefill: split a prompt over steps when it exceeds the budget; when
            False a prompt that does not fit the remaining budget waits for a later step.
        long_prefill_token_threshold: when > 0, at most this many tokens of one request per
            step (vLLM's knob to let decodes through during long prefills).
        connector: the scheduler half of a KV connector; ``NoOpConnector`` by default.
        kv_load_failure_policy: ``"recompute"`` or ``"fail"`` (see ``KVLoadFailurePolicy``).

    Raises:
        ValueError: on a size < 1, an unknown policy, or chunked prefill off with a budget below
            ``max_model_len``.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        connector: KVConnectorBase | None = None,
        kv_load_failure_policy: KVLoadFailurePolicy = "recompute",
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_model_len", max_model_len),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({max_num_batched_tokens}) must "
                f"be >= max_model_len ({max_model_len}), or a long prompt never fits a step"
            )
        if kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure_policy must be 'recompute' or 'fail', got "
                f"{kv_load_failure_policy!r}"
            )
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.connector = connector or NoOpConnector(KVConnectorRole.SCHEDULER)
        self.kv_load_failure_policy = kv_load_failure_policy

        # Every request the scheduler knows, including finished ones whose blocks are held.
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(); tells the runner to drop rows.
        self.finished_req_ids: set[str] = set()
        # Loads, load errors and held blocks: the KV-transfer rules.
        self.kv_transfer = KVTransferTracker(
            kv_cache_manager, block_size=block_size, kv_load_failure_policy=kv_load_failure_policy
        )
        # Requests moved back to waiting outside schedule(): the runner drops their rows next step.
        self._pending_preempted_req_ids: set[str] = set()
        self._prompt_logprobs: dict[str, list[float | None]] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue operations
    def add_request(self, request: Request) -> None:
        """Queue ``request`` as waiting. Raises ValueError on a duplicate id or a request that
        is not ``WAITING``."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.status != RequestStatus.WAITING:
            raise ValueError(
                f"request {request.request_id!r} is {request.status.name}, not WAITING"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside the loop (abort). Unknown or already finished ids are
        ignored (an abort may race a completion). Returns one output per request finished.

        Raises:
            ValueError: if ``finished_status`` is not a finished status.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            self._remove_from_queues(request)
            request.status = finished_status
            outputs.append(self._finish_output(request, []))
        return outputs

    def _remove_from_queues(self, request: Request) -> None:
        """Take ``request`` out of ``running`` or ``waiting`` (ValueError if in neither)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests (finished ones holding blocks do not count)."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """``get_num_unfinished_requests() > 0``."""
        return bool(self.waiting or self.running)

    @property
    def held_req_ids(self) -> set[str]:
        """Finished requests whose blocks are still referenced (delayed free, settling load)."""
        return self.kv_transfer.held_req_ids

    def is_empty(self) -> bool:
        """True when no request is queued, running or holding blocks (tests' leak check), and
        the connector has no orders waiting for the next step."""
        return not (
            self.requests
            or self.waiting
            or self.running
            or self.kv_transfer.num_held_reqs
            or self.connector.has_pending_orders()
        )

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step (mutates queues, request status and ``num_computed_tokens``, and the
        KV cache manager's allocations). Never raises for lack of room: a request that does not
        fit waits, a running request that does not fit preempts another. RuntimeError if a
        waiting request has nothing left to compute (corrupt progress)."""
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[Request] = []
        cached_reqs: list[Request] = []
        new_block_ids: dict[str, tuple[list[int], ...] | None] = {}
        preempted_req_ids: set[str] = set()
        rows_to_drop, self._pending_preempted_req_ids = self._pending_preempted_req_ids, set()

        # (1) Running requests, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
            if 0 < self.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = self.long_prefill_token_threshold
            num_new_tokens = min(num_new_tokens, token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            new_blocks = None
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            cached_reqs.append(request)
            ids = new_blocks.get_block_ids()
            new_block_ids[request.request_id] = ids if any(ids) else None
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # (2) Waiting requests, only if nobody was preempted (vLLM: no room, so no admission).
        skipped: deque[Request] = deque()
        while not preempted_req_ids and self.waiting and token_budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
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
                if not self.enable_chunked_prefill and num_new_tokens > token_budget:
                    break
                num_new_tokens = min(num_new_tokens, token_budget)
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
                break  # no room: keep FCFS order, try again next step
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
            new_reqs.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))

        # (3) The plan, then the connector's metadata for it.
        output = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(r, num_scheduled_tokens) for r in new_reqs],
            scheduled_cached_reqs=self._cached_request_data(
                cached_reqs, num_scheduled_tokens, new_block_ids
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_req_ids | rows_to_drop,
        )
        output.kv_connector_metadata = self.connector.build_connector_meta(output)

        # (4) Advance progress now (vLLM's _update_after_schedule): the next schedule() sees it.
        for req_id, num_tokens in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self.finished_req_ids = set()
        return output

    def _new_request_data(self, request: Request, num_scheduled: dict[str, int]) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            all_token_ids=list(request.all_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    @staticmethod
    def _cached_request_data(
        requests: list[Request],
        num_scheduled: dict[str, int],
        new_block_ids: dict[str, tuple[list[int], ...] | None],
    ) -> CachedRequestData:
        data = CachedRequestData()
        for request in requests:
            start = request.num_computed_tokens
            data.req_ids.append(request.request_id)
            data.new_token_ids.append(
                request.all_token_ids[start : start + num_scheduled[request.request_id]]
            )
            data.new_block_ids.append(new_block_ids[request.request_id])
            data.num_computed_tokens.append(start)
        return data

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the blocks, reset progress, front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._prompt_logprobs.pop(request.request_id, None)  # recomputed from position 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

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

    def _restart_from_scratch(self, request: Request) -> None:
        """Free every block and recompute from position 0 (local prefix hits allowed, no
        connector lookup). A running request goes back to the front of the waiting queue."""
        req_id = request.request_id
        logger.warning("request %s: recomputing from scratch after a load failure", req_id)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        self.kv_transfer.mark_local_only(req_id)
        self._prompt_logprobs.pop(req_id, None)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)
            self._pending_preempted_req_ids.add(req_id)

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results (mutates requests, queues and allocations). Returns the news
        of every request that got a token or finished this step."""
        outputs: list[EngineCoreOutput] = []
        kv_output = model_runner_output.kv_connector_output
        recomputed: set[str] = set()
        if kv_output is not None and kv_output.invalid_block_ids:
            recomputed = self._handle_invalid_blocks(kv_output.invalid_block_ids, outputs)

        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in recomputed:
                continue  # aborted during the step, or its inputs were bad
            chunk = model_runner_output.prompt_logprobs_dict.get(req_id)
            if chunk is not None and request.num_output_tokens == 0:  # not after a resume
                self._add_prompt_logprobs(request, chunk)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that does not reach the end: no token yet
            index = model_runner_output.req_id_to_index[req_id]
            new_token_ids: list[int] = []
            for token_id in model_runner_output.sampled_token_ids[index]:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    break
            if request.is_finished():
                self.running.remove(request)
                outputs.append(self._finish_output(request, new_token_ids))
            else:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        prompt_logprobs=self._prompt_logprobs.pop(req_id, None),
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                    )
                )

        self.kv_transfer.end_step()
        if kv_output is not None:
            self._update_from_kv_xfer_finished(kv_output, outputs)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        """vLLM's order: length cap, then EOS (unless ignore_eos), then stop token ids."""
        params = request.sampling_params
        last = request.all_token_ids[-1]
        if request.num_output_tokens >= request.max_tokens or (
            request.num_tokens >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        elif not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
        else:
            return False
        return True

    def _add_prompt_logprobs(self, request: Request, chunk: list[float]) -> None:
        acc = self._prompt_logprobs.setdefault(request.request_id, [None])
        acc.extend(chunk)

    def _finish_output(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        """Free (or hold) a request that just got a finished status; its output."""
        kv_transfer_params = self._free_request(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            kv_transfer_params=kv_transfer_params,
            prompt_logprobs=self._prompt_logprobs.pop(request.request_id, None),
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _free_request(self, request: Request) -> dict | None:
        """``request_finished`` first, then free the blocks unless something still uses them:
        the connector's delayed free, or an async load still in flight."""
        req_id = request.request_id
        self.finished_req_ids.add(req_id)
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        delay_free, kv_transfer_params = self.connector.request_finished(request, block_ids)
        if not self.kv_transfer.hold_finished(req_id, delay_free=delay_free):
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.kv_transfer.forget_blocks(request.request_id)
        self._prompt_logprobs.pop(request.request_id, None)
        del self.requests[request.request_id]

    def _update_from_kv_xfer_finished(
        self, kv_output: KVConnectorOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        """Settle loads (before sends: a request may report both in one step), then sends."""
        self.connector.update_connector_output(kv_output)
        for req_id in sorted(kv_output.finished_recving or ()):
            request = self.requests.get(req_id)
            settled = self.kv_transfer.settle_load(req_id, request)
            if settled is LoadSettled.FREE:
                self._free_blocks(request)
            elif settled is LoadSettled.FAILED:
                self.waiting.remove(request)
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(self._finish_output(request, []))
        for req_id in sorted(kv_output.finished_sending or ()):
            if self.kv_transfer.release_hold(req_id, HOLD_SENDING):
                self._free_blocks(self.requests[req_id])

    def _handle_invalid_blocks(
        self, invalid_block_ids: set[int], outputs: list[EngineCoreOutput]
    ) -> set[str]:
        """Apply the load-failure policy to every sync load into a bad block (async ones are
        settled by ``KVTransferTracker``). This step's result for them is void:
        ``"recompute"`` truncates ``num_computed_tokens`` to the first bad block (or restarts
        from scratch when the blocks do not allow it), ``"fail"`` finishes the request with
        ``FINISHED_ERROR``. Returns the ids whose sampled token must be dropped."""
        void: set[str] = set()
        for req_id, first_bad in self.kv_transfer.take_failed_sync_loads(invalid_block_ids):
            void.add(req_id)
            request = self.requests[req_id]
            if request.is_finished():
                continue
            if self.kv_load_failure_policy == "recompute":
                num_computed = min(request.num_computed_tokens, first_bad)
                if self.kv_transfer.can_resume_from(req_id, num_computed):
                    request.num_computed_tokens = num_computed
                else:
                    self._restart_from_scratch(request)
            else:
                self._remove_from_queues(request)
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(self._finish_output(request, []))
        return void

    # ------------------------------------------------------------------ stats
    def make_stats(self) -> dict[str, float | int]:
        """Queue lengths, preemptions, KV usage and prefix cache counters (a plain dict)."""
        stats: dict[str, float | int] = {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_held_reqs": self.kv_transfer.num_held_reqs,
            "num_preemptions": self.num_preemptions,
            "kv_cache_usage": self.kv_cache_manager.usage,
        }
        return stats

    def take_events(self) -> list:
        """KV cache events since the last call: the manager's (BlockStored, BlockRemoved,
        AllBlocksCleared; empty unless events are enabled) then the connector's (vLLM's order
        when the scheduler publishes events)."""
        return [*self.kv_cache_manager.take_events(), *self.connector.take_events()]

    def shutdown(self) -> None:
        """Shut the connector's scheduler half down."""
        self.connector.shutdown()
