"""``kv_transfer_config``: the connector's settings, read from a mapping shaped like vLLM's.

vLLM passes ``--kv-transfer-config '{"kv_connector": ..., "kv_role": ..., "engine_id": ...,
"kv_connector_extra_config": {...}}'`` (vllm/config/kv_transfer.py). We accept the same outer
keys; everything of ours lives under ``kv_connector_extra_config``:

===========================  ========  ==========================================================
key                          default   meaning
===========================  ========  ==========================================================
``host``                     127.0.0.1  address the transport listens on (and advertises to peers):
                                       a hostname or an IP address, IPv6 bare (``::1``)
``port``                     0         listen port; 0 picks a free one
``transport``                ucxx      ``"ucxx"`` or ``"loopback"`` (in-process, for tests)
``cma``                      None      ucxx only: between processes on one host, pull blocks by
                                       cross-memory attach (``process_vm_readv``, one copy;
                                       ``kvbridge.transport.cma``); false: every read over UCX;
                                       None: on unless the environment has ``KVBRIDGE_CMA=0``
``cma_board``                true      holder side, with ``cma``: publish the blocks held under
                                       leases on a block board in this process's memory, so that
                                       a same-host decode node reads a handoff without a round
                                       trip to this node (``kvbridge.transport.cma_board``);
                                       false: every read asks this node
``load_timeout_s``           30.0      deadline of one remote load (decode side)
``load_mode``                auto      ``"async"``: a pull runs over later engine steps (the request
                                       waits in ``WAITING_FOR_REMOTE_KVS``; no step waits for the
                                       network). ``"sync"``: the pull runs inside the step that
                                       computes the request (vLLM's synchronous external load,
                                       as its ``ExampleConnector`` and LMCache do): the first
                                       token comes one step sooner, but that step's forward,
                                       and so every request batched with it, waits for the
                                       pull, at most ``sync_load_timeout_s``. ``"auto"``: sync
                                       for a handoff the worker half reads one-sided from a
                                       same-host holder's block board (a memory copy of at most
                                       ``AUTO_SYNC_MAX_BYTES``, no network wait) and for an
                                       index hit of a request alone in the engine (nothing
                                       batched with it to stall), async for every other pull,
                                       for several KV cache groups and under vLLM's async
                                       scheduling (its default on a GPU, where ``"sync"`` is
                                       refused: vLLM cannot recover a failed in-step load
                                       there); inside vLLM under ``recompute`` a handoff too
                                       loads in its step only for a request alone in the
                                       engine (vLLM may run another request of that step over
                                       a failed in-step load's blocks)
``sync_load_timeout_s``      2.0       deadline of one pull loaded inside its step
``lease_s``                  30.0      how long a prefill node keeps blocks for a puller without
                                       a heartbeat
``heartbeat_interval_s``     2.0       how often a puller extends the leases it depends on;
                                       also how long a writer to the store goes without a put
                                       before it asks the store's incarnation (a restart)
``load_failure_policy``      recompute ``"recompute"`` or ``"fail"``
``index_url``                None      ``redis://host:port/db``, ``redis-cluster://H:P[,H:P]``
                                       (seed nodes), ``"memory"`` or None (no index); an IPv6
                                       host in brackets (``redis://[::1]:6379/0``)
``min_remote_hit_blocks``    1         a remote hit must beat the local hit by this many blocks
``min_remote_hit_tokens``    0         ... and by at least this many tokens (whole blocks: the
                                       larger of the two applies), so that a pull is planned
                                       only where it beats recomputing (a lookup's answer, a
                                       transfer and one more engine step against the prefill
                                       of those tokens); inside vLLM the default is
                                       ``translate.VLLM_MIN_REMOTE_HIT_TOKENS`` (256)
``gil_switch_interval_s``    None      opt-in: the worker half sets ``sys.setswitchinterval`` to
                                       this (seconds) for the whole process while it runs, and
                                       puts the old value back at shutdown; pulls that hop
                                       between the engine thread and the connector loop then
                                       wait less behind a busy engine thread. None (default)
                                       leaves the host's setting alone
``idle_pull_wait_s``         0.02      on a step that computes no token, ``get_finished`` waits up
                                       to this long for a pull in flight to settle and returns
                                       at the first one (the engine has nothing else to run; a
                                       waiting engine thread leaves the GIL and the core to the
                                       pull, and the request is promoted a step sooner;
                                       docs/architecture.md, "Design measurements");
                                       0 never waits
``idle_lookup_wait_s``       0.02      on a step that computes no token while index lookups
                                       are out, the scheduler half waits up to this long for an
                                       answer and returns at the first one (the same reason as
                                       ``idle_pull_wait_s``: an engine thread stepping idly keeps
                                       the GIL from the index client's thread); a request alone
                                       in a vLLM engine (nothing else admitted) waits as long
                                       for its own answer when its lookup starts, so that a hit
                                       is planned in its arrival step; 0 never waits
``idle_hold_wait_s``         0.01      on a step that computes no token while this node only
                                       holds leases for pullers (nothing of its own in flight),
                                       ``get_finished`` waits: 1 ms, doubled at each further
                                       idle step in a row, up to this long (vLLM steps a
                                       holder without pause while it holds blocks, and on a
                                       small host that loop takes the cores the pullers'
                                       reads and forwards need); a completion notice ends the
                                       wait at once (the lease's blocks are freed in that
                                       step); a request reaching the engine in a lull waits
                                       at most about as long as the lull has lasted, and
                                       never more than this; 0: no wait
``index_lookup_timeout_s``   0.5       a request waits at most this long (over scheduling
                                       steps, never inside one) for its index lookup, then
                                       goes on with its local prefix hit alone
``index_socket_timeout_s``   0.25      a Redis call of the index not answered this long counts
                                       as an outage (the index is then not asked for a second);
                                       raise it where Redis shares a crowded host
``index_ttl_s``              10.0      a node's index entries expire this long after its last
                                       heartbeat (heartbeats every third of it)
``model_name``               kvbridge  the model whose KV the node holds: part of the block
                                       identity (``kvbridge.transport.BlockIdentity``), which
                                       the handshake checks and the index namespace is made of
``model_revision``           ""        the revision of the model's weights, part of the block
                                       identity too (vLLM: the commit ``--revision`` resolved
                                       to, or for local weights one of their bytes); "":
                                       unknown, equal only to another unknown
``store_url``                None      ``"host:port"`` of a store node's write server (issue 7),
                                       ``"[ipv6]:port"`` for an IPv6 address
``offload``                  off       ``"off"``, ``"evict"`` (cold cached blocks, before reuse)
                                       or ``"write_through"`` (every newly cached block too);
                                       needs ``store_url`` and ``index_url``
``offload_blocks_per_step``  32        most blocks snapshotted for the store per engine step
``offload_scan_blocks``      4096      most free-queue entries looked at per step
``offload_remember_blocks``  1048576   most of its own writes a node remembers as held by the
                                       store (not written again while remembered, the oldest
                                       forgotten first; a block cached ever since its write is
                                       remembered too); about the store's blocks / writing
                                       nodes: older writes may have been dropped; writing one
                                       again sends its bytes again ("present" if still held)
``offload_max_inflight_bytes`` 256 MiB snapshot bytes allowed to wait for the store
``auth_key``                 None      the cluster secret (at least 16 bytes of UTF-8): every
                                       transport handshake proves it both ways by HMAC
                                       challenge-response (kvbridge.transport.auth); a peer
                                       without it reads no block and touches no lease. Prefer:
``auth_key_env``             None      the name of an environment variable holding the secret
``auth_key_file``            None      a file holding the secret (trailing newline ignored); at
                                       most one of the three is set; None of them: no
                                       authentication
===========================  ========  ==========================================================

Any other key under ``kv_connector_extra_config`` is refused, naming it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.kvmanager.connector_interface import KVRole
from kvbridge.transport.address import check_host

from .errors import KVTransferConfigError
from .index.url import check_index_url
from .store.url import parse_store_url

__all__ = ["KVTransferConfig"]

_TRANSPORTS = ("ucxx", "loopback")
_POLICIES = ("recompute", "fail")
_OFFLOAD = ("off", "evict", "write_through")
_LOAD_MODES = ("auto", "async", "sync")
AUTO_SYNC_MAX_BYTES = 4 << 20
"""``load_mode`` ``"auto"`` loads a one-sided handoff of at most this many KV bytes inside the
step (``kvbridge.transport.cma.INLINE_COPY_MAX_BYTES``: a copy that short costs the step less
than a step; docs/architecture.md, "Design measurements"); a larger one runs over later steps,
and so does every pull under vLLM's async scheduling (``vllm.load_modes``)."""
_OUTER_KEYS = frozenset(
    {
        "kv_connector",
        "kv_connector_module_path",
        "kv_role",
        "engine_id",
        "kv_connector_extra_config",
    }
)


@dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
    """Validated connector settings (see the module docstring for every key)."""

    kv_connector: str = "KVBridgeConnector"
    kv_role: KVRole = KVRole.BOTH
    engine_id: str = "kvbridge-0"
    host: str = "127.0.0.1"
    port: int = 0
    transport: str = "ucxx"
    cma: bool | None = None
    cma_board: bool = True
    load_timeout_s: float = 30.0
    load_mode: str = "auto"
    sync_load_timeout_s: float = 2.0
    lease_s: float = 30.0
    heartbeat_interval_s: float = 2.0
    load_failure_policy: str = "recompute"
    index_url: str | None = None
    min_remote_hit_blocks: int = 1
    min_remote_hit_tokens: int = 0
    index_lookup_timeout_s: float = 0.5
    index_socket_timeout_s: float = 0.25
    gil_switch_interval_s: float | None = None
    idle_pull_wait_s: float = 0.02
    idle_lookup_wait_s: float = 0.02
    idle_hold_wait_s: float = 0.01
    index_ttl_s: float = 10.0
    model_name: str = "kvbridge"
    model_revision: str = ""
    store_url: str | None = None
    offload: str = "off"
    offload_blocks_per_step: int = 32
    offload_scan_blocks: int = 4096
    offload_remember_blocks: int = 1 << 20
    offload_max_inflight_bytes: int = 256 << 20
    auth_key: str | None = field(default=None, repr=False)  # never printed in a log line
    auth_key_env: str | None = None
    auth_key_file: str | None = None

    def __post_init__(self) -> None:
        if self.transport not in _TRANSPORTS:
            raise KVTransferConfigError(
                f"transport must be one of {_TRANSPORTS}, got {self.transport!r}"
            )
        if self.cma is not None and type(self.cma) is not bool:
            raise KVTransferConfigError(f"cma must be true, false or null, got {self.cma!r}")
        if type(self.cma_board) is not bool:
            raise KVTransferConfigError(f"cma_board must be true or false, got {self.cma_board!r}")
        if self.load_failure_policy not in _POLICIES:
            raise KVTransferConfigError(
                f"load_failure_policy must be one of {_POLICIES}, got {self.load_failure_policy!r}"
            )
        if self.load_mode not in _LOAD_MODES:
            raise KVTransferConfigError(
                f"load_mode must be one of {_LOAD_MODES}, got {self.load_mode!r}"
            )
        if not 0 <= self.port <= 65535:
            raise KVTransferConfigError(f"port must be in [0, 65535], got {self.port}")
        self._check_addresses()
        for name in (
            "load_timeout_s",
            "sync_load_timeout_s",
            "lease_s",
            "heartbeat_interval_s",
            "index_ttl_s",
            "index_lookup_timeout_s",
            "index_socket_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise KVTransferConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_interval_s >= self.lease_s:
            raise KVTransferConfigError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be shorter than "
                f"lease_s ({self.lease_s}), or leases expire between heartbeats"
            )
        if self.gil_switch_interval_s is not None and not 0 < self.gil_switch_interval_s <= 1:
            raise KVTransferConfigError(
                f"gil_switch_interval_s must be in (0, 1] or null, got {self.gil_switch_interval_s}"
            )
        for name in ("idle_pull_wait_s", "idle_lookup_wait_s", "idle_hold_wait_s"):
            if not 0 <= getattr(self, name) <= 1:
                raise KVTransferConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.min_remote_hit_blocks < 1:
            raise KVTransferConfigError(
                f"min_remote_hit_blocks must be >= 1, got {self.min_remote_hit_blocks}"
            )
        if type(self.min_remote_hit_tokens) is not int or self.min_remote_hit_tokens < 0:
            raise KVTransferConfigError(
                f"min_remote_hit_tokens must be an int >= 0, got {self.min_remote_hit_tokens!r}"
            )
        self._check_offload()
        self.auth_key_bytes()  # a missing variable or file, or a short key: refused now
        if not self.engine_id:
            raise KVTransferConfigError("engine_id must be a non-empty string")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise KVTransferConfigError(f"model_name must be a non-empty string, got "
                                        f"{self.model_name!r}")
        if not isinstance(self.model_revision, str):
            raise KVTransferConfigError(
                f"model_revision must be a string ('' for unknown), got {self.model_revision!r}"
            )

    def _check_addresses(self) -> None:
        """``host``, ``store_url`` and ``index_url`` (``kvbridge.transport.address``): an IPv6
        address bare in ``host``, in brackets in the URLs; anything ambiguous refused now."""
        try:
            check_host(self.host, what="host")
            if self.store_url is not None:
                parse_store_url(self.store_url)
            if self.index_url is not None:
                check_index_url(self.index_url)
        except ValueError as exc:
            raise KVTransferConfigError(str(exc)) from None

    def _check_offload(self) -> None:
        if self.offload not in _OFFLOAD:
            raise KVTransferConfigError(f"offload must be one of {_OFFLOAD}, got {self.offload!r}")
        names = ("offload_blocks_per_step", "offload_scan_blocks", "offload_remember_blocks",
                 "offload_max_inflight_bytes")
        for name in names:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise KVTransferConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.offload != "off" and not (self.store_url and self.index_url):
            raise KVTransferConfigError(
                f"offload {self.offload!r} needs store_url (where to write) and index_url (the "
                "pool events that name each block's parent, and the index restores go through)"
            )

    def auth_key_bytes(self) -> bytes | None:
        """The cluster secret from ``auth_key``, ``auth_key_env`` or ``auth_key_file`` (read
        now), or None when none is set.

        Raises:
            KVTransferConfigError: more than one is set, the variable or file is missing or
                unreadable, or the secret is shorter than 16 bytes.
        """
        names = ("auth_key", "auth_key_env", "auth_key_file")
        for name in names:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise KVTransferConfigError(f"{name} must be a string or null")
        sources = [name for name in names if getattr(self, name)]
        if not sources:
            return None
        if len(sources) > 1:
            raise KVTransferConfigError(f"set at most one of {sources}")
        if self.auth_key:
            key = self.auth_key.encode()
        elif self.auth_key_env:
            value = os.environ.get(self.auth_key_env)
            if value is None:
                raise KVTransferConfigError(
                    f"auth_key_env: environment variable {self.auth_key_env!r} is not set"
                )
            key = value.encode()
        else:
            try:
                key = Path(str(self.auth_key_file)).read_bytes().rstrip(b"\r\n")
            except OSError as exc:
                raise KVTransferConfigError(f"auth_key_file: {exc}") from None
        if len(key) < 16:
            raise KVTransferConfigError(
                f"{sources[0]}: the cluster secret must be at least 16 bytes, got {len(key)}"
            )
        return key

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> KVTransferConfig:
        """Read a vLLM-shaped mapping. Raises KVTransferConfigError naming an unknown key or a
        bad value."""
        config = dict(config)
        unknown = set(config) - _OUTER_KEYS
        if unknown:
            raise KVTransferConfigError(f"unknown kv_transfer_config keys: {sorted(unknown)}")
        extra = config.get("kv_connector_extra_config") or {}
        if not isinstance(extra, Mapping):
            raise KVTransferConfigError(
                f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
            )
        known = {f for f in cls.__dataclass_fields__ if f not in _OUTER_KEYS}
        unknown = set(extra) - known
        if unknown:
            hints = [f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)
                     for key in sorted(unknown)
                     for close in [difflib.get_close_matches(key, known, n=1, cutoff=0.75)]]
            raise KVTransferConfigError(
                f"unknown kv_connector_extra_config key(s): {', '.join(hints)}; remove them or "
                f"use one of the known keys: {', '.join(sorted(known))}"
            )
        kwargs: dict[str, Any] = dict(extra)
        try:
            role = KVRole(config.get("kv_role", KVRole.BOTH.value))
        except ValueError as exc:
            raise KVTransferConfigError(
                f"kv_role must be one of {[r.value for r in KVRole]}, got {config.get('kv_role')!r}"
            ) from exc
        return cls(
            kv_connector=str(config.get("kv_connector", "KVBridgeConnector")),
            kv_role=role,
            engine_id=str(config.get("engine_id", "kvbridge-0")),
            **kwargs,
        )
