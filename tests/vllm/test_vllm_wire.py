"""A step's orders inside vLLM's ``SchedulerOutput`` (``connector/vllm/wire.py``): the scheduler
half's object itself where vLLM hands the output over in process (``UniProcExecutor``), msgpack
bytes where vLLM pickles it for another process (``MultiprocExecutor``: ``test_pd_tp.py`` runs
that path end to end).
"""

from __future__ import annotations

import pickle

import msgspec
import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvbridge.connector.metadata import (
    BlockHashDelta,
    KVBridgeConnectorMetadata,
    decode_metadata,
)
from kvbridge.connector.vllm.wire import _StepOrders


def _orders() -> KVBridgeConnectorMetadata:
    return KVBridgeConnectorMetadata(
        step_id=7, num_scheduled_tokens=96,
        block_hashes=BlockHashDelta(removed_block_ids=[3], stored_block_ids=[4, 5],
                                    stored_hashes=[b"a" * 36, b"b" * 36]))


def test_in_process_the_worker_reads_the_schedulers_object():
    meta = _orders()
    orders = _StepOrders(meta)
    assert orders.metadata is meta  # nothing encoded, nothing decoded


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_pickled_orders_travel_as_msgpack_and_decode_equal(protocol):
    meta = _orders()
    data = pickle.dumps(_StepOrders(meta), protocol=protocol)
    received = pickle.loads(data)
    assert received.metadata is not meta
    assert received.metadata == meta
    assert decode_metadata(received.payload) == meta  # the bytes are encode_metadata's


def test_pickled_orders_hold_bytes_not_the_structs():
    """What crosses the process boundary is kvbridge's versioned msgpack, never a pickle of
    kvbridge's classes (a worker of another kvbridge version gets a clear error, not a
    half-read object)."""
    data = pickle.dumps(_StepOrders(_orders()))
    assert b"KVBridgeConnectorMetadata" not in data and b"BlockHashDelta" not in data


def test_orders_that_are_not_this_versions_raise_on_read():
    orders = _StepOrders.__new__(_StepOrders)
    orders.__setstate__(b"\x93not-orders")
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        orders.metadata  # noqa: B018 - the read is what raises
