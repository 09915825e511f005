"""The connector's error types.

Everything that arrives over the network (``kv_transfer_params``, a peer's replies, index
entries) is validated; a bad value raises ``KVTransferParamsError`` (or another
``KVConnectorError``), which the node catches at the request boundary: that request fails with a
clear message and the node keeps serving (docs/architecture.md, "Validation of network input").
"""

from __future__ import annotations

__all__ = [
    "KVConnectorError",
    "KVTransferConfigError",
    "KVTransferParamsError",
    "unreachable_reason",
]


class KVConnectorError(Exception):
    """Base class of the connector's errors."""


class KVTransferConfigError(KVConnectorError, ValueError):
    """A ``kv_transfer_config`` mapping is malformed (a caller mistake at start-up)."""


class KVTransferParamsError(KVConnectorError, ValueError):
    """A request's ``kv_transfer_params`` are malformed; names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"kv_transfer_params.{field}: {problem}")
        self.field = field
        self.problem = problem


def unreachable_reason(exc: Exception, engine_id: str) -> str:
    """A pull's error for a holder that cannot be reached, saying what to check."""
    return (f"{exc}; is {engine_id} running, and is the transport address it advertises (its "
            f"kv_connector_extra_config 'host'/'port') reachable from this host?")
