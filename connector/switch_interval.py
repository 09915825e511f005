"""The opt-in process-wide GIL switch interval (``gil_switch_interval_s``, default None).

A library does not change its host's process-wide settings unasked: only when the setting is
given does the worker half set ``sys.setswitchinterval`` (pulls that hop between the engine
thread and the connector loop then wait less behind a busy engine thread), and it puts the
previous interval back when it shuts down or its start is refused, unless someone changed the
interval since. Owner: the thread that starts and shuts down the worker half.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["SwitchInterval"]

logger = logging.getLogger(__name__)


class SwitchInterval:
    """``apply`` sets ``interval_s`` (None: nothing); ``restore`` puts the old value back once."""

    def __init__(self, interval_s: float | None, engine_id: str) -> None:
        self.interval_s = interval_s
        self.engine_id = engine_id
        self._previous: float | None = None

    def apply(self) -> None:
        if self.interval_s is None:
            return
        self._previous = sys.getswitchinterval()
        sys.setswitchinterval(self.interval_s)
        logger.info("%s: sys.setswitchinterval(%g) for this whole process "
                    "(gil_switch_interval_s; was %g)", self.engine_id, self.interval_s,
                    self._previous)

    def restore(self) -> None:
        previous, self._previous = self._previous, None
        if previous is not None and sys.getswitchinterval() == self.interval_s:
            sys.setswitchinterval(previous)
