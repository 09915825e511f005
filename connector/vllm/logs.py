"""kvbridge's log lines inside vLLM: the ``kvbridge`` logger writes through vLLM's handler.

vLLM configures only its own ``vllm`` logger (vllm/logger.py, ``DEFAULT_LOGGING_CONFIG``: a
stream handler named ``vllm``, its format with process name, pid, level, time and file, and
``propagate: False``); the root logger keeps no handler. Left alone, the ``kvbridge`` logger
then reaches only Python's last-resort handler: warnings and errors as bare messages, and every
info line (a transport listening, a lease released) lost. ``route_to_vllm`` gives ``kvbridge``
vLLM's handlers and level, so its lines read like vLLM's in the same stream, unless the user
configured logging for kvbridge (or the root logger) already, or vLLM's logging is off
(``VLLM_CONFIGURE_LOGGING=0``: the ``vllm`` logger has no handler either).
"""

from __future__ import annotations

import logging

__all__ = ["route_to_vllm"]


def route_to_vllm() -> bool:
    """Point the ``kvbridge`` logger at the ``vllm`` logger's handlers (idempotent).

    Mutates the ``kvbridge`` logger (handlers, level, ``propagate``); any thread, typically the
    connector's constructor in each vLLM process. Returns True when kvbridge's lines now go
    through vLLM's handlers (also when an earlier call did it), False when left alone.
    """
    ours, theirs = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    if not theirs.handlers:
        return False
    if ours.handlers:
        return all(h in theirs.handlers for h in ours.handlers)
    if logging.getLogger().handlers:
        return False  # the application configured the root logger: kvbridge propagates there
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False
    return True
