"""Building an ``Engine`` with a ``KVBridgeConnector``.

``Engine`` asks a connector factory for its two halves (``KVConnectorRole.SCHEDULER`` and
``WORKER``). ``KVBridgeConnectorFactory`` gives both halves one shared ``ConnectorContext``;
``attach`` then hands it the engine's ``KVCacheManager`` (the holder checks block hashes there
before it serves a read). ``create_engine`` does all three steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvbridge.kernels.model import ModelConfig, ReferenceDecoder
from kvbridge.kvmanager.connector_interface import KVConnectorRole
from kvbridge.kvmanager.engine import Engine, EngineConfig
from kvbridge.kvmanager.model_runner import make_kv_cache_config
from kvbridge.transport import LoopbackFaults, LoopbackNetwork

from .config import KVTransferConfig
from .context import ConnectorContext
from .kvbridge_connector import KVBridgeConnector

__all__ = ["KVBridgeConnectorFactory", "create_engine"]


class KVBridgeConnectorFactory:
    """Builds the two halves of one node's connector around a shared context.

    Args:
        kv_transfer_config: a ``KVTransferConfig`` or a vLLM-shaped mapping.
        model_config: the node's model (its layers decide the KV cache groups).
        engine_config: the node's settings (block size, pool size, hash function).
        loopback_network: required when ``transport`` is ``"loopback"``.
        loopback_faults: holder-side faults for tests (loopback only).
    """

    def __init__(
        self,
        kv_transfer_config: KVTransferConfig | Mapping[str, Any],
        *,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        loopback_network: LoopbackNetwork | None = None,
        loopback_faults: LoopbackFaults | None = None,
    ) -> None:
        if not isinstance(kv_transfer_config, KVTransferConfig):
            kv_transfer_config = KVTransferConfig.from_dict(kv_transfer_config)
        self.context = ConnectorContext(
            config=kv_transfer_config,
            kv_cache_config=make_kv_cache_config(
                model_config,
                num_blocks=engine_config.num_blocks,
                block_size=engine_config.block_size,
            ),
            hash_fn_name=engine_config.hash_fn,
            loopback_network=loopback_network,
            loopback_faults=loopback_faults,
        )

    def __call__(self, role: KVConnectorRole) -> KVBridgeConnector:
        return KVBridgeConnector(role, self.context)

    def attach(self, engine: Engine) -> None:
        """Give the holder side the engine's block pool (call before the first step)."""
        self.context.kv_cache_manager = engine.kv_cache_manager


def create_engine(
    model: ReferenceDecoder | ModelConfig,
    engine_config: EngineConfig,
    kv_transfer_config: KVTransferConfig | Mapping[str, Any],
    *,
    loopback_network: LoopbackNetwork | None = None,
    loopback_faults: LoopbackFaults | None = None,
) -> Engine:
    """An ``Engine`` whose scheduler and runner use a ``KVBridgeConnector``.

    The connector's halves are ``engine.scheduler.connector`` and ``engine.runner.connector``;
    their statistics are ``engine.scheduler.connector.stats``. Raises what ``Engine`` and
    ``KVTransferConfig`` raise for bad settings.
    """
    model_config = model.config if isinstance(model, ReferenceDecoder) else model
    if not isinstance(kv_transfer_config, KVTransferConfig):
        kv_transfer_config = KVTransferConfig.from_dict(kv_transfer_config)
    if kv_transfer_config.index_url and not engine_config.enable_kv_cache_events:
        # The index is fed from the block pool's events.
        engine_config = dataclasses.replace(engine_config, enable_kv_cache_events=True)
    factory = KVBridgeConnectorFactory(
        kv_transfer_config,
        model_config=model_config,
        engine_config=engine_config,
        loopback_network=loopback_network,
        loopback_faults=loopback_faults,
    )
    engine = Engine(model, engine_config, connector_factory=factory)
    factory.attach(engine)
    return engine
