"""Store tier benchmark (issue 7), all measured in this one run on this machine:

- restore: pulling a 4,096-token prefix (256 blocks of 16 tokens) from a ``StoreNode`` into a
  node's KV tensors over the ``LoopbackTransport`` (the same read path, chunked gather/scatter and
  holder-side hash checks as a cross-node pull, minus the wire) as a ratio to recomputing the
  prefix with ``ReferenceDecoder.forward_full`` (target < 1). Model: ``ModelConfig.tiny`` widened
  to 8 layers, hidden 256, 8 heads over 4 KV heads of 32, float32 (128 KiB of KV per block
  across layers, 32 MiB per prefix) -- small enough for a 2-core CPU, large enough that the KV
  and the compute are not toy-sized.
- offload: snapshot (``gather_blocks``) of the same 256 blocks plus the put over TCP to the
  store's write server (msgpack header, raw payload; the store scatters into its tensors), in
  GB/s, as a ratio to a single-thread memcpy of 64 MiB.

Usage: ``python benchmarks/bench_store.py``; the last line is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from kvbridge.connector.loop_thread import get_loop_thread
from kvbridge.connector.offload import StoreWriter
from kvbridge.connector.store_node import StoreNode, close_store_node, start_store_node
from kvbridge.connector.store_wire import PutGroup, PutRequest
from kvbridge.kernels import ModelConfig, ReferenceDecoder, gather_blocks
from kvbridge.kernels.model import allocate_kv_caches
from kvbridge.transport import GroupRead, LoopbackNetwork, LoopbackTransport, NodeMetadata

PREFIX_TOKENS = 4096
BLOCK_SIZE = 16
NUM_BLOCKS = PREFIX_TOKENS // BLOCK_SIZE
REPEATS = 3
MIB = 1 << 20


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


def _median_s(fn, repeats: int = REPEATS) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _memcpy_gbps() -> float:
    src = torch.randn(16 * MIB)  # 64 MiB of float32
    dst = torch.empty_like(src)
    return 64 * MIB / _median_s(lambda: dst.copy_(src)) / 1e9


def main() -> None:
    torch.set_num_threads(1)
    config = _config()
    model = ReferenceDecoder(config)
    network = LoopbackNetwork()
    block_nbytes = 2 * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 4 * config.num_layers
    store = start_store_node(
        StoreNode(
            config,
            block_size=BLOCK_SIZE,
            capacity_bytes=(REPEATS + 2) * NUM_BLOCKS * block_nbytes,
            transport="loopback",
            loopback_network=network,
        )
    )
    loop = get_loop_thread()
    # The node: its KV tensors hold a prefix of random KV in blocks 1..256.
    names_to_caches = allocate_kv_caches(config, NUM_BLOCKS + 1, BLOCK_SIZE)
    caches = list(names_to_caches.values())
    for cache in caches:
        cache.normal_()
    ids = torch.arange(1, NUM_BLOCKS + 1, dtype=torch.int64)
    metadata = NodeMetadata.from_kv_caches(
        engine_id="node-0",
        kv_caches_by_group=[caches],
        model_name="kvbridge",
        hash_fn_name="sha256_cbor",
    )
    writer = StoreWriter(*store.write_address)
    round_no = [0]

    def offload() -> list[bytes]:
        round_no[0] += 1
        hashes = [round_no[0].to_bytes(4, "big") + i.to_bytes(28, "big") for i in range(NUM_BLOCKS)]
        staging = gather_blocks(caches, ids)
        put = PutRequest(
            compat_hash=metadata.compat_hash,
            groups=(
                PutGroup(
                    group_id=0,
                    block_hashes=tuple(hashes),
                    parent_hashes=(b"", *hashes[:-1]),
                    nbytes=staging.numel() * staging.element_size(),
                ),
            ),
        )
        view = memoryview(staging.numpy()).cast("B")
        reply = loop.run(writer.put(put, [view]), 60)
        assert reply.num_stored == NUM_BLOCKS, reply
        return hashes

    offload_s = _median_s(offload)
    hashes = offload()
    store_ids = [store.cache.block_id_of(0, h) for h in hashes]

    # Restore into a second node's tensors through the transport.
    target = [torch.zeros_like(c) for c in caches]
    node = LoopbackTransport(metadata, [target], network=network)
    loop.run(node.start(), 10)
    read = GroupRead(
        group_id=0,
        remote_block_ids=store_ids,  # type: ignore[arg-type]
        local_block_ids=list(range(1, NUM_BLOCKS + 1)),
        expected_hashes=hashes,
    )

    def restore() -> None:
        result = loop.run(node.read_blocks(store.address, "bench", [read], deadline_s=60), 60)
        assert result.ok and result.num_blocks_landed == NUM_BLOCKS

    restore_s = _median_s(restore)
    assert all(torch.equal(t[1:], c[1:]) for t, c in zip(target, caches, strict=True))
    token_ids = torch.randint(0, config.vocab_size, (PREFIX_TOKENS,))
    with torch.inference_mode():
        recompute_s = _median_s(lambda: model.forward_full(token_ids), repeats=1)
    memcpy = _memcpy_gbps()
    offload_gbps = NUM_BLOCKS * block_nbytes / offload_s / 1e9
    loop.run(node.close(), 10)
    loop.run(writer.close(), 10)
    close_store_node(store)

    print(f"model: tiny widened ({config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_kv_heads} KV heads x {config.head_dim}), {block_nbytes // 1024} KiB/block")
    print(f"restore {PREFIX_TOKENS} tokens from store:  {restore_s * 1e3:8.2f} ms")
    print(f"recompute (forward_full):           {recompute_s * 1e3:8.2f} ms")
    print(f"offload {NUM_BLOCKS} blocks:                {offload_s * 1e3:8.2f} ms "
          f"= {offload_gbps:.2f} GB/s")
    print(f"memcpy 64 MiB (1 thread):           {memcpy:8.2f} GB/s")
    print(
        json.dumps(
            {
                "prefix_tokens": PREFIX_TOKENS,
                "restore_ms": round(restore_s * 1e3, 3),
                "recompute_ms": round(recompute_s * 1e3, 3),
                "restore_vs_recompute": round(restore_s / recompute_s, 4),
                "offload_gb_per_s": round(offload_gbps, 3),
                "memcpy_gb_per_s": round(memcpy, 3),
                "offload_vs_memcpy": round(offload_gbps / memcpy, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
