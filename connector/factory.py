"""Building an ``Engine`` whose connector is a ``KVBridgeConnector``.

``Engine`` asks a connector factory for its two halves (``KVConnectorRole.SCHEDULER`` and
``WORKER``), handing each the engine's ``KVCacheConfig`` (vLLM's connector constructor takes
``(vllm_config, role, kv_cache_config)`` the same way). The halves share nothing but the
immutable settings; ``create_engine`` then binds the scheduler half to the engine's block pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvbridge.kernels.model import ModelConfig, ReferenceDecoder
from kvbridge.kvmanager.connector_interface import KVConnectorRole
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.kvmanager.kv_cache_spec import KVCacheConfig
from kvbridge.transport import LoopbackFaults, LoopbackNetwork

from .config import KVTransferConfig
from .kvbridge_connector import KVBridgeConnector

__all__ = ["KVBridgeConnectorFactory", "create_engine"]


class KVBridgeConnectorFactory:
    """Builds the two halves of one node's connector.

    Args:
        kv_transfer_config: a ``KVTransferConfig`` or a vLLM-shaped mapping.
        hash_fn_name: the node's block hash function (``EngineConfig.hash_fn``).
        loopback_network: required when ``transport`` is ``"loopback"``.
        loopback_faults: holder-side faults for tests (loopback only).

    Raises:
        KVTransferConfigError: for a malformed mapping (naming the key).
    """

    def __init__(
        self,
        kv_transfer_config: KVTransferConfig | Mapping[str, Any],
        *,
        hash_fn_name: str,
        loopback_network: LoopbackNetwork | None = None,
        loopback_faults: LoopbackFaults | None = None,
    ) -> None:
        if not isinstance(kv_transfer_config, KVTransferConfig):
            kv_transfer_config = KVTransferConfig.from_dict(kv_transfer_config)
        self.config = kv_transfer_config
        self.hash_fn_name = hash_fn_name
        self.loopback_network = loopback_network
        self.loopback_faults = loopback_faults

    def __call__(self, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> KVBridgeConnector:
        return KVBridgeConnector(
            role,
            self.config,
            kv_cache_config,
            hash_fn_name=self.hash_fn_name,
            loopback_network=self.loopback_network,
            loopback_faults=self.loopback_faults,
        )


def create_engine(
    model: ReferenceDecoder | ModelConfig,
    engine_config: EngineConfig,
    kv_transfer_config: KVTransferConfig | Mapping[str, Any],
    *,
    loopback_network: LoopbackNetwork | None = None,
    loopback_faults: LoopbackFaults | None = None,
) -> Engine:
    """An ``Engine`` whose scheduler and runner use a ``KVBridgeConnector``.

    Every key of ``kv_transfer_config`` takes effect, ``load_failure_policy`` included (it
    replaces ``engine_config.kv_load_failure_policy``); an index turns the block pool's events
    on (the index is fed from them). The connector's halves are ``engine.scheduler.connector``
    and ``engine.runner.connector``; the node's statistics are
    ``engine.scheduler.connector.stats``.

    Raises:
        ValueError: what ``Engine`` and ``KVTransferConfig`` raise for bad settings.
        Whatever refuses the start after the transport started (an ``index_url`` that cannot
        be opened: ``redis`` exceptions; a cluster index with no seed reachable:
        ``ClusterUnreachableError``, a ValueError; an ``engine_id`` the index refuses:
        ValueError; a port taken: ``OSError``) is raised once
        ``Engine`` closed everything the node had started: none of its threads, listening
        ports or connector-loop tasks keeps running.
    """
    if not isinstance(kv_transfer_config, KVTransferConfig):
        kv_transfer_config = KVTransferConfig.from_dict(kv_transfer_config)
    engine_config = dataclasses.replace(
        engine_config,
        kv_load_failure_policy=kv_transfer_config.load_failure_policy,  # type: ignore[arg-type]
        enable_kv_cache_events=engine_config.enable_kv_cache_events
        or bool(kv_transfer_config.index_url),
    )
    factory = KVBridgeConnectorFactory(
        kv_transfer_config,
        hash_fn_name=engine_config.hash_fn,
        loopback_network=loopback_network,
        loopback_faults=loopback_faults,
    )
    engine = Engine(model, engine_config, connector_factory=factory)  # closes what it started
    manager = engine.kv_cache_manager
    connector = engine.scheduler.connector
    assert isinstance(connector, KVBridgeConnector)
    connector.bind_block_pool(manager.block_pool, manager.take_events)
    return engine
