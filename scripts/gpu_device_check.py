"""kvbridge's own checks on one CUDA GPU, with no network and no vLLM (issue 30, part 5).

Run by ``scripts/gpu_device_check.sh`` (which installs the wheels of ``.whl/`` and puts this
checkout on the path); ``--device cpu`` runs the same code paths on the CPU (the kernels under
Triton's interpreter), as ``tests/test_gpu_device_check.py`` does so this script cannot rot.
One ``PASS`` / ``FAIL`` line per check, with its figures; exit status 1 if any failed:

1. kernels: the Triton copy kernels against their torch twins (exactly equal), paged attention
   (within ``ATTENTION_ATOL``), compiled for the device (``TRITON_INTERPRET`` unset on CUDA);
2. P/D on kvbridge's own engine with KV caches on the device (``ModelConfig.tiny``, seeded, no
   download): D's greedy tokens against a single engine's, D's first token (the pull) against
   a single engine computing the prompt itself;
3. device binding: every thread the connector started ran ``device_binding.bind_device`` with
   the KV tensors' device (and, on CUDA, ``torch.cuda.current_device()`` there was its index);
4. UCX (when ``ucxx`` imports): KV blocks read between two ``UcxxTransport`` with UCX moving
   device memory where it can and through pinned host staging (both when it can), bytes
   equal, throughput against a plain device-to-host copy of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
from kvbridge.kernels import device_binding

ATTENTION_ATOL = 1e-5
PROMPT_LENS = (31, 64, 1000)
MAX_TOKENS = 8
BLOCK_SIZE = 16
LOG: list[str] = []
BOUND: dict[int, tuple[str, torch.device, int | None]] = {}  # thread ident -> binding seen

_real_bind = device_binding.bind_device


def _recording_bind(device: torch.device) -> None:
    """``bind_device`` as it is, recording which thread bound what (check 3)."""
    _real_bind(device)
    current = torch.cuda.current_device() if device.type == "cuda" else None
    BOUND[threading.get_ident()] = (threading.current_thread().name, device, current)


device_binding.bind_device = _recording_bind  # before any connector thread starts


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def check(number: int, name: str, fn: Callable[[], str], results: list[bool]) -> None:
    """Run one check: ``fn`` returns its figures or raises (AssertionError: FAIL)."""
    started = time.perf_counter()
    try:
        figures = fn()
        ok = True
    except Exception as exc:  # a check that crashed failed; the others still run
        figures = f"{type(exc).__name__}: {exc}"
        LOG.append(traceback.format_exc())
        ok = False
    took = time.perf_counter() - started
    say(f"{'PASS' if ok else 'FAIL'} {number}. {name}: {figures} ({took:.1f} s)")
    results.append(ok)


# ----------------------------------------------------------------------------- 1. kernels
def check_kernels(device: torch.device) -> str:
    from kvbridge.kernels import (
        copy_blocks,
        gather_blocks,
        paged_attention_decode,
        reshape_and_cache,
        scatter_blocks,
    )

    if device.type == "cuda":
        assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "TRITON_INTERPRET is set"
    generator = torch.Generator().manual_seed(0)
    exact = 0
    for layers, blocks, bs, heads, size, dtype in [
        (1, 5, 1, 1, 1, torch.float32), (3, 11, 3, 3, 5, torch.float32),
        (2, 64, 16, 8, 128, torch.bfloat16), (2, 33, 16, 2, 64, torch.float16),
    ]:
        caches = [torch.randn(blocks, 2, bs, heads, size, generator=generator).to(dtype)
                  .to(device) for _ in range(layers)]
        ids = torch.randperm(blocks - 1, generator=generator)[: blocks // 2].add(1).to(device)
        staging = gather_blocks(caches, ids, use_triton=True)
        assert torch.equal(staging, gather_blocks(caches, ids, use_triton=False)), "gather"
        via_triton, via_twin = [c.clone() for c in caches], [c.clone() for c in caches]
        new = torch.randn(staging.shape, generator=generator).to(dtype).to(device)
        scatter_blocks(new, via_triton, ids, use_triton=True)
        scatter_blocks(new, via_twin, ids, use_triton=False)
        assert all(map(torch.equal, via_triton, via_twin)), "scatter"
        mapping = torch.tensor([[1, blocks - 1]], device=device)
        copy_blocks(via_triton, mapping, use_triton=True)
        copy_blocks(via_twin, mapping, use_triton=False)
        assert all(map(torch.equal, via_triton, via_twin)), "copy_blocks"
        key = torch.randn(7, heads, size, generator=generator).to(dtype).to(device)
        slots = torch.tensor([0, 3, -1, bs * 2, bs * 2 + 1, -1, bs * blocks - 1], device=device)
        reshape_and_cache(key, key * 2, via_triton[0], slots, use_triton=True)
        reshape_and_cache(key, key * 2, via_twin[0], slots, use_triton=False)
        assert torch.equal(via_triton[0], via_twin[0]), "reshape_and_cache"
        exact += 4
    worst = 0.0
    for bs, heads, size in [(16, 2, 16), (16, 8, 128)]:
        cache = torch.randn(9, 2, bs, heads, size, generator=generator).to(device)
        query = torch.randn(3, heads * 2, size, generator=generator).to(device)
        tables = torch.tensor([[1, 4, 2, 0], [5, 0, 0, 0], [8, 7, 6, 3]], device=device)
        lens = torch.tensor([40, 3, 64], device=device)
        out = [paged_attention_decode(query, cache, lens, tables, scale=0.3, use_triton=t)
               for t in (True, False)]
        worst = max(worst, float((out[0] - out[1]).abs().max()))
    assert worst <= ATTENTION_ATOL, f"attention differs by {worst:.2e}"
    return f"{exact} copy-kernel cases exactly equal; attention max |diff| {worst:.1e}"


# ----------------------------------------------------------------------------- 2. P/D
def _engines(device: torch.device, transport: str):  # type: ignore[no-untyped-def]
    from kvbridge.connector.factory import create_engine
    from kvbridge.kernels.model import ModelConfig, ReferenceDecoder
    from kvbridge.kvmanager.engine import Engine, EngineConfig
    from kvbridge.transport import LoopbackNetwork

    model = ReferenceDecoder(ModelConfig.tiny())
    config = EngineConfig(num_blocks=512, block_size=BLOCK_SIZE, max_model_len=1200,
                          max_num_batched_tokens=1200, device=str(device))
    network = LoopbackNetwork()

    def node(engine_id: str, role: str) -> Engine:
        extra = {"transport": transport, "load_timeout_s": 30.0, "heartbeat_interval_s": 0.5}
        if transport == "ucxx":
            extra.update(host="127.0.0.1", port=0, cma=False)
        return create_engine(model, config, {"kv_role": role, "engine_id": engine_id,
                                             "kv_connector_extra_config": extra},
                             loopback_network=network)

    return node("gpu-p", "kv_producer"), node("gpu-d", "kv_consumer"), Engine(model, config)


def _run(engine, request_id, prompt, max_tokens, params=None):  # type: ignore[no-untyped-def]
    """Step until done; returns (tokens, seconds to the first token, kv_transfer_params)."""
    from kvbridge.kvmanager import SamplingParams

    started, first = time.perf_counter(), None
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens), params)
    deadline = started + 60
    while time.perf_counter() < deadline:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if first is None and out.new_token_ids:
                first = time.perf_counter() - started
            if out.finished:
                return out.token_ids, first, out.kv_transfer_params
        time.sleep(0.0005)
    raise AssertionError(f"{request_id} did not finish in 60 s")


def check_pd(device: torch.device, transport: str) -> str:
    p, d, single = _engines(device, transport)
    kv_device = next(iter(d.runner.kv_caches.values())).device
    assert kv_device.type == device.type, f"D's KV caches on {kv_device}"
    try:
        warm = list(range(3, 40))
        params = _run(p, "warm-p", warm, 1, {"do_remote_decode": True})[2]
        p.step()
        _run(d, "warm-d", warm, 2, params)
        _run(single, "warm-s", [5, *warm], 2)
        figures = []
        for n in PROMPT_LENS:
            prompt = [1 + (i * 7 + n) % 250 for i in range(n)]
            want, recompute_s, _ = _run(single, f"s{n}", prompt, MAX_TOKENS)
            params = _run(p, f"p{n}", prompt, 1, {"do_remote_decode": True})[2]
            p.step()
            got, load_s, _ = _run(d, f"d{n}", prompt, MAX_TOKENS, params)
            assert got == want, f"{n}-token prompt: D {got} != single {want}"
            figures.append(f"{n} tok: load {load_s * 1e3:.1f} ms vs recompute "
                           f"{recompute_s * 1e3:.1f} ms")
        return f"over {transport} on {kv_device}, tokens equal; " + "; ".join(figures)
    finally:
        for engine in (d, p, single):
            engine.shutdown()


# ----------------------------------------------------------------------------- 3. binding
NOT_KV_THREADS = ("kvbridge-index", "asyncio_")
"""Name prefixes of threads that never touch KV tensors (index calls, asyncio's resolver)."""


def check_binding(device: torch.device, before: set[int]) -> str:
    from kvbridge.connector.serve.node.loop import EngineLoop
    from kvbridge.kernels.model import ModelConfig
    from kvbridge.kvmanager.engine import Engine, EngineConfig

    config = EngineConfig(num_blocks=64, max_model_len=256, device=str(device))
    engine = Engine(ModelConfig.tiny(), config)
    loop = EngineLoop(engine)
    loop.start()
    time.sleep(0.2)
    started = [t for t in threading.enumerate() if t.ident not in before]
    loop.stop()
    want = device_binding.resolve_device(device)
    unbound, checked = [], []
    for thread in started:
        if thread.name.startswith(NOT_KV_THREADS):
            continue
        seen = BOUND.get(thread.ident)  # type: ignore[arg-type]
        if seen is None or seen[1] != want or (want.type == "cuda" and seen[2] != want.index):
            unbound.append(f"{thread.name}: {seen}")
        checked.append(thread.name)
    assert checked, "no connector thread was started"
    assert not unbound, f"threads not bound to {want}: {unbound}"
    names = sorted({n.rstrip("0123456789_") for n in checked})
    return f"{len(checked)} threads bound to {want} ({', '.join(names)})"


# ----------------------------------------------------------------------------- 4. UCX
async def _ucx_read(device: torch.device, device_memory: str | None) -> tuple[str, float, int]:
    from kvbridge.transport import GroupRead, NodeMetadata, UcxxTransport

    generator = torch.Generator().manual_seed(4)
    shape = (64, 2, BLOCK_SIZE, 8, 128)  # 64 KiB blocks (bfloat16)

    def caches(seed: int) -> list[list[torch.Tensor]]:
        return [[(torch.randn(shape, generator=generator) if seed else torch.zeros(shape))
                 .to(torch.bfloat16).to(device) for _ in range(4)]]

    held, mine = caches(1), caches(0)
    nodes = []
    for name, kv in (("ucx-holder", held), ("ucx-reader", mine)):
        meta = NodeMetadata.from_kv_caches(engine_id=name, kv_caches_by_group=kv,
                                           model_name="gpu-check", hash_fn_name="sha256_cbor")
        nodes.append(UcxxTransport(meta, kv, cma=False, device_memory=device_memory))
    for node in nodes:
        await node.start()
    try:
        remote = list(range(1, 63, 2))  # scattered ids: gathers and scatters, not one run
        local = list(range(2, 2 + len(remote)))
        read = [GroupRead(group_id=0, remote_block_ids=remote, local_block_ids=local)]
        await nodes[1].read_blocks(nodes[0].address, "warm", read, deadline_s=30)
        started = time.perf_counter()
        result = await nodes[1].read_blocks(nodes[0].address, "r", read, deadline_s=30)
        seconds = time.perf_counter() - started
        for a, b in zip(held[0], mine[0], strict=True):
            assert torch.equal(a[remote], b[local]), "bytes differ"
        assert result.failed_local_block_ids == ()
        return str(nodes[1].wire_memory), seconds, result.num_bytes_landed
    finally:
        for node in nodes:
            await node.close()


def check_ucx(device: torch.device) -> str:
    from kvbridge.connector.loop_thread import get_loop_thread
    from kvbridge.transport.ucx_memory import ucx_context_info, ucx_memory_domains

    loop = get_loop_thread()  # the connector's own loop, as in a node
    loop.bind(device)
    figures = []
    memory, seconds, nbytes = loop.run(_ucx_read(device, None), 120)  # as UCX allows here
    figures.append(f"{memory}: {nbytes / seconds / 2**30:.2f} GiB/s")
    if memory == "device":  # the fallback too, forced
        memory, seconds, nbytes = loop.run(_ucx_read(device, "staged"), 120)
        figures.append(f"{memory}: {nbytes / seconds / 2**30:.2f} GiB/s")
    sample = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(sample)
    started = time.perf_counter()
    host.copy_(sample)
    copy_s = time.perf_counter() - started
    domains = ",".join(sorted(ucx_memory_domains(ucx_context_info())))
    return (f"{nbytes} bytes, UCX memory domains {domains}; " + ", ".join(figures)
            + f"; device-to-host copy {nbytes / copy_s / 2**30:.2f} GiB/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--log", default=None, help="also write the full log here")
    args = parser.parse_args()
    device = device_binding.resolve_device(args.device)
    before = {t.ident for t in threading.enumerate()}  # type: ignore[misc]
    try:
        import ucxx  # noqa: F401
        transport = "ucxx"
    except ImportError as exc:
        transport = "loopback"
        say(f"ucxx does not import ({exc}): P/D over loopback, no UCX check")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    say(f"gpu_device_check on {device} ({name}), torch {torch.__version__}")
    results: list[bool] = []
    check(1, "Triton kernels against torch twins", lambda: check_kernels(device), results)
    check(2, "P/D with KV caches on the device", lambda: check_pd(device, transport), results)
    if transport == "ucxx":
        check(4, "UCX reads of device KV blocks", lambda: check_ucx(device), results)
    check(3, "connector threads bound to the KV device",
          lambda: check_binding(device, before), results)
    say(f"gpu_device_check: {results.count(True)} passed, {results.count(False)} failed")
    if args.log:
        with open(args.log, "w") as log:
            log.write("\n".join(LOG) + "\n")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
