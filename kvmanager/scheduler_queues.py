"""The scheduler's request queues: ``waiting``, ``running`` and every known request.

``SchedulerQueues`` is the base of ``Scheduler`` (scheduler.py). It moves requests between the
queues and keeps the counts the engine loop asks for: adding a request, taking one out,
preemption by recompute (free the victim's blocks, reset its progress, front of the waiting
queue) and the restart from scratch after a load failure. It holds no state of its own: every
attribute it lists below is set by ``Scheduler.__init__``.

Owning thread: the engine thread (the one that calls ``schedule`` and ``update_from_output``);
nothing here is safe to call from another thread.
"""

from __future__ import annotations

import logging
from collections import deque

from .connector_interface import KVConnectorBase
from .kv_cache_manager import KVCacheManager
from .kv_transfer_tracker import KVTransferTracker
from .request import Request, RequestStatus

__all__ = ["SchedulerQueues"]

logger = logging.getLogger(__name__)


class SchedulerQueues:
    """Queue moves of ``Scheduler``; the attributes are set by ``Scheduler.__init__``.

    Attributes:
        kv_cache_manager: the node's manager (the scheduler is its only caller).
        connector: the scheduler half of the KV connector.
        kv_transfer: the KV-transfer rules (loads, load errors, held blocks).
        requests: every request the scheduler knows, finished ones whose blocks are held
            included.
        waiting: admission order; preempted and restarted requests go to the front.
        running: scheduling order; the last one is the preemption victim.
        finished_req_ids: finished since the last ``schedule()`` (the runner drops their rows).
        num_preemptions: preemptions since start (stats).
    """

    kv_cache_manager: KVCacheManager
    connector: KVConnectorBase
    kv_transfer: KVTransferTracker
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    finished_req_ids: set[str]
    # Requests moved back to waiting outside schedule(): the runner drops their rows next step.
    _pending_preempted_req_ids: set[str]
    # Prompt log-probabilities gathered over prefill chunks, by request id.
    _prompt_logprobs: dict[str, list[float | None]]
    num_preemptions: int

    def add_request(self, request: Request) -> None:
        """Queue ``request`` as waiting, then tell the connector (``on_new_request``). Raises
        ValueError on a duplicate id or a request that is not ``WAITING``."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.status != RequestStatus.WAITING:
            raise ValueError(
                f"request {request.request_id!r} is {request.status.name}, not WAITING"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

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

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the blocks, reset progress, front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._prompt_logprobs.pop(request.request_id, None)  # recomputed from position 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

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
