"""Which ``load_mode`` a vLLM engine can run (``connector.load_mode``), read from vLLM's objects
by attribute (no vLLM import, tested without vLLM).

A pull that loads inside its step ("sync") reports a failure to vLLM only as
``invalid_block_ids``. Two vLLM 0.32 set-ups cannot take that report:

- several KV cache groups (the hybrid allocator): ``Scheduler._handle_invalid_blocks`` raises,
  since block ids are unique within a group only;
- async scheduling (``scheduler_config.async_scheduling``, vLLM's default on a GPU): the step
  after a sync load is scheduled before the load's output comes back, with an output
  placeholder for the request's next token. ``update_from_output`` then skips the failed
  request's output (``vllm/v1/core/sched/scheduler.py``) but never gives the placeholder back:
  a request alone in that step stays RUNNING with nothing left to compute and never finishes
  (its blocks are never freed); one scheduled again in the next step has its next token
  decoded over KV that never loaded before it is recomputed.

So ``"sync"`` is refused in both, and ``"auto"`` (sync only where a load cannot stall other
requests) loads every pull over later steps under async scheduling, as ``"async"`` does.

Under ``kv_load_failure_policy`` ``"recompute"`` a failed in-step load's blocks may be shared
by another request of the same step: vLLM caches a sync load's blocks as it allocates them, so
a later request of that schedule takes them as a local hit. ``_update_requests_with_invalid_
blocks`` then leaves their recompute to the loading request alone and keeps the other one's
computed tokens; if the loading request is aborted or preempted before it recomputes them, the
other decodes over KV never written (``tests/vllm/test_vllm_pd_interleavings.py``). So there
``"auto"`` loads a handoff inside its step only for a request alone in the engine, as it does an
index hit (``recompute_shares_in_step_loads``), and ``"sync"`` is said to carry that risk.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..config import KVTransferConfig
from ..errors import KVTransferConfigError

__all__ = ["load_mode_for", "recompute_shares_in_step_loads"]

logger = logging.getLogger(__name__)


def load_mode_for(vllm_config: Any, config: KVTransferConfig, *, num_groups: int,
                  say: bool = True) -> KVTransferConfig:
    """``config`` with the ``load_mode`` this engine runs: unchanged, or ``"auto"`` made
    ``"async"`` under vLLM's async scheduling. Called once per connector half, at
    construction; reads ``vllm_config.scheduler_config.async_scheduling``.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (read only).
        config: the node's validated settings (not mutated: a copy is returned).
        num_groups: the engine's KV cache groups.
        say: log the change of ``"auto"`` (once per engine: the scheduler half's call).

    Raises:
        KVTransferConfigError: ``load_mode`` ``"sync"`` with several KV cache groups or under
            async scheduling, naming the settings that fix it.
    """
    if config.load_mode == "sync" and num_groups > 1:
        raise KVTransferConfigError(
            "kv_connector_extra_config.load_mode='sync' with several KV cache groups: vLLM "
            "takes a failed sync load only as block ids, which it refuses for a hybrid "
            "model; use 'async'"
        )
    async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
    if config.load_mode == "sync" and not async_scheduling and say \
            and config.load_failure_policy == "recompute":
        logger.warning(
            "load_mode 'sync' with kv_load_failure_policy 'recompute': a request that shares a "
            "failed in-step load's blocks may decode over KV never written if the loading "
            "request is aborted or preempted first (vLLM leaves their recompute to it); "
            "'auto' loads in the step only a request alone in the engine")
    if not async_scheduling or config.load_mode == "async":
        return config
    if config.load_mode == "sync":
        raise KVTransferConfigError(
            "kv_connector_extra_config.load_mode='sync' under vLLM's async scheduling: vLLM "
            "never finishes a request whose in-step load fails there; use 'auto' or 'async', "
            "or start vLLM with --no-async-scheduling"
        )
    if say:
        logger.info("vLLM's async scheduling is on, so load_mode 'auto' loads every pull over "
                    "later engine steps ('async'): vLLM cannot recover a failed in-step load "
                    "there")
    return dataclasses.replace(config, load_mode="async")


def recompute_shares_in_step_loads(config: KVTransferConfig) -> bool:
    """Whether vLLM leaves the recompute of a failed in-step load's blocks to the loading
    request alone, while other requests of the step that took them as a local hit keep them as
    computed (``kv_load_failure_policy`` ``"recompute"``; module docstring): then ``"auto"``
    loads a handoff inside its step only for a request alone in the engine
    (``LoadModePolicy``'s ``handoffs_only_alone``)."""
    return config.load_failure_policy == "recompute"
