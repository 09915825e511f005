"""Which pulls load inside the engine step that computes their request (``load_mode``).

vLLM offers two ways to load external KV (``get_num_new_matched_tokens`` returns
``load_kv_async``): async, where the request waits in ``WAITING_FOR_REMOTE_KVS`` over later
steps and no step waits for the network, and sync, where the step that computes the request
first waits for the load (as vLLM's ``ExampleConnector`` and LMCache load). Sync gives the
first token one step sooner, and a step of vLLM costs milliseconds of scheduling and input
preparation even for a one-token forward, more than a one-sided read of a handoff
(docs/architecture.md, "Design measurements"), but a sync load stalls every request batched
with it for as long as it takes.

``load_mode`` ``"auto"`` (the default) takes sync only where the stall is a bounded memory copy:
a handoff the worker half reads one-sided from a same-host holder's block board
(``kvbridge.transport.cma_board``: no message, no network wait), of at most
``AUTO_SYNC_MAX_BYTES``, for a model with one KV cache group (vLLM takes a failed sync load
only as block ids, which it refuses with several groups); and, with one group, a hit found
through the block index for a request that is the only one in the engine
(``IndexMatcher``): nothing is batched with it, so the load stalls no other request's forward,
and the first token comes one engine step sooner. Every other pull is async, and so is every
pull under vLLM's async scheduling (``vllm.load_modes``: vLLM cannot recover a failed in-step
load there). Inside vLLM under ``recompute`` a handoff too loads in its step only for a request
alone in the engine (``handoffs_only_alone``: vLLM may run another request of that step over a
failed in-step load's blocks).

What it risks: the choice is made at scheduling from the worker's last report, before the read.
The scheduler half first looks at the holder's board itself (``ticket_board``), and refuses a
ticket whose blocks the board shows holding other content (another prompt's ticket without a
digest, a stale ticket whose blocks P leased again) before anything is allocated or read, as
D refuses another prompt's digest (``handoff``). A handoff the board does not vouch for after
all (a ticket whose lease P's worker has not been handed yet, a stale ticket whose lease ended)
is then read the usual way inside that step: the step waits for P's answer, and for a lease not
yet granted for P's retries (``lease_reads.LEASE_GRANT_RETRY_S``, 0.38 s at most), never past
``sync_load_timeout_s``. A lone request's index hit from a holder that stops answering holds
its step, and so requests that arrive meanwhile, up to ``sync_load_timeout_s`` (then its blocks
are recomputed; async, the request itself would wait ``load_timeout_s``). ``load_mode``
``"async"`` never stalls a step that way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvbridge.transport import BoardRef

from .config import AUTO_SYNC_MAX_BYTES
from .metadata import HolderRef

if TYPE_CHECKING:
    from kvbridge.kvmanager.kv_cache_spec import KVCacheConfig

__all__ = ["LoadModePolicy"]


class LoadModePolicy:
    """The scheduler half's choice of sync loads under ``load_mode`` ``"auto"``.

    Owner: the scheduler half (the scheduler's thread).

    Args:
        load_mode: the node's ``load_mode``; anything but ``"auto"`` never loads in the step
            here (``"sync"`` is the caller's own rule).
        num_groups: KV cache groups of the model.
        kv_cache_config: the groups' specs (bytes per block); None: sizes unknown, never sync.
        handoffs_only_alone: a handoff loads in the step only for a request alone in the
            engine, as an index hit does: the engine cannot let other requests of the step
            share a failed in-step load's blocks safely (vLLM under ``recompute``:
            ``vllm.load_modes``).
    """

    def __init__(
        self, load_mode: str, num_groups: int, kv_cache_config: KVCacheConfig | None,
        *, handoffs_only_alone: bool = False,
    ) -> None:
        self._auto = load_mode == "auto" and num_groups == 1
        self._handoffs_only_alone = handoffs_only_alone
        self._block_nbytes = None
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            group = kv_cache_config.kv_cache_groups[0]
            self._block_nbytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        self._boards: dict[tuple[str, str], BoardRef] = {}

    @property
    def alone_loads_in_step(self) -> bool:
        """Whether a hit found through the block index loads inside the step when its request
        is the only one the engine holds (``IndexMatcher``: nothing is batched with it, so
        the load stalls no other request's forward)."""
        return self._auto

    def observe(self, one_sided_holders: Iterable[BoardRef] | None) -> None:
        """The worker half's report (``KVBridgeWorkerMeta.one_sided_holders``; None:
        unchanged)."""
        if one_sided_holders is not None:
            self._boards = {(b.engine_id, b.incarnation): b for b in one_sided_holders}

    def board_of(self, holder: HolderRef) -> BoardRef | None:
        """``holder``'s block board as the worker half last reported it (None: not read
        one-sided, or another incarnation)."""
        return self._boards.get((holder.engine_id, holder.incarnation))

    def loads_in_step(self, holder: HolderRef, num_blocks: int, *, alone: bool) -> bool:
        """Whether a handoff of ``num_blocks`` blocks from ``holder`` loads inside the step
        (``alone``: its request is the only one in the engine). The worker's report is a hint:
        a read it cannot do one-sided after all is read the usual way, within
        ``sync_load_timeout_s``."""
        return (
            self._auto
            and (alone or not self._handoffs_only_alone)
            and self._block_nbytes is not None
            and num_blocks * self._block_nbytes <= AUTO_SYNC_MAX_BYTES
            and (holder.engine_id, holder.incarnation) in self._boards
        )
