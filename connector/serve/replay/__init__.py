"""``kvbridge-replay``: a Mooncake-format trace replayed against several nodes' block caches
(``trace``), with its input expansion (``input``), the store tier's stand-in (``store``) and the
report (``report``)."""

from .input import TokenExpander, TraceRequest, load_trace, read_trace
from .trace import main as replay_main

__all__ = ["TokenExpander", "TraceRequest", "load_trace", "read_trace", "replay_main"]
