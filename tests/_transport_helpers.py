"""Builders for transport tests and the holder process the UCX tests start.

``make_kv_caches(seed=...)`` builds deterministic KV tensors, so a requester can rebuild the
holder's tensors locally and compare bytes without shipping them between processes.

Run as a script, it starts a ``UcxxTransport`` holder, prints ``PORT <n>`` and serves until its
stdin closes::

    python tests/_transport_helpers.py --seed 1 [--block-size 16] [--chunk-delay-s 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import torch
from kvbridge.transport import NodeMetadata

NUM_BLOCKS = 64
LAYERS_PER_GROUP = (3, 2)  # group 0: full attention layers, group 1: sliding window layers


def make_kv_caches(
    *,
    seed: int,
    num_blocks: int = NUM_BLOCKS,
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_size: int = 8,
    layers_per_group: tuple[int, ...] = LAYERS_PER_GROUP,
    dtype: torch.dtype = torch.bfloat16,
) -> list[list[torch.Tensor]]:
    """``[group][layer]`` KV tensors filled from ``seed`` (zeros when seed is 0)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, block_size, num_kv_heads, head_size)
    return [
        [
            torch.zeros(shape, dtype=dtype)
            if seed == 0
            else torch.randn(shape, generator=generator).to(dtype)
            for _ in range(num_layers)
        ]
        for num_layers in layers_per_group
    ]


def make_metadata(engine_id: str, kv_caches_by_group: list[list[torch.Tensor]]) -> NodeMetadata:
    return NodeMetadata.from_kv_caches(
        engine_id=engine_id,
        kv_caches_by_group=kv_caches_by_group,
        model_name="tiny-llama",
        hash_fn_name="sha256_cbor",
    )


async def _serve(args: argparse.Namespace) -> None:
    import kvbridge.transport.ucxx_holder as holder_module
    from kvbridge.transport import UcxxTransport

    if args.chunk_delay_s > 0:  # a slow holder, so a test can kill it mid-transfer
        real_copy_out = holder_module.copy_out

        def slow_copy_out(*a, **kw):  # type: ignore[no-untyped-def]
            import time

            time.sleep(args.chunk_delay_s)
            return real_copy_out(*a, **kw)

        holder_module.copy_out = slow_copy_out
    caches = make_kv_caches(seed=args.seed, block_size=args.block_size)
    transport = UcxxTransport(make_metadata(f"holder-{args.seed}", caches), caches, port=0)
    transport.set_callbacks(
        block_validator=lambda group_id, block_ids, expected: [
            i
            for i, (b, h) in enumerate(zip(block_ids, expected, strict=True))
            if h != f"{group_id}:{b}".encode()
        ]
    )
    await transport.start()
    print(f"PORT {transport.address.port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await transport.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-delay-s", type=float, default=0.0)
    asyncio.run(_serve(parser.parse_args()))
