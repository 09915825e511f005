"""The second process of ``scripts/gpu_device_check.py``: P's engine and raw UCX holders with KV
tensors on the device, driven over a pipe, so that every transfer the check measures crosses
processes as in a real P/D pair (``multiprocessing`` spawn: CUDA starts fresh in the child).

Also shared by both processes: the recording device binder (check 3) and the engines' and
holders' construction, so both sides build the same seeded model and KV tensors.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from typing import Any

import torch
from kvbridge.kernels import device_binding

BLOCK_SIZE = 16
HOLDER_SHAPE = (64, 2, BLOCK_SIZE, 8, 128)  # 64 KiB blocks in bfloat16
HOLDER_LAYERS = 4
KVBRIDGE_THREADS = ("kvbridge-", "engine-loop")
"""Name prefixes of the threads kvbridge starts (``connector/loop_thread.py``,
``transport/staging.py``, ``connector/serve/node/loop.py``, the index workers)."""
NOT_KV_THREADS = ("kvbridge-index", "kvbridge-watchdog")
"""Those of them that never touch KV tensors (index calls, the loop's watchdog): not bound."""

BOUND: dict[int, tuple[str, torch.device, int | None]] = {}  # thread ident -> binding seen
_real_bind = device_binding.bind_device


def _recording_bind(device: torch.device) -> None:
    """``bind_device`` as it is, recording which thread bound what (check 3)."""
    _real_bind(device)
    current = torch.cuda.current_device() if device.type == "cuda" else None
    BOUND[threading.get_ident()] = (threading.current_thread().name, device, current)


device_binding.bind_device = _recording_bind  # on import: before any connector thread starts


def thread_report(
    device: torch.device, before: set[int]
) -> tuple[list[str], list[str], list[str]]:
    """``(kvbridge threads checked, those not bound to device, other threads)`` among the
    threads started since ``before`` (idents); ``NOT_KV_THREADS`` are left out. Other threads
    (torch's, Triton's, asyncio's resolver) are only named."""
    want = device_binding.resolve_device(device)
    checked, unbound, others = [], [], []
    for thread in threading.enumerate():
        if thread.ident in before or thread.name.startswith(NOT_KV_THREADS):
            continue
        if not thread.name.startswith(KVBRIDGE_THREADS):
            others.append(thread.name)
            continue
        seen = BOUND.get(thread.ident)  # type: ignore[arg-type]
        if seen is None or seen[1] != want or (want.type == "cuda" and seen[2] != want.index):
            unbound.append(f"{thread.name}: {seen}")
        checked.append(thread.name)
    return checked, unbound, others


def make_engine(device: torch.device, transport: str, role: str | None, network: Any = None):  # type: ignore[no-untyped-def]
    """kvbridge's engine on ``ModelConfig.tiny`` (seeded: every process builds the same
    weights) with KV caches on ``device``: a P/D node of ``role`` over ``transport``, or a plain
    single engine (``role`` None)."""
    from kvbridge.connector.factory import create_engine
    from kvbridge.kernels.model import ModelConfig
    from kvbridge.kvmanager.engine import Engine, EngineConfig

    config = EngineConfig(num_blocks=512, block_size=BLOCK_SIZE, max_model_len=1200,
                          max_num_batched_tokens=1200, device=str(device))
    if role is None:
        return Engine(ModelConfig.tiny(), config)
    extra: dict[str, Any] = {"transport": transport, "load_timeout_s": 30.0,
                             "heartbeat_interval_s": 0.5}
    if transport == "ucxx":
        extra.update(host="127.0.0.1", port=0, cma=False)
    kv_transfer_config = {"kv_role": role, "engine_id": f"gpu-{role}",
                          "kv_connector_extra_config": extra}
    return create_engine(ModelConfig.tiny(), config, kv_transfer_config, loopback_network=network)


def holder_caches(device: torch.device, seed: int) -> list[list[torch.Tensor]]:
    """One group of ``HOLDER_LAYERS`` bfloat16 KV tensors from ``seed`` (zeros for 0)."""
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(HOLDER_SHAPE, generator=generator) if seed
              else torch.zeros(HOLDER_SHAPE)).to(torch.bfloat16).to(device)
             for _ in range(HOLDER_LAYERS)]]


def ucx_node(name: str, caches: list[list[torch.Tensor]], device_memory: str | None):  # type: ignore[no-untyped-def]
    """A started raw ``UcxxTransport`` over ``caches`` (no same-host copy: the UCX path)."""
    from kvbridge.connector.loop_thread import get_loop_thread
    from kvbridge.transport import NodeMetadata, UcxxTransport

    meta = NodeMetadata.from_kv_caches(engine_id=name, kv_caches_by_group=caches,
                                       model_name="gpu-check", hash_fn_name="sha256_cbor")
    node = UcxxTransport(meta, caches, cma=False, device_memory=device_memory)
    loop = get_loop_thread()
    loop.bind(caches[0][0].device)
    loop.run(node.start(), 60)
    return node


def prefill(engine: Any, request_id: str, prompt: list[int]) -> dict[str, Any]:
    """P's half of a handoff: the prompt with ``do_remote_decode``, then one more step (the
    lease goes to P's worker half)."""
    from kvbridge.kvmanager import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1),
                       kv_transfer_params={"do_remote_decode": True})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                engine.step()
                return out.kv_transfer_params
    raise AssertionError(f"prefill {request_id} did not finish in 60 s")


def serve(conn: Any, device_name: str) -> None:
    """Child main: P's engine over UCX; commands ``("prefill", request_id, prompt)``,
    ``("holder", seed, device_memory)``, ``("threads",)``, ``("stop",)``; each answered
    ``("ok", result)`` or ``("error", text)``. P's engine steps between commands."""
    from kvbridge.connector.loop_thread import get_loop_thread

    before = {t.ident for t in threading.enumerate()}  # type: ignore[misc]
    device = device_binding.resolve_device(device_name)
    engine = make_engine(device, "ucxx", "kv_producer")
    holders = []
    conn.send(("ok", "ready"))
    try:
        while True:
            if not conn.poll(0.002):
                engine.step()
                continue
            command, *args = conn.recv()
            if command == "stop":
                return
            try:
                if command == "prefill":
                    result: Any = prefill(engine, *args)
                elif command == "holder":
                    seed, device_memory = args
                    holders.append(ucx_node(f"ucx-holder-{len(holders)}",
                                            holder_caches(device, seed), device_memory))
                    result = (tuple(holders[-1].address), holders[-1].wire_memory)
                elif command == "threads":
                    result = thread_report(device, before)
                else:
                    raise ValueError(f"unknown command {command!r}")
                conn.send(("ok", result))
            except Exception as exc:  # told to the parent, which fails its check
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for holder in holders:
            get_loop_thread().run(holder.close(), 10)
        engine.shutdown()


class Peer:
    """The child process, seen from the parent."""

    def __init__(self, device: torch.device) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, str(device)), daemon=True)
        self.process.start()
        self.call(None, timeout_s=180)  # CUDA and P's engine start

    def call(self, command: tuple | None, timeout_s: float = 60) -> Any:
        """Send ``command`` (None: only wait for the next answer) and return its result.

        Raises:
            RuntimeError: the child answered an error, died or did not answer in time.
        """
        if command is not None:
            self._conn.send(command)
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"peer process died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer process silent for {timeout_s} s on {command!r}")
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer process: {result}")
        return result

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("stop",))
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
