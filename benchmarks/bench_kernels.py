"""Benchmark of the kernels' CPU paths: gather/scatter bandwidth and reference prefill speed.

Gather/scatter: one request's worth of paged KV (``TOTAL_BYTES`` over ``NUM_LAYERS`` layers) in
blocks of 4, 16 and 64 KiB at random, distinct block ids, moved between the KV caches and a
contiguous staging buffer by ``gather_blocks`` / ``scatter_blocks`` (torch twin). The baseline is
a contiguous copy of the same number of bytes measured in the same run; the figures are ratios
``baseline_seconds / op_seconds`` (1.0 = as fast as a plain memcpy; target >= 0.6 at 16 KiB and
above; docs/architecture.md, "Performance targets"). Times are the median of ``REPEATS`` runs.

Prefill: tokens per second of ``ReferenceDecoder.forward`` (paged, one request, chunks of
``PREFILL_CHUNK`` tokens) on the tiny hybrid config, and of ``forward_full`` on the same prompt.

The last line printed is one JSON object with every figure.

    python benchmarks/bench_kernels.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _report import add_markdown_option, finish
from kvbridge.kernels import AttentionMetadata, gather_blocks, host_zeros, scatter_blocks
from kvbridge.kernels.model import (
    ModelConfig,
    ReferenceDecoder,
    allocate_kv_caches,
    layer_names_by_type,
)

TOTAL_BYTES = 32 * 1024 * 1024
NUM_LAYERS = 4
BLOCK_KIB = (4, 16, 64)
POOL_FACTOR = 4  # the KV cache holds POOL_FACTOR times the blocks moved
REPEATS = 9
PREFILL_TOKENS = 1024
PREFILL_CHUNK = 256
PREFILL_BLOCK_SIZE = 16


def _median_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm-up: page faults, allocator
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_gather_scatter(block_kib: int, generator: torch.Generator) -> dict[str, float]:
    """Ratios of gather and scatter to a contiguous copy for blocks of ``block_kib`` KiB."""
    block_size, num_kv_heads = 16, 8
    head_size = block_kib * 1024 // (2 * block_size * num_kv_heads * 4)  # float32
    num_blocks_moved = TOTAL_BYTES // (NUM_LAYERS * block_kib * 1024)
    num_blocks = POOL_FACTOR * num_blocks_moved
    # Every buffer on the memory the engine and the transport use (kernels/host_memory.py:
    # huge pages), so the op and its baseline see the same page size.
    shape = (num_blocks, 2, block_size, num_kv_heads, head_size)
    kv_caches = [
        host_zeros(shape, torch.float32).copy_(torch.randn(shape, generator=generator))
        for _ in range(NUM_LAYERS)
    ]
    block_ids = torch.randperm(num_blocks, generator=generator)[:num_blocks_moved]
    staging_shape = (NUM_LAYERS, num_blocks_moved, *shape[1:])
    staging = host_zeros(staging_shape, torch.float32)
    gather_blocks(kv_caches, block_ids, staging)
    source = host_zeros(staging_shape, torch.float32).copy_(
        torch.randn(staging_shape, generator=generator)
    )
    target = host_zeros(staging_shape, torch.float32)

    contiguous_s = _median_seconds(lambda: target.copy_(source))
    gather_s = _median_seconds(lambda: gather_blocks(kv_caches, block_ids, staging))
    scatter_s = _median_seconds(lambda: scatter_blocks(staging, kv_caches, block_ids))
    gib = TOTAL_BYTES / 2**30
    return {
        "block_kib": block_kib,
        "contiguous_gib_s": gib / contiguous_s,
        "gather_gib_s": gib / gather_s,
        "scatter_gib_s": gib / scatter_s,
        "gather_ratio": contiguous_s / gather_s,
        "scatter_ratio": contiguous_s / scatter_s,
    }


def bench_prefill() -> dict[str, float]:
    """Prefill tokens/s of the paged forward (chunked) and of ``forward_full``."""
    config = ModelConfig.tiny_hybrid()
    model = ReferenceDecoder(config)
    generator = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, 256, (PREFILL_TOKENS,), generator=generator)
    num_req_blocks = PREFILL_TOKENS // PREFILL_BLOCK_SIZE
    kv_caches = allocate_kv_caches(config, num_req_blocks + 1, PREFILL_BLOCK_SIZE)
    physical = torch.randperm(num_req_blocks, generator=generator) + 1  # skip null block 0
    block_table = physical[None].to(torch.int32)
    groups = layer_names_by_type(config)

    def paged_prefill() -> None:
        for start in range(0, PREFILL_TOKENS, PREFILL_CHUNK):
            positions = torch.arange(start, start + PREFILL_CHUNK)
            slots = physical[positions // PREFILL_BLOCK_SIZE] * PREFILL_BLOCK_SIZE + (
                positions % PREFILL_BLOCK_SIZE
            )
            attn_metadata = {}
            for layer_type, names in groups.items():
                metadata = AttentionMetadata(
                    query_start_loc=torch.tensor([0, PREFILL_CHUNK]),
                    seq_lens=torch.tensor([start + PREFILL_CHUNK]),
                    block_table=block_table,
                    slot_mapping=slots,
                    block_size=PREFILL_BLOCK_SIZE,
                    sliding_window=config.sliding_window
                    if layer_type == "sliding_attention"
                    else None,
                )
                attn_metadata.update(dict.fromkeys(names, metadata))
            model(token_ids[start : start + PREFILL_CHUNK], positions, kv_caches, attn_metadata)

    paged_s = _median_seconds(paged_prefill, repeats=3)
    full_s = _median_seconds(lambda: model.forward_full(token_ids), repeats=3)
    return {
        "prefill_tokens": PREFILL_TOKENS,
        "paged_prefill_tokens_s": PREFILL_TOKENS / paged_s,
        "full_prefill_tokens_s": PREFILL_TOKENS / full_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_markdown_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    result: dict[str, object] = {
        "total_mib": TOTAL_BYTES // 2**20,
        "num_layers": NUM_LAYERS,
        "torch_threads": 1,
    }
    for block_kib in BLOCK_KIB:
        figures = bench_gather_scatter(block_kib, generator)
        print(
            f"{block_kib:3d} KiB blocks: contiguous {figures['contiguous_gib_s']:.2f} GiB/s, "
            f"gather {figures['gather_gib_s']:.2f} GiB/s (ratio {figures['gather_ratio']:.2f}), "
            f"scatter {figures['scatter_gib_s']:.2f} GiB/s (ratio {figures['scatter_ratio']:.2f})"
        )
        for key in ("gather_ratio", "scatter_ratio", "gather_gib_s", "scatter_gib_s",
                    "contiguous_gib_s"):
            result[f"{key}_{block_kib}k"] = round(figures[key], 3)
    prefill = bench_prefill()
    print(
        f"prefill {prefill['prefill_tokens']} tokens (tiny_hybrid): paged "
        f"{prefill['paged_prefill_tokens_s']:.0f} tokens/s, full "
        f"{prefill['full_prefill_tokens_s']:.0f} tokens/s"
    )
    result.update({key: round(value, 1) for key, value in prefill.items()})
    finish(result, name="kernels", title="Gather/scatter and prefill on the CPU path",
           markdown=args.markdown)


if __name__ == "__main__":
    main()
