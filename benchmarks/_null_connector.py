"""A vLLM KV connector that does nothing: the scheduler row's ``null`` side (``_prefix_sched``).

What vLLM's ``Scheduler`` spends on having a connector at all (its calls into the connector,
the metadata it passes, the branches it takes), with nothing of any connector's own work: the
floor of every connector's step time. Loaded by vLLM from this folder
(``kv_connector_module_path: "_null_connector"``; the benchmark's child runs its engine in
process, with the script's folder on ``sys.path``). Never for serving: it moves no KV.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

__all__ = ["NullConnector"]


class _NoOrders(KVConnectorMetadata):
    """The one metadata object every step gets."""


_NO_ORDERS = _NoOrders()


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """Matches nothing, plans nothing, sends and receives nothing."""

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NO_ORDERS

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
