"""kvbridge's own checks on one CUDA GPU, with no network and no vLLM (issue 30, part 5).

Run by ``scripts/gpu_device_check.sh`` (which installs the wheels of ``.whl/`` and puts this
checkout on the path); ``--device cpu`` runs the same code paths on the CPU (the kernels under
Triton's interpreter), as ``tests/test_gpu_device_check.py`` does so this script cannot rot.
One ``PASS`` / ``FAIL`` line per check, with its figures; exit status 1 if any failed:

1. kernels: the Triton copy kernels against their torch twins (exactly equal), paged attention
   decode and prefill (within ``ATTENTION_ATOL``), compiled for the device (``TRITON_INTERPRET``
   unset on CUDA);
2. P/D on kvbridge's own engine with KV caches on the device (``ModelConfig.tiny``, seeded, no
   download): P in a second process (``gpu_device_peer``) over UCX, D and a single engine here;
   D's greedy tokens against the single engine's, every pull landed, D's first token (the pull)
   against the single engine computing the prompt itself. Without ucxx: P here, over loopback;
3. device binding: every thread the connector started, here and in the peer, ran
   ``device_binding.bind_device`` with the KV tensors' device (on CUDA,
   ``torch.cuda.current_device()`` there was its index);
4. UCX (when ``ucxx`` imports): KV blocks read from a holder in the peer process, with UCX moving
   device memory where it can, and then forced through pinned host staging as well; bytes
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

import gpu_device_peer as peer_side  # installs the recording binder (check 3) first
import torch
from kvbridge.kernels import device_binding

ATTENTION_ATOL = 1e-5
PROMPT_LENS = (31, 64, 1000)
MAX_TOKENS = 8
LOG: list[str] = []


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
        paged_attention_prefill,
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
        # distinct slots, as vLLM's slot mapping has (two tokens in one slot: either may win)
        p = torch.randperm(bs * blocks, generator=generator)[:5].tolist()
        slots = torch.tensor([p[0], p[1], -1, p[2], p[3], -1, p[4]], device=device)
        reshape_and_cache(key, key * 2, via_triton[0], slots, use_triton=True)
        reshape_and_cache(key, key * 2, via_twin[0], slots, use_triton=False)
        shape = tuple(caches[0].shape)
        assert torch.equal(via_triton[0], via_twin[0]), f"reshape_and_cache {shape}"
        exact += 4
    worst = 0.0
    for bs, heads, size, window in [(16, 2, 16, None), (16, 8, 128, None), (16, 2, 64, 6)]:
        cache = torch.randn(12, 2, bs, heads, size, generator=generator).to(device)
        tables = torch.tensor([[1, 4, 2, 0], [5, 9, 10, 0], [8, 7, 6, 3]], device=device)
        query = torch.randn(3, heads * 2, size, generator=generator).to(device)
        lens = torch.tensor([40, 3, 64], device=device)
        decode = [paged_attention_decode(query, cache, lens, tables, scale=0.3,
                                         sliding_window=window, use_triton=t)
                  for t in (True, False)]
        query = torch.randn(22, heads * 2, size, generator=generator).to(device)
        starts = torch.tensor([0, 1, 18, 22], device=device)  # query lengths 1, 17, 4
        lens = torch.tensor([1, 40, 37], device=device)
        prefill = [paged_attention_prefill(query, cache, starts, lens, tables, scale=0.3,
                                           sliding_window=window, use_triton=t)
                   for t in (True, False)]
        for via_triton, via_twin in (decode, prefill):
            assert not via_triton.isnan().any(), "NaN from the kernel"
            worst = max(worst, float((via_triton - via_twin).abs().max()))
    assert worst <= ATTENTION_ATOL, f"attention differs by {worst:.2e}"
    return (f"{exact} copy-kernel cases exactly equal; attention (decode, prefill) max |diff| "
            f"{worst:.1e}")


# ----------------------------------------------------------------------------- 2. P/D
def _run(engine, request_id, prompt, max_tokens, params=None):  # type: ignore[no-untyped-def]
    """Step until done; returns (tokens, seconds to the first token)."""
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
                return out.token_ids, first
        time.sleep(0.0005)
    raise AssertionError(f"{request_id} did not finish in 60 s")


def check_pd(device: torch.device, peer: peer_side.Peer | None) -> str:
    """P in the peer process over UCX, or (no ucxx) P here over the loopback transport."""
    from kvbridge.transport import LoopbackNetwork

    network = LoopbackNetwork()
    transport = "loopback" if peer is None else "ucxx"
    d = peer_side.make_engine(device, transport, "kv_consumer", network)
    single = peer_side.make_engine(device, transport, None)
    p = peer_side.make_engine(device, transport, "kv_producer", network) if peer is None else None

    def prefill(request_id: str, prompt: list[int]) -> dict:
        if peer is not None:
            return peer.call(("prefill", request_id, prompt))
        return peer_side.prefill(p, request_id, prompt)

    kv_device = next(iter(d.runner.kv_caches.values())).device
    assert kv_device.type == device.type, f"D's KV caches on {kv_device}"
    try:
        warm = list(range(3, 40))  # compiles the kernels before anything is timed
        _run(d, "warm-d", warm, 2, prefill("warm", warm))
        _run(single, "warm-s", [5, *warm], 2)
        figures = []
        for n in PROMPT_LENS:
            prompt = [1 + (i * 7 + n) % 250 for i in range(n)]
            want, recompute_s = _run(single, f"s{n}", prompt, MAX_TOKENS)
            got, load_s = _run(d, f"d{n}", prompt, MAX_TOKENS, prefill(f"r{n}", prompt))
            assert got == want, f"{n}-token prompt: D {got} != single {want}"
            figures.append(f"{n} tok: load {load_s * 1e3:.1f} ms vs recompute "
                           f"{recompute_s * 1e3:.1f} ms")
        stats = d.scheduler.connector.stats
        assert stats.num_failed_loads == 0, f"{stats.num_failed_loads} loads failed on D"
        assert stats.num_loads == len(PROMPT_LENS) + 1, f"D pulled {stats.num_loads} times"
        where = "P in another process" if peer is not None else "P in this process"
        return (f"over {transport} ({where}) on {kv_device}, tokens equal, "
                f"{stats.num_loads} pulls of {stats.num_blocks_received} blocks; "
                + "; ".join(figures))
    finally:
        for engine in (d, single, p):
            if engine is not None:
                engine.shutdown()


# ----------------------------------------------------------------------------- 3. binding
def check_binding(device: torch.device, before: set[int], peer: peer_side.Peer | None) -> str:
    """This process's threads (D's node, the UCX reader, an ``EngineLoop``) and the peer's."""
    from kvbridge.connector.serve.node.loop import EngineLoop

    loop = EngineLoop(peer_side.make_engine(device, "loopback", None))
    loop.start()
    time.sleep(0.2)
    checked, unbound, others = peer_side.thread_report(device, before)
    loop.stop()
    if peer is not None:
        theirs = peer.call(("threads",))
        for mine, peers in zip((checked, unbound, others), theirs, strict=True):
            mine += [f"peer {name}" for name in peers]
    assert checked, "no connector thread was started"
    want = device_binding.resolve_device(device)
    assert not unbound, f"threads not bound to {want}: {unbound}"
    names = sorted({n.rstrip("0123456789_") for n in checked})
    return (f"{len(checked)} threads bound to {want} ({', '.join(names)}); other threads "
            f"(not kvbridge's): {sorted(others) or 'none'}")


