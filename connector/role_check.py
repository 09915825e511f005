"""A request whose ``kv_transfer_params`` ask for a part this engine's ``kv_role`` does not play.

vLLM and kvbridge's engine serve such a request as a plain one (a producer asked to pull a
ticket computes the prompt itself; a consumer asked to hand its KV over returns no ticket),
which is right for the request but hides a deployment mistake: a proxy that sends P's requests
to D, or an engine started with the wrong ``kv_role``. ``RoleCheck`` says so in one log line
per kind of mistake, naming the setting to change, and counts every such request.

Owner: the engine thread (the scheduler half's admission).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvbridge.kvmanager.connector_interface import KVRole

from .stats import KVTransferStats
from .transfer_params import wants_remote_decode, wants_remote_prefill

__all__ = ["RoleCheck"]

logger = logging.getLogger(__name__)

_PULL = ("do_remote_prefill", "a P/D ticket to pull", "the decode engine", "kv_consumer")
_HAND_OVER = ("do_remote_decode", "to hand its KV to a decode engine", "the prefill engine",
              "kv_producer")


class RoleCheck:
    """Warns once per kind of role mismatch (``num_role_mismatches`` counts each request)."""

    def __init__(self, kv_role: KVRole, stats: KVTransferStats) -> None:
        self.kv_role = kv_role
        self.stats = stats
        self._warned: set[str] = set()

    def check(self, request_id: str, params: Mapping[str, Any] | None) -> None:
        """Log (once per kind) and count a request whose params this role ignores."""
        if wants_remote_prefill(params) and not self.kv_role.is_consumer:
            self._mismatch(request_id, _PULL)
        if wants_remote_decode(params) and not self.kv_role.is_producer:
            self._mismatch(request_id, _HAND_OVER)

    def _mismatch(self, request_id: str, kind: tuple[str, str, str, str]) -> None:
        key, asks, engine, role = kind
        self.stats.add("num_role_mismatches")
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(
            "request %s carries %s=true (%s), but this engine's kv_role is %r, which ignores "
            "it: the request is served as a plain one. Send such requests to %s, or start this "
            "engine with kv_role %r or 'kv_both' (logged once; num_role_mismatches counts "
            "them)", request_id, key, asks, self.kv_role.value, engine, role)
