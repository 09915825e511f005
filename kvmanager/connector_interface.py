"""The KV connector interface the scheduler and model runner call, and the no-op connector.

``kvmanager`` declares the interface; ``kvbridge.connector`` implements it (docs/architecture.md,
"Layers": the scheduler needs a connector without importing one). Method names, arguments and
call order follow vLLM's ``KVConnectorBase_V1`` (vllm/distributed/kv_transfer/kv_connector/v1/
base.py). One class has two halves; an instance plays one of them, chosen by ``KVConnectorRole``:

Scheduler side, called by ``Scheduler`` in this order within a step::

    schedule():  for a waiting request with num_computed_tokens == 0
                     get_num_new_matched_tokens(request, num_local_computed_tokens)
                     (KVCacheManager.allocate_slots(..., delay_cache_blocks=load_kv_async))
                     update_state_after_alloc(request, blocks, num_external_tokens)
                 build_connector_meta(scheduler_output)        once per step, always
    update_from_output():
                 update_connector_output(kv_connector_output)  once per step, always
                 request_finished(request, block_ids)          before a finished request's blocks
                                                                are freed
    take_events()                                              any time

Worker side, called by ``ModelRunner.execute_model`` in this order within a step::

    bind_connector_metadata(metadata)
    start_load_kv(forward_context)
    -- model forward: wait_for_layer_load(layer) / save_kv_layer(layer, ...) per layer --
    wait_for_save()
    get_finished(finished_req_ids)  and  get_block_ids_with_load_errors()
    build_connector_worker_meta()
    clear_connector_metadata()

``register_kv_caches`` is called once after the KV tensors are allocated, then the worker's
``get_handshake_metadata`` goes to the scheduler's ``set_xfer_handshake_metadata``; ``shutdown``
once at the end. A request id reported in ``finished_sending`` / ``finished_recving`` is
reported once.

Lifetime rules the scheduler relies on (docs/architecture.md, "Aborts racing completions"):

- A request whose async load is in flight when it finishes (an abort) is still reported in
  ``finished_recving`` once the load settles (landed, failed, cancelled or timed out); until then
  the scheduler keeps its blocks referenced, so no other request can be handed them.
- ``request_finished`` returning ``delay_free=True`` keeps the blocks until the request id comes
  back in ``finished_sending``; the connector owns any lease that bounds that wait.
- An id the scheduler no longer holds (an abort raced a completion) is ignored, never freed twice.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

# The two per-step connector messages live with the step's other messages; re-exported here.
from .scheduler_output import KVConnectorMetadata, KVConnectorOutput, SchedulerOutput

if TYPE_CHECKING:
    from .request import Request

__all__ = [
    "ForwardContext",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVLoadFailurePolicy",
    "KVRole",
    "MatchedTokens",
    "NoOpConnector",
    "RequestFinishedResult",
]

KVLoadFailurePolicy = Literal["recompute", "fail"]
"""What the scheduler does with a request whose external KV failed to load (vLLM's
``kv_load_failure_policy``): ``"recompute"`` truncates ``num_computed_tokens`` to the first bad
block and reschedules, ``"fail"`` finishes it with ``FINISHED_ERROR``."""


class KVConnectorRole(enum.Enum):
    """Which half an instance plays (vLLM ``KVConnectorRole``)."""

    SCHEDULER = 0
    WORKER = 1


class KVRole(str, enum.Enum):  # noqa: UP042 (StrEnum changes str() of members)
    """The node's part in KV transfer (vLLM ``KVTransferConfig.kv_role`` values)."""

    PRODUCER = "kv_producer"  # computes KV that other nodes pull (a prefill node)
    CONSUMER = "kv_consumer"  # pulls KV computed elsewhere (a decode node)
    BOTH = "kv_both"

    @property
    def is_producer(self) -> bool:
        return self in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self in (KVRole.CONSUMER, KVRole.BOTH)


class MatchedTokens(NamedTuple):
    """Result of ``get_num_new_matched_tokens``.

    ``num_external_tokens`` is None when the connector cannot tell yet (ask again next step);
    ``load_kv_async`` says the load completes over later steps (the request waits in
    ``WAITING_FOR_REMOTE_KVS``) rather than inside the next forward.
    """

    num_external_tokens: int | None
    load_kv_async: bool


class RequestFinishedResult(NamedTuple):
    """Result of ``request_finished``: ``delay_free`` keeps the request's blocks referenced until
    the connector reports it in ``finished_sending``; ``kv_transfer_params`` go back to the
    client (for a prefill node: what the decode node needs to pull)."""

    delay_free: bool
    kv_transfer_params: dict[str, Any] | None


@dataclass(slots=True)
class ForwardContext:
    """What ``start_load_kv`` sees of the step (a slim vLLM ``ForwardContext``).

    Attributes:
        kv_caches: layer name -> that layer's KV tensor (layout: ``kernels/layout.py``).
        attn_metadata: per KV cache group, the step's attention metadata (or None when the step
            has no forward, e.g. only connector work).
        layer_name_to_group: layer name -> KV cache group id.
    """

    kv_caches: Mapping[str, torch.Tensor]
    attn_metadata: Sequence[Any] | None
    layer_name_to_group: Mapping[str, int]


