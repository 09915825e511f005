"""Whether a node's index backend answers, as its log tells a user (issue 29, part 5).

A node whose ``index_url`` names a Redis that does not answer (never started, wrong host or
port, a wrong password, gone mid-run) keeps serving from its own cache: lookups find no remote
prefix, a publish call is made again once it answers (or, past 3 s, resynced:
docs/operations.md, "Failure behaviour"). The user sees that as ONE warning when the backend
stops answering, naming the URL it tried (password redacted), the error, what the node does
meanwhile and what to change, and one line when it answers again; never one line per request or
per retry.

``Reachability`` is shared by every part that talks to one backend (``client.open_index`` gives
the same one to the ``RedisBlockIndex`` and the ``RedisNodeDirectory``; a cluster's index backs
off per bucket): each part reports ``failed(part, exc)`` and ``answered(part)``; the backend is
down while any part is, and the two lines are logged at the transitions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .url import redact_url

__all__ = ["NODE_MEANWHILE", "Reachability"]

logger = logging.getLogger(__name__)

NODE_MEANWHILE = ("serving from this node's own cache meanwhile (no remote prefix hits; its "
                  "blocks are published once Redis answers)")


class Reachability:
    """The up/down state of one index backend and its two log lines.

    Args:
        url: the ``index_url`` the parts talk to (its password is never logged).
        retry_interval_s: how often the parts try again while it is down (said in the line).
        meanwhile: what its user does while it is down (said in the line).
        clock: monotonic seconds (for how long it was down).

    Thread safety: ``failed`` and ``answered`` may be called from any thread (the index worker,
    the caller of ``IndexClient.start``, a tool's threads); a lock orders the transitions.
    """

    def __init__(self, url: str, *, retry_interval_s: float = 1.0, meanwhile: str = NODE_MEANWHILE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = redact_url(url)
        self.meanwhile = meanwhile
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_parts: set[str] = set()
        self._down_since_s = 0.0
        self.num_outages = 0  # transitions to down so far

    @property
    def down(self) -> bool:
        return bool(self._down_parts)

    def failed(self, part: str, exc: BaseException) -> None:
        """``part`` (``"index"``, ``"directory"``, a key prefix) met ``exc`` talking to the
        backend. Logs the warning if the backend was up until now."""
        with self._lock:
            was_down = bool(self._down_parts)
            self._down_parts.add(part)
            if was_down:
                return
            self._down_since_s = self._clock()
            self.num_outages += 1
        logger.warning(
            "kvbridge index: cannot reach %s (%s: %s); %s, retrying every %.1f s. Start Redis "
            "there, or set index_url (--index-url) to a server that answers, or leave it unset "
            "for no index",
            self.url, type(exc).__name__, exc, self.meanwhile, self.retry_interval_s,
        )

    def answered(self, part: str) -> None:
        """``part`` got an answer. Logs the recovery line once no part is down any more."""
        if part not in self._down_parts:  # the common case, read without the lock
            return
        with self._lock:
            if part not in self._down_parts:
                return
            self._down_parts.discard(part)
            if self._down_parts:
                return
            down_s = self._clock() - self._down_since_s
        logger.info(
            "kvbridge index: %s answers again after %.1f s; using the index again", self.url,
            down_s,
        )
