"""A request's prefix held by another node, found through the block index (docs/architecture.md,
"Life of an index hit").

A request without a ticket asks the index for the longest prefix of its block hashes that another
node holds, asynchronously: the first ``match`` starts the lookup on the index client's thread
and answers "pending" (the engine asks again next step: vLLM's ``None``) until the answer is in;
the client bounds the wait (``index_lookup_timeout_s``), after which the request goes on with
its local hit alone. A hit is planned as a pull of the holder's blocks (``RemoteMatch``).

A request gets one index pull: after a failed one the engine recomputes (vLLM asks the
connector again, from the first block that did not land or from 0) and a stale entry would name
the same refused blocks again; after a preemption its blocks are in the local cache.

Owner: the engine thread (the scheduler half's); nothing here is shared.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from .index.lookup import LOOKUP_PENDING
from .metadata import HolderRef
from .pull_plan import RemoteMatch

if TYPE_CHECKING:
    from .index import IndexClient, RemotePrefix
    from .stats import KVTransferStats

__all__ = ["IndexAnswer", "IndexMatcher"]

logger = logging.getLogger(__name__)

ANSWER_REUSE_S = 1.0
"""How long a hit handed out for a request whose blocks vLLM could not allocate yet is handed
out again when the engine asks again, instead of a new lookup (and a step's wait for it) every
step while the engine's cache is full; the holder re-checks every block when it is pulled."""

_LOOKUP_FAILURES = frozenset({"unavailable", "timed_out", "overloaded"})
"""Lookup statuses that went on without the index's answer (``num_index_lookup_failures``)."""


class IndexAnswer(NamedTuple):
    """``pending``: ask again next step; else ``match`` is the pull to plan, or None (none)."""

    pending: bool
    match: RemoteMatch | None = None


_PENDING = IndexAnswer(True)
_NONE = IndexAnswer(False)


class IndexMatcher:
    """One node's index lookups, at most one in flight per request.

    Args:
        stats: the node's statistics: ``num_index_lookups`` (started) and
            ``num_index_lookup_failures`` (answered without asking a holder: the index down or
            erroring, past its deadline, too many in flight) are counted here.
        block_size: tokens per block.
        min_gain_blocks: a remote hit must beat the local hit by this many blocks.
        load_async: a hit's pull runs over later engine steps (False: inside the step).
        alone_loads_in_step: a hit handed out while its request is the only one the engine
            holds loads inside the step that computes it, whatever ``load_async`` says
            (``load_mode`` "auto": no other request's forward waits for that load, and the
            first token comes one engine step sooner; ``load_mode.LoadModePolicy``).
        num_groups: the engine's KV cache groups (an answer names block ids for each).
        alone_wait_s: how long ``match`` waits for the answer of a lookup it starts for the
            only request the engine holds (``admit`` / ``forget``): nothing else could run
            meanwhile, and the answer then comes in the arrival step instead of a step later
            (``idle_lookup_wait_s``); 0: never.
    """

    def __init__(self, *, stats: KVTransferStats, block_size: int, min_gain_blocks: int,
                 load_async: bool, num_groups: int = 1, alone_wait_s: float = 0.0,
                 alone_loads_in_step: bool = False) -> None:
        self._stats = stats
        self._block_size = block_size
        self._num_groups = num_groups
        self._malformed_from: set[str] = set()  # holders whose malformed answers were logged
        self._min_gain_blocks = min_gain_blocks
        self._load_async = load_async
        self._alone_wait_s = alone_wait_s
        self._alone_loads_in_step = alone_loads_in_step
        self._live: set[str] = set()  # requests admitted and not finished
        self._lookups: set[str] = set()  # requests with a lookup started, not answered yet
        self._pulled: set[str] = set()  # requests that had their one index pull
        # A hit handed out and not pulled yet (vLLM could not allocate the request's blocks):
        # asked again, it is handed out again for ANSWER_REUSE_S instead of a new lookup.
        self._answered: dict[str, tuple[float, IndexAnswer]] = {}

    @property
    def pending_request_ids(self) -> frozenset[str]:
        """Requests whose lookup is started and not answered yet."""
        return frozenset(self._lookups)

    def match(self, client: IndexClient | None, request: Any,
              num_computed_tokens: int) -> IndexAnswer:
        """The index's answer for ``request`` (``request_id``, ``block_hashes``, ``num_tokens``,
        ``skip_reading_prefix_cache``) beyond its local hit of ``num_computed_tokens`` (a
        multiple of the block size). Never waits: a lookup not answered yet is pending. No
        ``client`` (no index, or not started yet): none."""
        request_id = request.request_id
        if client is None or request.skip_reading_prefix_cache or request_id in self._pulled:
            return _NONE
        if self._answered:
            reused = self._reused(request_id, num_computed_tokens)
            if reused is not None:
                return self._as_told(request_id, reused)
        if request_id not in self._lookups:
            self._start(client, request, num_computed_tokens)
        result = client.poll_lookup(request_id)
        if result is LOOKUP_PENDING:
            return _PENDING
        self._lookups.discard(request_id)
        found: RemotePrefix | None = result.prefix
        if found is None:  # the usual answer: nobody holds more (or the index could not say)
            if result.status in _LOOKUP_FAILURES:
                self._stats.add("num_index_lookup_failures")
            return _NONE
        if not self._well_formed(found, self._num_asked(request)):
            self._stats.add("num_index_lookup_failures")
            return _NONE
        # The local hit may have grown while the lookup was out (another request cached the
        # same blocks): the gain is judged again against what is local now.
        if (found.num_blocks - num_computed_tokens // self._block_size
                < max(self._min_gain_blocks, 1)):
            return _NONE
        holder = HolderRef(engine_id=found.holder.node_id,
                           incarnation=str(found.holder.incarnation), host=found.address.host,
                           port=found.address.port, tier=found.holder.tier)
        answer = IndexAnswer(False, RemoteMatch(
            holder=holder, remote_block_ids=tuple(tuple(ids) for ids in found.block_ids),
            ticket=None, num_local_tokens=num_computed_tokens,
            num_remote_tokens=found.num_blocks * self._block_size,
            load_async=self._load_async,  # the pull is planned as the engine is told
        ))
        self._answered[request_id] = (time.monotonic(), answer)
        return self._as_told(request_id, answer)

    def _num_asked(self, request: Any) -> int:
        """Blocks of ``request`` the index is asked about: never the last token's, which is
        recomputed for its logits anyway."""
        return min(len(request.block_hashes), (request.num_tokens - 1) // self._block_size)

    def _start(self, client: IndexClient, request: Any, num_computed_tokens: int) -> None:
        """Start ``request``'s lookup on the client's thread (waiting up to ``alone_wait_s``
        for the answer when the request is alone in the engine)."""
        request_id = request.request_id
        self._stats.add("num_index_lookups")
        client.start_lookup(request_id, request.block_hashes[:self._num_asked(request)],
                            num_local_blocks=num_computed_tokens // self._block_size,
                            min_gain_blocks=self._min_gain_blocks)
        self._lookups.add(request_id)
        if self._alone_wait_s and self.alone(request_id):
            client.wait_for_answer(self._alone_wait_s)  # the engine has nothing else to run

    def alone(self, request_id: str) -> bool:
        """Whether ``request_id`` is the only request admitted and not finished."""
        return len(self._live) == 1 and request_id in self._live

    def _as_told(self, request_id: str, answer: IndexAnswer) -> IndexAnswer:
        """``answer`` as the engine is told it now: loaded inside the step when the request is
        alone (``alone_loads_in_step``), judged at each hand-out, since another request may
        have arrived since the hit was first handed out."""
        match = answer.match
        if (match is not None and match.load_async and self._alone_loads_in_step
                and self.alone(request_id)):
            return IndexAnswer(False, dataclasses.replace(match, load_async=False))
        return answer

    def _reused(self, request_id: str, num_computed_tokens: int) -> IndexAnswer | None:
        """The hit handed out for ``request_id`` before, while it is younger than
        ``ANSWER_REUSE_S`` and was planned against the same local hit; else None (and it is
        dropped)."""
        answered = self._answered.get(request_id)
        if answered is None:
            return None
        at, answer = answered
        assert answer.match is not None
        if (time.monotonic() - at < ANSWER_REUSE_S
                and answer.match.num_local_tokens == num_computed_tokens):
            return answer
        del self._answered[request_id]
        return None

    def _well_formed(self, found: RemotePrefix, num_asked: int) -> bool:
        """False, with a log line (WARNING once per holder, DEBUG after), for an answer that
        cannot be planned: more blocks than were asked for, or not ``num_blocks`` non-negative
        block ids for each KV cache group (a corrupt or foreign index entry). Such an answer
        is a miss: the request is computed here."""
        ids = found.block_ids
        if 0 < found.num_blocks <= num_asked and len(ids) == self._num_groups and all(
                len(group) >= found.num_blocks and min(group[:found.num_blocks]) >= 0
                for group in ids):
            return True
        holder = found.holder.node_id
        say = logger.debug if holder in self._malformed_from else logger.warning
        self._malformed_from.add(holder)
        say("index: an answer naming holder %s cannot be planned (%d blocks of the %d asked "
            "for, block ids for %d group(s) of %d, lengths %s); computing locally", holder,
            found.num_blocks, num_asked, len(ids), self._num_groups,
            [len(group) for group in ids][:4])
        return False

    def pending(self, client: IndexClient | None, request_id: str) -> bool:
        """True while ``request_id``'s lookup is out (``match`` would answer pending): a set
        and a dict read, nothing allocated, hashed or logged. False when its answer is in,
        which the next ``match`` hands out."""
        return request_id in self._lookups and client is not None and \
            client.lookup_pending(request_id)

    def note_pull(self, request_id: str) -> None:
        """``request_id``'s index hit is being pulled: it is never looked up again."""
        self._pulled.add(request_id)
        self._answered.pop(request_id, None)

    def admit(self, request_id: str) -> None:
        """``request_id`` entered the engine (it counts against ``alone_wait_s`` until
        ``forget``)."""
        self._live.add(request_id)

    def forget(self, client: IndexClient | None, request_id: str) -> None:
        """``request_id`` finished (or was aborted): its lookup is cancelled, its state gone."""
        self._live.discard(request_id)
        if request_id in self._lookups and client is not None:
            client.cancel_lookup(request_id)
        self._lookups.discard(request_id)
        self._pulled.discard(request_id)
        self._answered.pop(request_id, None)