# ----------------------------------------------------------------------------- 4. UCX
def _ucx_read(device: torch.device, peer: peer_side.Peer, device_memory: str | None):  # type: ignore[no-untyped-def]
    """One read of scattered blocks from a holder in the peer process; returns
    ``(wire memory here, holder's, seconds, bytes)`` after checking every byte."""
    from kvbridge.connector.loop_thread import get_loop_thread
    from kvbridge.transport import GroupRead

    address, theirs = peer.call(("holder", 1, device_memory))
    mine = peer_side.holder_caches(device, 0)
    reader = peer_side.ucx_node("ucx-reader", mine, device_memory)
    loop = get_loop_thread()
    try:
        remote = list(range(1, 63, 2))  # scattered ids: gathers and scatters, not one run
        local = list(range(2, 2 + len(remote)))
        read = [GroupRead(group_id=0, remote_block_ids=remote, local_block_ids=local)]
        loop.run(reader.read_blocks(address, "warm", read, deadline_s=30), 60)
        started = time.perf_counter()
        result = loop.run(reader.read_blocks(address, "r", read, deadline_s=30), 60)
        seconds = time.perf_counter() - started
        assert result.failed_local_block_ids == (), result
        for want, got in zip(peer_side.holder_caches(device, 1)[0], mine[0], strict=True):
            assert torch.equal(want[remote], got[local]), "bytes differ"
        return reader.wire_memory, theirs, seconds, result.num_bytes_landed
    finally:
        loop.run(reader.close(), 10)