class KVConnectorBase(ABC):
    """Both halves of a KV connector (vLLM ``KVConnectorBase_V1``); see the module docstring for
    the call order. Methods of the half an instance does not play are never called on it.

    Block ids are per KV cache group everywhere (``tuple[list[int], ...]`` in group order), as
    the hybrid allocator hands them out. Nothing here raises for a network failure: failures come
    back as ``invalid_block_ids`` / ``finished_recving`` and the scheduler's policy applies.
    """

    def __init__(self, role: KVConnectorRole, kv_role: KVRole = KVRole.BOTH) -> None:
        self.role = role
        self.kv_role = kv_role
        self._connector_metadata: KVConnectorMetadata | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> MatchedTokens:
        """Tokens beyond the local prefix hit that the connector can supply.

        Args:
            request: a waiting request with no computed tokens yet.
            num_computed_tokens: tokens hit in the local prefix cache (block aligned).

        Returns:
            ``(n, load_kv_async)``; ``n`` external tokens start at position
            ``num_computed_tokens``; ``(None, False)`` means "not known yet, ask next step". Must
            not mutate the request.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        """Called right after ``allocate_slots`` succeeded for a request that went through
        ``get_num_new_matched_tokens`` (also when it returned 0).

        Args:
            blocks: the request's ``KVCacheBlocks`` (local hit followed by the new blocks, per
                group); ``blocks.get_block_ids()`` gives ids per group.
            num_external_tokens: the count accepted from ``get_num_new_matched_tokens``; the
                external tokens occupy positions ``[local_hit, local_hit + n)``.
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Build this step's metadata for the worker half and reset per-step state (called once
        per ``schedule``, also when nothing was scheduled)."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027
        """Learn what the worker half reported this step (default: nothing to learn)."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> RequestFinishedResult:
        """Called once when ``request`` finishes (any reason, aborts included), before its
        blocks are freed. ``block_ids`` are its blocks per group."""

    def take_events(self) -> Iterable[Any]:
        """KV events produced by the connector since the last call (default: none)."""
        return ()

    def validate_kv_transfer_params(  # noqa: B027 - optional hook, default accepts
        self, request_id: str, kv_transfer_params: Mapping[str, Any],
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Check request ``request_id``'s ``kv_transfer_params`` at admission
        (``Engine.add_request``), before anything is queued; they came over the network.
        ``num_prompt_tokens`` is the request's prompt length (None where the caller does not
        know it), for checks of token counts against the prompt.

        Raises:
            ValueError: (a subclass naming the field) for params this connector cannot honour.
                Default: accept everything.
        """

    def on_new_request(self, request: Request) -> None:  # noqa: B027
        """Scheduler side, the engine thread: ``request`` was queued (``Scheduler.add_request``,
        after ``validate_kv_transfer_params`` accepted it; vLLM's hook of the same name).
        Mutates nothing of the request. Default: nothing."""

    def has_pending_orders(self) -> bool:
        """Scheduler side: True when the next ``build_connector_meta`` carries work for the
        worker half (a release notice, a lease grant), so the engine loop must step to deliver
        it even with no request left (``Scheduler.is_empty`` counts it). Default: False."""
        return False

    def on_request_rejected(self, kv_transfer_params: Any, reason: str) -> None:  # noqa: B027
        """A request carrying ``kv_transfer_params`` was refused at admission: release whatever
        a peer holds for it (e.g. a prefill node's lease). Default: nothing to release."""

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Learn the KV tensors (layer name -> tensor) once after allocation."""
        self._kv_caches = dict(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Hold the scheduler's metadata for the coming forward."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop the metadata after the forward."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """The bound metadata. Raises RuntimeError when called outside a bound step."""
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound: call bind_connector_metadata first")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        """Start (or, for a synchronous connector, do) the loads listed in the metadata."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV for this step has landed (layer-wise pipelining)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Start saving ``layer_name``'s KV after its attention ran (layer-wise pipelining)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until the saves started this step are done (before the KV tensors change)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` since the last call; ``finished_req_ids`` are
        the requests the scheduler finished since the last step (default: nothing finishes)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose load failed since the last call (default: none)."""
        return set()

    def build_connector_worker_meta(self) -> Any:
        """The worker half's report for this step, carried to the scheduler half's
        ``update_connector_output`` in ``KVConnectorOutput.kv_connector_worker_meta`` (vLLM
        ``build_connector_worker_meta``; default: nothing to report). Called once per step
        after ``get_finished``."""
        return None

    def get_handshake_metadata(self) -> Any:
        """Worker side, once after ``register_kv_caches``: what the scheduler half must know of
        this worker (its transport's address and identity); None when there is nothing."""
        return None

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, Any]) -> None:  # noqa: B027
        """Scheduler side, once before the first step: the workers' handshake metadata by
        worker rank (vLLM ``set_xfer_handshake_metadata``). Default: nothing to learn."""

    def shutdown(self) -> None:  # noqa: B027
        """Release connections and threads (default: nothing to release)."""


class NoOpConnector(KVConnectorBase):
    """A connector that never has external tokens, never delays a free and moves nothing.

    It is the default of ``Scheduler`` and ``ModelRunner``; with it they behave exactly as a node
    without KV transfer.
    """

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> MatchedTokens:
        return MatchedTokens(0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> RequestFinishedResult:
        return RequestFinishedResult(False, None)

    def start_load_kv(self, forward_context: ForwardContext) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
