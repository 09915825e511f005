"""ProbeConnector: a throwaway vLLM KV connector that logs every call it receives.

Scaffolding for learning vLLM 0.32.0's connector contract (see VLLM_API_NOTES.md); it is not
part of kvbridge and may be removed once ``kvbridge.connector.vllm`` exists.

Loaded by vLLM through::

    kv_transfer_config={"kv_connector": "ProbeConnector",
                        "kv_connector_module_path": "_probe_connector",  # on PYTHONPATH
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"log_path": "...", "dump_dir": "..."}}

Every call appends one JSON line (pid, role, method, a summary of the arguments) to
``log_path``. Besides logging it plays a file-backed P/D so the semantics can be watched
end to end:

- a request whose ``kv_transfer_params`` has ``{"probe_hold": true}`` is held at
  ``request_finished`` (``delay_free=True``); the worker writes the request's KV blocks to
  ``dump_dir/<req_id>.pt`` and then reports it in ``finished_sending``. The returned
  params carry ``probe_load_from`` (the file) and ``probe_num_tokens``.
- a request whose params carry ``probe_load_from`` is answered by
  ``get_num_new_matched_tokens`` with ``(num_tokens - computed, True)`` (after
  ``probe_none_polls`` answers of ``None``); the worker copies the file's blocks into the
  request's blocks by position and reports ``finished_recving``. With ``probe_fail_block``
  (an index) that block is not copied and is reported by ``get_block_ids_with_load_errors``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

_SEQ = 0
_LOCK = threading.Lock()


def _summ(x: Any, depth: int = 0) -> Any:
    """A JSON-able summary of an argument: types and shapes, not contents."""
    if depth > 3:
        return type(x).__name__
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return {"tensor": list(x.shape), "dtype": str(x.dtype), "stride": list(x.stride()),
                "device": str(x.device), "contig": x.is_contiguous()}
    if isinstance(x, bytes):
        return f"bytes[{len(x)}]"
    if isinstance(x, (list, tuple, set, frozenset)):
        items = list(x)
        if len(items) > 8 and all(isinstance(i, int) for i in items):
            return f"{type(x).__name__}[{len(items)} ints: {items[:4]}...]"
        return [_summ(i, depth + 1) for i in items[:8]] + (["..."] if len(items) > 8 else [])
    if isinstance(x, dict):
        return {str(k): _summ(v, depth + 1) for k, v in list(x.items())[:12]}
    name = type(x).__name__
    if name == "Request":
        return {"Request": x.request_id, "status": str(x.status),
                "prompt_len": len(x.prompt_token_ids or ()), "num_tokens": x.num_tokens,
                "num_computed_tokens": x.num_computed_tokens,
                "num_output_tokens": x.num_output_tokens,
                "block_hashes": f"{len(x.block_hashes)} x "
                                f"{type(x.block_hashes[0]).__name__ if x.block_hashes else '-'}"
                                f"[{len(x.block_hashes[0]) if x.block_hashes else 0}]",
                "kv_transfer_params": x.kv_transfer_params}
    if name == "KVCacheBlocks":
        return {"KVCacheBlocks": x.get_block_ids()}
    if name == "SchedulerOutput":
        c = x.scheduled_cached_reqs
        return {"SchedulerOutput": True,
                "new": [(r.req_id, r.block_ids, r.num_computed_tokens,
                         len(r.prompt_token_ids or ())) for r in x.scheduled_new_reqs],
                "cached": {"req_ids": c.req_ids, "new_block_ids": c.new_block_ids,
                           "num_computed_tokens": c.num_computed_tokens,
                           "resumed": sorted(c.resumed_req_ids)},
                "num_scheduled_tokens": x.num_scheduled_tokens,
                "finished_req_ids": sorted(x.finished_req_ids),
                "preempted_req_ids": sorted(x.preempted_req_ids or ()),
                "has_sync_kv_loads": x.has_sync_kv_loads}
    if name == "KVConnectorOutput":
        return {"KVConnectorOutput": True,
                "finished_sending": sorted(x.finished_sending or ()),
                "finished_recving": sorted(x.finished_recving or ()),
                "failed_recving": sorted(x.failed_recving),
                "invalid_block_ids": sorted(x.invalid_block_ids),
                "worker_meta": _summ(x.kv_connector_worker_meta, depth + 1),
                "stats": type(x.kv_connector_stats).__name__}
    if name == "ProbeMeta":
        return {"ProbeMeta": x.step, "sched_pid": x.sched_pid, "same_object": id(x) == x.obj_id,
                "loads": x.loads, "holds": x.holds}
    if name == "ProbeWorkerMeta":
        return {"ProbeWorkerMeta": x.entries}
    if name == "ForwardContext":
        am = x.attn_metadata
        return {"ForwardContext": True, "attn_metadata": type(am).__name__ if am is not None
                else None, "no_compile_layers": len(getattr(x, "no_compile_layers", {}) or {})}
    if name == "CPUAttentionMetadata":
        return {"CPUAttentionMetadata": True, "num_actual_tokens": x.num_actual_tokens,
                "slot_mapping": _summ(x.slot_mapping), "block_table": _summ(x.block_table)}
    return name


@dataclass
class ProbeMeta(KVConnectorMetadata):
    """Scheduler -> worker, one per step."""

    step: int
    sched_pid: int
    obj_id: int = 0
    # req_id -> (block_ids, file, fail_block index or -1)
    loads: dict[str, tuple[list[int], str, int]] = field(default_factory=dict)
    # req_id -> (block_ids, file)
    holds: dict[str, tuple[list[int], str]] = field(default_factory=dict)


@dataclass
class ProbeWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one per step per worker; vLLM aggregates them."""

    entries: list[tuple[int, int]] = field(default_factory=list)  # (worker pid, step)

    def aggregate(self, other: ProbeWorkerMeta) -> ProbeWorkerMeta:
        return ProbeWorkerMeta(self.entries + other.entries)


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._log_path = extra.get("log_path") or os.environ.get("PROBE_LOG", "/tmp/probe.jsonl")
        self._dump_dir = extra.get("dump_dir", "/tmp/probe_dump")
        self._log_layers = bool(extra.get("log_layers", True))
        os.makedirs(self._dump_dir, exist_ok=True)
        self._step = 0
        # scheduler state
        self._polls: dict[str, int] = {}
        self._pending_loads: dict[str, tuple[list[int], str, int]] = {}
        self._pending_holds: dict[str, tuple[list[int], str]] = {}
        # worker state
        self._kv: dict[str, torch.Tensor] = {}
        self._w_loads: dict[str, tuple[list[int], str, int]] = {}
        self._w_holds: dict[str, tuple[list[int], str]] = {}
        self._done_recv: set[str] = set()
        self._done_send: set[str] = set()
        self._load_errors: set[int] = set()
        self._log("__init__", role=str(role), kv_cache_config=_summ_kv_cache_config(
            kv_cache_config), engine_id=self._kv_transfer_config.engine_id,
            kv_role=self._kv_transfer_config.kv_role,
            failure_policy=self._kv_transfer_config.kv_load_failure_policy)

    # ---------------------------------------------------------------- logging
    def _log(self, method: str, **args: Any) -> None:
        global _SEQ
        with _LOCK:
            _SEQ += 1
            rec = {"seq": _SEQ, "t": time.monotonic(), "pid": os.getpid(),
                   "thread": threading.current_thread().name,
                   "role": "S" if self._role == KVConnectorRole.SCHEDULER else "W",
                   "step": self._step, "method": method,
                   "args": {k: _summ(v) for k, v in args.items()}}
            with open(self._log_path, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")

    # ======================================================= scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        ret: tuple[int | None, bool] = (0, False)
        if params.get("probe_load_from"):
            n = self._polls.get(request.request_id, 0)
            self._polls[request.request_id] = n + 1
            if n < int(params.get("probe_none_polls", 0)):
                ret = (None, False)
            else:
                total = int(params["probe_num_tokens"])
                ret = (max(total - num_computed_tokens, 0), total > num_computed_tokens)
        self._log("get_num_new_matched_tokens", request=request,
                  num_computed_tokens=num_computed_tokens, returns=list(ret))
        return ret

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._log("update_state_after_alloc", request=request, blocks=blocks,
                  num_external_tokens=num_external_tokens)
        params = request.kv_transfer_params or {}
        if num_external_tokens > 0 and params.get("probe_load_from"):
            (ids,) = blocks.get_block_ids()
            self._pending_loads[request.request_id] = (
                list(ids), params["probe_load_from"], int(params.get("probe_fail_block", -1)))

    def build_connector_meta(self, scheduler_output):
        self._step += 1
        meta = ProbeMeta(step=self._step, sched_pid=os.getpid(), loads=self._pending_loads,
                         holds=self._pending_holds)
        meta.obj_id = id(meta)
        self._pending_loads, self._pending_holds = {}, {}
        self._log("build_connector_meta", scheduler_output=scheduler_output, returns=meta)
        return meta

    def update_connector_output(self, connector_output):
        self._log("update_connector_output", connector_output=connector_output)

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params or {}
        ret: tuple[bool, dict | None] = (False, None)
        if params.get("probe_hold"):
            path = os.path.join(self._dump_dir, f"{request.request_id}.pt")
            self._pending_holds[request.request_id] = (list(block_ids), path)
            ret = (True, {"probe_load_from": path,
                          "probe_num_tokens": len(request.prompt_token_ids or ())})
        self._log("request_finished", request=request, block_ids=block_ids, returns=list(ret))
        return ret

    def take_events(self):
        self._log("take_events")
        return ()

    def on_new_request(self, request):
        self._log("on_new_request", request=request)

    def bind_kv_cache_manager(self, kv_cache_manager):
        self._log("bind_kv_cache_manager", kv_cache_manager=kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool):
        self._log("bind_gpu_block_pool", gpu_block_pool=gpu_block_pool,
                  num_gpu_blocks=getattr(gpu_block_pool, "num_gpu_blocks", None))

    def set_xfer_handshake_metadata(self, metadata):
        self._log("set_xfer_handshake_metadata", metadata=metadata)

    def get_kv_connector_stats(self):
        # Called on both sides: the worker each step, the scheduler after update_from_output.
        return None

    # ========================================================== worker side
    def register_kv_caches(self, kv_caches):
        self._kv = dict(kv_caches)
        ptrs = {n: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(),
                    t.data_ptr() - t.untyped_storage().data_ptr())
                for n, t in kv_caches.items()}
        self._log("register_kv_caches", kv_caches=kv_caches,
                  storages={n: {"storage_nbytes": b, "byte_offset_in_storage": o}
                            for n, (_, b, o) in ptrs.items()},
                  shared_storage=len({p for p, _, _ in ptrs.values()}) < len(ptrs),
                  kv_cache_layout=getattr(self._kv_cache_config, "kv_cache_layout", None))

    def set_host_xfer_buffer_ops(self, copy_operation):
        self._log("set_host_xfer_buffer_ops", copy_operation=copy_operation)

    def get_handshake_metadata(self):
        self._log("get_handshake_metadata")
        return None

    def bind_connector_metadata(self, connector_metadata):
        self._step = connector_metadata.step
        self._log("bind_connector_metadata", connector_metadata=connector_metadata)
        super().bind_connector_metadata(connector_metadata)
        self._w_loads.update(connector_metadata.loads)
        self._w_holds.update(connector_metadata.holds)

    def handle_preemptions(self, kv_connector_metadata):
        self._step = kv_connector_metadata.step  # called before bind_connector_metadata
        self._log("handle_preemptions", kv_connector_metadata=kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs):
        self._log("start_load_kv", forward_context=forward_context, kwargs=kwargs)
        # Holds first: a dump may be what a load in this same step is waiting for.
        for req_id, (ids, path) in list(self._w_holds.items()):
            blocks = {n: t[ids].clone() for n, t in self._kv.items()}
            torch.save({"block_ids": ids, "layers": blocks}, path + ".tmp")
            os.replace(path + ".tmp", path)
            self._done_send.add(req_id)
            del self._w_holds[req_id]
        for req_id, (ids, path, fail) in list(self._w_loads.items()):
            if not os.path.exists(path):
                continue  # not dumped yet: try again next step
            src = torch.load(path)
            n = min(len(ids), len(src["block_ids"]))
            for name, t in self._kv.items():
                for i in range(n):
                    if i == fail:
                        continue
                    t[ids[i]].copy_(src["layers"][name][i])
            if 0 <= fail < n:
                self._load_errors.add(ids[fail])
            self._done_recv.add(req_id)
            del self._w_loads[req_id]

    def wait_for_layer_load(self, layer_name):
        if self._log_layers:
            self._log("wait_for_layer_load", layer_name=layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if self._log_layers:
            self._log("save_kv_layer", layer_name=layer_name, kv_layer=kv_layer,
                      same_tensor_as_registered=kv_layer.data_ptr()
                      == self._kv[layer_name].data_ptr() if layer_name in self._kv else None,
                      attn_metadata=attn_metadata, kwargs=kwargs)

    def wait_for_save(self):
        self._log("wait_for_save")

    def finish_forward(self):
        self._log("finish_forward")

    def get_finished(self, finished_req_ids):
        send, recv = self._done_send, self._done_recv
        self._done_send, self._done_recv = set(), set()
        self._log("get_finished", finished_req_ids=finished_req_ids,
                  returns=[sorted(send), sorted(recv)])
        return (send or None), (recv or None)

    def get_block_ids_with_load_errors(self):
        errs, self._load_errors = self._load_errors, set()
        self._log("get_block_ids_with_load_errors", returns=sorted(errs))
        return errs

    def build_connector_worker_meta(self):
        meta = ProbeWorkerMeta([(os.getpid(), self._step)])
        self._log("build_connector_worker_meta", returns=meta)
        return meta

    def clear_connector_metadata(self):
        self._log("clear_connector_metadata")
        super().clear_connector_metadata()

    def shutdown(self):
        self._log("shutdown")


def _summ_kv_cache_config(cfg: Any) -> Any:
    if cfg is None:
        return None
    try:
        groups = [{"layers": list(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
                   "block_size": g.kv_cache_spec.block_size,
                   "num_kv_heads": getattr(g.kv_cache_spec, "num_kv_heads", None),
                   "head_size": getattr(g.kv_cache_spec, "head_size", None),
                   "dtype": str(getattr(g.kv_cache_spec, "dtype", None))}
                  for g in cfg.kv_cache_groups]
        return {"num_blocks": cfg.num_blocks, "groups": groups,
                "tensors": [{"size": t.size, "layers": list(t.layers),
                             "layer_stride": t.layer_stride, "block_stride": t.block_stride,
                             "offset": t.offset} for t in cfg.kv_cache_tensors],
                "kv_cache_layout": cfg.kv_cache_layout}
    except Exception as e:  # the summary is best effort
        return f"KVCacheConfig ({e!r})"
