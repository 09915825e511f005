"""kvbridge's messages between its vLLM halves, inside vLLM's metadata types.

Everything the halves say to each other travels as msgpack bytes (``connector/metadata.py``)
inside these ``KVConnectorMetadata`` subclasses: vLLM pickles them between processes, and bytes
pickle as themselves.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["_Handshake", "_StepOrders", "_WorkerReport"]


class _StepOrders(KVConnectorMetadata):
    """One step's ``KVBridgeConnectorMetadata`` as msgpack bytes."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


class _WorkerReport(KVConnectorWorkerMetadata):
    """The workers' ``KVBridgeWorkerMeta`` reports of one step, as msgpack bytes."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, _WorkerReport)
        return _WorkerReport(self.payloads + other.payloads)


class _Handshake(KVConnectorHandshakeMetadata):
    """The worker half's ``WorkerHandshake`` as msgpack bytes."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
