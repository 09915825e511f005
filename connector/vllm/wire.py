"""kvbridge's messages between its vLLM halves, inside vLLM's metadata types.

Between processes everything the halves say to each other travels as msgpack bytes
(``connector/metadata.py``) inside these ``KVConnectorMetadata`` subclasses: vLLM pickles them,
and bytes pickle as themselves. A step's orders (``_StepOrders``, built inside every
``schedule()``) are encoded only when pickled: vLLM's ``UniProcExecutor`` (one rank, the usual
single-accelerator engine) hands the worker the very ``SchedulerOutput`` the scheduler built,
and the worker half then reads the scheduler half's object as it is (neither half changes a
step's orders once built).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..metadata import KVBridgeConnectorMetadata, decode_metadata, encode_metadata

__all__ = ["_Handshake", "_StepOrders", "_WorkerReport"]


class _StepOrders(KVConnectorMetadata):
    """One step's ``KVBridgeConnectorMetadata``: the object itself in the process that built
    it, msgpack bytes once pickled (decoded when first read in the other process)."""

    def __init__(self, metadata: KVBridgeConnectorMetadata) -> None:
        self._metadata: KVBridgeConnectorMetadata | None = metadata
        self._payload: bytes | None = None

    @property
    def metadata(self) -> KVBridgeConnectorMetadata:
        """The orders. Raises ``msgspec.ValidationError`` / ``DecodeError`` (``decode_metadata``)
        for bytes that are not this version's orders. Any thread (the worker's, in practice)."""
        if self._metadata is None:
            assert self._payload is not None
            self._metadata = decode_metadata(self._payload)
        return self._metadata

    @property
    def payload(self) -> bytes:
        """The orders as msgpack bytes (what a pickle of this object carries)."""
        if self._payload is None:
            assert self._metadata is not None
            self._payload = encode_metadata(self._metadata)
        return self._payload

    def __getstate__(self) -> bytes:
        return self.payload

    def __setstate__(self, payload: bytes) -> None:
        self._metadata, self._payload = None, payload


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
