"""``Engine``: one node that takes text or token prompts and generates tokens (vLLM's
``LLMEngine`` + ``EngineCore`` in one process, synchronous).

One ``step()``::

    scheduler.schedule() -> runner.execute_model() -> scheduler.update_from_output()

The engine owns the tokenizer, validates every request at the door (a bad request raises
``ValueError`` from ``add_request`` and nothing else changes, so the engine keeps serving the
others) and turns ``EngineCoreOutput``s into ``RequestOutput``s with cumulative tokens and text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.kernels.model import ByteTokenizer, ModelConfig, ReferenceDecoder

from .connector_interface import KVConnectorBase, KVConnectorRole, KVLoadFailurePolicy
from .kv_cache_manager import KVCacheManager
from .kv_cache_spec import KVCacheConfig
from .model_runner import ModelRunner, make_kv_cache_config
from .request import Request, RequestStatus, SamplingParams
from .scheduler import Scheduler
from .scheduler_output import EngineCoreOutput

__all__ = ["Engine", "EngineConfig", "RequestOutput"]

ConnectorFactory = Callable[[KVConnectorRole, KVCacheConfig], KVConnectorBase]
"""Builds one half of a connector for the engine's ``KVCacheConfig``: called once with SCHEDULER
and once with WORKER (the halves may share nothing)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Node settings (vLLM's cache, scheduler and KV-transfer configs, flattened).

    ``num_blocks`` includes the null block 0. The pool must hold at least one request of
    ``max_model_len`` tokens in every group (checked by ``Engine``), so preemption always ends.
    """

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    hash_fn: str = "sha256_cbor"
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    enable_kv_cache_events: bool = False
    use_triton: bool | None = None
    device: str = "cpu"


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step.

    Attributes:
        request_id: the id given to ``add_request``.
        prompt_token_ids: the prompt.
        new_token_ids: tokens produced by this step.
        token_ids: every generated token so far.
        text: ``token_ids`` decoded by the byte tokenizer.
        finished, finish_reason: ``finish_reason`` in "stop", "length", "abort", "error".
        kv_transfer_params: from the connector's ``request_finished`` (finished requests).
        prompt_logprobs: ``[None, log p(prompt[1] | prompt[:1]), ...]`` when asked for.
        num_cached_tokens: prompt tokens served from a cache at admission.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[float | None] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class _Tracked:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None


class Engine:
    """A single node: ``KVCacheManager`` + ``Scheduler`` + ``ModelRunner`` over one model.

    Args:
        model: a ``ReferenceDecoder`` (moved to ``config.device`` in place), or a ``ModelConfig``
            to build one with seeded weights.
        config: node settings.
        connector_factory: builds the scheduler and worker halves of a KV connector; None for no
            KV transfer (``NoOpConnector``).
        tokenizer: defaults to ``ByteTokenizer``.

    Raises:
        ValueError: on bad settings, or a pool too small for one ``max_model_len`` request.
            Whatever a connector refuses at start propagates as it is raised; both connector
            halves are shut down first (nothing they started keeps running).
    """

    def __init__(
        self,
        model: ReferenceDecoder | ModelConfig,
        config: EngineConfig,
        *,
        connector_factory: ConnectorFactory | None = None,
        tokenizer: ByteTokenizer | None = None,
    ) -> None:
        if isinstance(model, ModelConfig):
            model = ReferenceDecoder(model)
        self.model = model.to(config.device)  # nn.Module.to: in place, a no-op when already there
        self.config = config
        self.tokenizer = tokenizer or ByteTokenizer()
        self.kv_cache_config = make_kv_cache_config(
            model.config, num_blocks=config.num_blocks, block_size=config.block_size
        )
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        blocks_per_request = num_groups * -(-config.max_model_len // config.block_size)
        if blocks_per_request > config.num_blocks - 1:
            raise ValueError(
                f"num_blocks={config.num_blocks} (block 0 is the null block) cannot hold one "
                f"request of max_model_len={config.max_model_len}: it needs {blocks_per_request} "
                f"blocks over {num_groups} group(s)"
            )
        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_config,
            config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            hash_fn=config.hash_fn,
        )
        # The connector starts in steps (the worker half's transport when the runner registers
        # the KV caches, then the scheduler half's registrations on the handshake); a step that
        # refuses shuts down both halves, the last built first, so nothing is left running.
        with contextlib.ExitStack() as started:
            scheduler_connector = worker_connector = None
            if connector_factory is not None:
                scheduler_connector = connector_factory(
                    KVConnectorRole.SCHEDULER, self.kv_cache_config
                )
                started.callback(scheduler_connector.shutdown)
                worker_connector = connector_factory(KVConnectorRole.WORKER, self.kv_cache_config)
                started.callback(worker_connector.shutdown)
            self.scheduler = Scheduler(
                self.kv_cache_manager,
                block_size=config.block_size,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                connector=scheduler_connector,
                kv_load_failure_policy=config.kv_load_failure_policy,
            )
            self.runner = ModelRunner(
                model,
                self.kv_cache_config,
                max_num_reqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                connector=worker_connector,
                device=config.device,
                use_triton=config.use_triton,
            )
            if scheduler_connector is not None and worker_connector is not None:
                handshake = worker_connector.get_handshake_metadata()
                if handshake is not None:
                    scheduler_connector.set_xfer_handshake_metadata({0: handshake})
            started.pop_all()  # started: ``shutdown`` closes the halves from now on
        self._block_hasher = self.kv_cache_manager.request_block_hasher
        self._tracked: dict[str, _Tracked] = {}
        self._next_auto_id = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Validate and queue one request. A text prompt is byte-tokenized with BOS.

        Raises:
            ValueError: duplicate id, empty prompt, a prompt longer than ``max_model_len``, a
                token id outside ``[0, vocab_size)``, or ``max_tokens < 1`` (from
                ``SamplingParams``), or ``kv_transfer_params`` the connector cannot honour (its
                own ``ValueError`` subclass, naming the field). Nothing is queued then, and a
                peer holding KV for the refused request is told to release it.
        """
        if request_id in self._tracked or request_id in self.scheduler.requests:
            # Not a rejection of this request's KV: the live request with this id may still
            # need what a peer holds for it, so no release notice.
            raise ValueError(f"request id {request_id!r} is already in use")
        connector = self.scheduler.connector
        try:
            prompt_token_ids = self._check_request(request_id, prompt, kv_transfer_params)
            if kv_transfer_params is not None:
                connector.validate_kv_transfer_params(
                    request_id, kv_transfer_params, num_prompt_tokens=len(prompt_token_ids)
                )
        except ValueError as exc:
            if kv_transfer_params:
                # A refused request may hold KV on a peer (a prefill node's lease): release it.
                connector.on_request_rejected(kv_transfer_params, str(exc))
            raise
        request = Request(
            request_id,
            prompt_token_ids,
            sampling_params or SamplingParams(),
            block_hasher=self._block_hasher,
            cache_salt=cache_salt,
            lora_name=lora_name,
            kv_transfer_params=kv_transfer_params,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(prompt_token_ids=prompt_token_ids)
        return request

    def _check_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        kv_transfer_params: dict[str, Any] | None,
    ) -> list[int]:
        """The prompt's token ids, or ValueError for a request the engine cannot take."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"request {request_id!r}: empty prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_token_ids = [int(t) for t in prompt]
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if len(prompt_token_ids) > self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens is longer "
                f"than max_model_len={self.config.max_model_len}"
            )
        vocab_size = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token id {bad[0]} is outside [0, {vocab_size})"
            )
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ValueError(f"request {request_id!r}: kv_transfer_params must be a dict")
        return prompt_token_ids

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored). Blocks still used by a
        transfer stay held until it settles. Returns the aborted requests' final outputs."""
        outputs = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return self._to_request_outputs(outputs)

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting or running (held blocks do not count)."""
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, apply the results. Returns the requests that got a token or
        finished this step."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self._to_request_outputs(outputs)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 16,
        *,
        sampling_params: SamplingParams | None = None,
        max_steps: int = 100_000,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; final outputs in prompt order.

        Raises:
            ValueError: as ``add_request`` (before anything is queued).
            RuntimeError: if the requests are not done within ``max_steps`` steps.
        """
        params = sampling_params or SamplingParams(max_tokens=max_tokens)
        request_ids = []
        for prompt in prompts:
            request_id = f"gen-{self._next_auto_id}"
            self._next_auto_id += 1
            self.add_request(request_id, prompt, params)
            request_ids.append(request_id)
        pending = set(request_ids)
        finals: dict[str, RequestOutput] = {}
        for _ in range(max_steps):
            if not pending:
                break
            for output in self.step():
                if output.finished and output.request_id in pending:
                    finals[output.request_id] = output
                    pending.discard(output.request_id)
        if pending:
            raise RuntimeError(f"{len(pending)} requests unfinished after {max_steps} steps")
        return [finals[request_id] for request_id in request_ids]

    def _to_request_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        results = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            tracked.token_ids.extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                tracked.prompt_logprobs = out.prompt_logprobs
            results.append(
                RequestOutput(
                    request_id=out.request_id,
                    prompt_token_ids=tracked.prompt_token_ids,
                    new_token_ids=list(out.new_token_ids),
                    token_ids=list(tracked.token_ids),
                    text=self.tokenizer.decode(tracked.token_ids),
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    kv_transfer_params=out.kv_transfer_params,
                    prompt_logprobs=tracked.prompt_logprobs,
                    num_cached_tokens=out.num_cached_tokens,
                )
            )
            if out.finished:
                del self._tracked[out.request_id]
        return results

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        """``KVCacheManager.check_integrity`` plus: with no request left, every block is free.

        Raises:
            RuntimeError: naming the numbers that disagree.
        """
        self.kv_cache_manager.check_integrity()
        if self.scheduler.is_empty():
            num_free = self.kv_cache_manager.get_num_free_blocks()
            if num_free != self.config.num_blocks - 1:
                raise RuntimeError(
                    f"no request is left but {num_free} of {self.config.num_blocks - 1} usable "
                    "blocks are free"
                )

    def shutdown(self) -> None:
        """Shut both connector halves down."""
        self.scheduler.shutdown()
        self.runner.shutdown()
