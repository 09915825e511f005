"""``Scheduler``: the engine loop's control half (vllm/v1/core/sched/scheduler.py, its order).

Per step, ``schedule()`` spends a token budget (``max_num_batched_tokens``) on the running
requests first, then, if nobody was preempted, on waiting requests (at most ``max_num_seqs``
running), then asks the connector for the step's metadata. ``update_from_output()`` applies the
step's results. The class is assembled from one module per role:

    scheduler_queues.py     SchedulerQueues     waiting / running queues, preemption, restarts
    scheduler_admission.py  SchedulerAdmission  waiting requests through the connector hooks
                                                (get_num_new_matched_tokens, allocate_slots,
                                                update_state_after_alloc), settled loads
    scheduler_update.py     SchedulerUpdate     update_from_output: tokens, stop rules, frees,
                                                finished transfers, the load-failure policy
    scheduler.py            Scheduler           the knobs and state, schedule(), stats

The rules of external KV (load ranges, when a landed load resumes and from which token, the
failure policy, held blocks) live in ``KVTransferTracker`` (kv_transfer_tracker.py); the
scheduler keeps the queues and acts on its answers.

Preemption is by recompute: when ``allocate_slots`` returns None for a running request, the last
running request is the victim; its blocks are freed, its progress reset and it goes to the front
of the waiting queue.

Owning thread: the engine thread; no method is safe to call from another.
"""

from __future__ import annotations

from collections import deque

from .connector_interface import (
    KVConnectorBase,
    KVConnectorRole,
    KVLoadFailurePolicy,
    NoOpConnector,
)
from .kv_cache_manager import KVCacheManager
from .kv_transfer_tracker import KVTransferTracker
from .request import Request
from .scheduler_admission import SchedulerAdmission
from .scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from .scheduler_update import SchedulerUpdate

__all__ = ["Scheduler"]


class Scheduler(SchedulerAdmission, SchedulerUpdate):
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

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step (mutates queues, request status and ``num_computed_tokens``, and the
        KV cache manager's allocations). Never raises for lack of room: a request that does not
        fit waits, a running request that does not fit preempts another. RuntimeError if a
        waiting request has nothing left to compute (corrupt progress)."""
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
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
        new_reqs: list[Request] = []
        if not preempted_req_ids:
            new_reqs = self._schedule_waiting(token_budget, num_scheduled_tokens).new_reqs

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