def check_ucx(device: torch.device, peer: peer_side.Peer) -> str:
    from kvbridge.transport.ucx_memory import ucx_context_info, ucx_memory_domains

    figures = []
    memory, theirs, seconds, nbytes = _ucx_read(device, peer, None)  # as UCX allows here
    figures.append(f"{memory} (holder {theirs}): {nbytes / seconds / 2**30:.2f} GiB/s")
    if memory == "device":  # the fallback too, forced on both sides
        memory, theirs, seconds, nbytes = _ucx_read(device, peer, "staged")
        figures.append(f"{memory} (holder {theirs}): {nbytes / seconds / 2**30:.2f} GiB/s")
    sample = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(sample)
    started = time.perf_counter()
    host.copy_(sample)
    copy_s = time.perf_counter() - started
    domains = ",".join(sorted(ucx_memory_domains(ucx_context_info())))
    return (f"{nbytes} bytes, UCX memory domains {domains}; " + ", ".join(figures)
            + f"; device-to-host copy {nbytes / copy_s / 2**30:.2f} GiB/s")


# ----------------------------------------------------------------------------- 5. marker
def check_forward_marker(device: torch.device) -> str:
    """A step's new blocks are vouched for only once the forward's kernels finished: the marker
    ``wait_for_save`` records is not done while queued work runs, done after it."""
    from kvbridge.connector.forward_marker import forward_done_marker
    from kvbridge.connector.holder import HeldBlockHashes
    from kvbridge.connector.metadata import BlockHashDelta

    held = HeldBlockHashes()
    if device.type != "cuda":
        assert forward_done_marker(device) is None
        return "CPU: no marker, the forward ran on the calling thread"
    a = torch.randn(8192, 8192, device=device)
    for _ in range(20):  # a forward still running on the stream: tens of ms of queued matmuls
        a = a @ a / 8192
    done = forward_done_marker(device)
    assert done is not None
    held.apply_stores(BlockHashDelta(stored_block_ids=[1], stored_hashes=[b"h"]), done)
    early = held.holds(1, b"h")
    torch.cuda.synchronize(device)
    assert not early, "vouched for a block while its forward was still queued"
    assert held.holds(1, b"h"), "not vouched for after the forward finished"
    return "not vouched for while the forward ran, vouched for once it finished"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--log", default=None, help="also write the full log here")
    args = parser.parse_args()
    device = device_binding.resolve_device(args.device)
    before = {t.ident for t in threading.enumerate()}  # type: ignore[misc]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    say(f"gpu_device_check on {device} ({name}), torch {torch.__version__}")
    results: list[bool] = []
    check(1, "Triton kernels against torch twins", lambda: check_kernels(device), results)
    peer = None
    try:
        import ucxx  # noqa: F401

        peer = peer_side.Peer(device)
    except ImportError as exc:
        say(f"ucxx does not import ({exc}): P/D over loopback in this process, no UCX check")
    try:
        check(2, "P/D with KV caches on the device", lambda: check_pd(device, peer), results)
        if peer is not None:
            check(4, "UCX reads of device KV blocks", lambda: check_ucx(device, peer), results)
        check(3, "connector threads bound to the KV device",
              lambda: check_binding(device, before, peer), results)
        check(5, "holder vouches for new blocks once the forward finished",
              lambda: check_forward_marker(device), results)
    finally:
        if peer is not None:
            peer.stop()
    say(f"gpu_device_check: {results.count(True)} passed, {results.count(False)} failed")
    if args.log:
        with open(args.log, "w") as log:
            log.write("\n".join(LOG) + "\n")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
