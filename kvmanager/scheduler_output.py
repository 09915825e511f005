"""What the scheduler hands the model runner, and what comes back (vllm/v1/core/sched/output.py,
vllm/v1/outputs.py, vllm/v1/engine/__init__.py).

One step::

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute_model() -> ModelRunnerOutput
        -> Scheduler.update_from_output() -> list[EngineCoreOutput]

The runner keeps persistent per-request state (its block table rows); a ``SchedulerOutput``
therefore carries full block lists only for requests the runner does not hold
(``scheduled_new_reqs``: new, or resumed after preemption) and block-id deltas for the rest
(``scheduled_cached_reqs``). Every scheduled request carries the token ids it feeds this step, so
the runner never guesses tokens the scheduler may have discarded (seed 000, "为什么 Manager 不直接把
完整表发给 Kernel").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .request import SamplingParams

__all__ = [
    "CachedRequestData",
    "EngineCoreOutput",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
]


@dataclass
class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step; connectors subclass it."""


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports back for one step (vLLM ``KVConnectorOutput``).

    Attributes:
        finished_sending: ids of requests whose blocks were fully read by a peer (their
            ``delay_free`` blocks may now be freed), or None.
        finished_recving: ids of requests whose async load settled (landed, failed or cancelled),
            or None.
        invalid_block_ids: local block ids whose load failed; the scheduler applies the load
            failure policy to every request that was loading into them.
        kv_connector_worker_meta: the worker half's own per-step report to its scheduler half
            (``build_connector_worker_meta``; vLLM's ``KVConnectorWorkerMetadata``), or None.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_worker_meta: Any = None

    def is_empty(self) -> bool:
        """True when nothing finished and no block failed (the runner may skip reporting)."""
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.kv_connector_worker_meta is not None
        )


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet (first scheduling, or resumed after preemption).

    Attributes:
        req_id: request id.
        prompt_token_ids: the prompt (the runner needs it for prompt logprobs).
        all_token_ids: prompt then outputs so far (a copy); this step's inputs are
            ``all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens]``.
        sampling_params: the request's sampling options.
        block_ids: the request's full block list per KV cache group (null block 0 where a
            sliding window skipped a block).
        num_computed_tokens: tokens whose KV is already in ``block_ids`` (prefix hit or loaded).
    """

    req_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, as parallel lists (one entry per request).

    Attributes:
        req_ids: request ids.
        new_token_ids: the token ids fed this step, positions
            ``[num_computed_tokens[i], num_computed_tokens[i] + num_scheduled_tokens)``.
        new_block_ids: blocks appended since the last step, per group, or None when none.
        num_computed_tokens: progress before this step.
    """

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled_new_reqs: requests with full state (see ``NewRequestData``).
        scheduled_cached_reqs: requests with deltas (see ``CachedRequestData``).
        num_scheduled_tokens: request id -> tokens computed this step (>= 1 each).
        total_num_scheduled_tokens: their sum (<= ``max_num_batched_tokens``).
        finished_req_ids: requests finished since the last step; the runner drops their rows.
        preempted_req_ids: requests preempted (or restarted after a load failure) since the last
            step; the runner drops their rows first: they come back as new requests, possibly in
            this same output.
        kv_connector_metadata: ``build_connector_meta``'s result for this step.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    kv_connector_metadata: KVConnectorMetadata | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one ``execute_model`` produced.

    Attributes:
        req_ids: scheduled requests, in batch order.
        req_id_to_index: request id -> index into ``req_ids`` / ``sampled_token_ids``.
        sampled_token_ids: per request, the tokens sampled at its last scheduled position (one
            token for greedy decoding; the scheduler drops it for a prefill chunk that does not
            reach the end of the known tokens).
        prompt_logprobs_dict: request id -> ``log p(prompt[t + 1] | prompt[: t + 1])`` for the
            prompt positions ``t`` computed this step (float32 values), only for requests that
            asked for prompt logprobs.
        kv_connector_output: the worker connector's report, or None.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    prompt_logprobs_dict: dict[str, list[float]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step (``Scheduler.update_from_output``).

    Attributes:
        request_id: request id.
        new_token_ids: tokens appended this step (possibly empty for a finish without a token).
        finish_reason: "stop", "length", "abort", "error", or None while running.
        stop_reason: the stop token id that ended the request, else None.
        kv_transfer_params: what ``request_finished`` returned (finished requests only).
        prompt_logprobs: the whole prompt's logprobs (first entry None), on the first output of
            a request that asked for them, else None.
        num_cached_tokens: prompt tokens served from a cache (local or external) at admission.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[float | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
