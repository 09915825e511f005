"""Builders for transport tests and the holder process the UCX tests start.

``make_kv_caches(seed=...)`` builds deterministic KV tensors, so a requester can rebuild the
holder's tensors locally and compare bytes without shipping them between processes.

Run as a script, it starts a ``UcxxTransport`` holder, prints ``PORT <n>`` and serves until its
stdin closes::

    python tests/_transport_helpers.py --seed 1 [--block-size 16] [--chunk-delay-s 0.2]
        [--layers-per-group 1,2] [--evict-after-check 0:30 ...]

Its ``block_validator`` accepts the expected hash ``b"{group_id}:{block_id}"`` only, and an empty
one only under the read's lease ``HELPER_LEASE`` (a block without a hash); its ``lease_pending``
says only ``PENDING_LEASE`` may yet be granted (a read refused under it may be asked again,
any other refusal is final). A block named
by ``--evict-after-check GROUP:BLOCK`` passes the first check that sees it and is "evicted"
right after (as if the holder's engine reused it between the check and the gather), so every
later check fails it: the holder's re-check after the copy must catch it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import torch
from kvbridge.transport import BlockIdentity, BlockValidator, LeaseRef, NodeMetadata

NUM_BLOCKS = 64
HELPER_LEASE = LeaseRef(request_id="p-" + "x" * 198, token="tok-helper")
"""The one lease the helper validators honour (a 200-byte request id: longer than any hash)."""
PENDING_LEASE = LeaseRef(request_id="p-not-granted-yet", token="tok-helper")
"""A lease the helper holder has not been handed yet: refused, with ``ReadOk.lease_pending``."""
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


def make_metadata(
    engine_id: str, kv_caches_by_group: list[list[torch.Tensor]], **identity: str
) -> NodeMetadata:
    """Metadata of the tensors under model ``tiny-llama``, hash ``sha256_cbor``; ``identity``:
    other block identity fields (``model_revision``, ``kv_cache_dtype``, ``kv_layout``, or
    those two names)."""
    return NodeMetadata.from_kv_caches(
        engine_id=engine_id,
        kv_caches_by_group=kv_caches_by_group,
        **{"model_name": "tiny-llama", "hash_fn_name": "sha256_cbor", **identity},
    )


def caches_and_metadata(
    engine_id: str, identity: BlockIdentity, *, seed: int
) -> tuple[list[list[torch.Tensor]], NodeMetadata]:
    """``make_kv_caches(seed=seed)`` (bfloat16) of ``identity.block_size`` and their metadata
    under every other field of ``identity`` (its ``kv_cache_dtype`` may name another dtype
    than the tensors', as vLLM's fp8 caches in ``uint8`` tensors do)."""
    caches = make_kv_caches(seed=seed, block_size=identity.block_size)
    fields = {name: value for name, value in identity.as_items() if name != "block_size"}
    return caches, NodeMetadata.from_kv_caches(
        engine_id=engine_id, kv_caches_by_group=caches, **fields
    )


def make_hash_validator(
    evict_after_check: set[tuple[int, int]], *, by_lease: bool = False
) -> BlockValidator:
    """The holder's validator: hash ``b"{group_id}:{block_id}"``; blocks ``(group_id, block_id)``
    in ``evict_after_check`` lose their hash once a check has seen them. ``by_lease``: the
    ``lease_validator`` of a copy-first read, which also needs ``HELPER_LEASE`` for a block
    with a hash (the connector's ``HolderChecks.validate_by_lease``)."""
    evicted: set[tuple[int, int]] = set()

    def validate(
        group_id: int, block_ids: list[int], expected: list[bytes], lease: LeaseRef | None
    ) -> list[int]:
        def holds(block_id: int, expected_hash: bytes) -> bool:
            needs_lease = not expected_hash or by_lease  # the read's lease vouches for it
            if needs_lease and lease != HELPER_LEASE:
                return False
            if not expected_hash:
                return True
            return expected_hash == f"{group_id}:{block_id}".encode()

        bad = [
            i
            for i, (b, h) in enumerate(zip(block_ids, expected, strict=True))
            if not holds(b, h) or (group_id, b) in evicted
        ]
        evicted.update((group_id, b) for b in block_ids if (group_id, b) in evict_after_check)
        return bad

    return validate


async def _serve(args: argparse.Namespace) -> None:
    import kvbridge.transport.ucx_serve as ucx_serve
    from kvbridge.transport import UcxxTransport

    if args.chunk_delay_s > 0:  # a slow holder, so a test can kill it mid-transfer
        real_copy_out = ucx_serve.copy_out

        def slow_copy_out(*a, **kw):  # type: ignore[no-untyped-def]
            import time

            time.sleep(args.chunk_delay_s)
            return real_copy_out(*a, **kw)

        ucx_serve.copy_out = slow_copy_out
    layers_per_group = tuple(int(n) for n in args.layers_per_group.split(","))
    caches = make_kv_caches(
        seed=args.seed, block_size=args.block_size, layers_per_group=layers_per_group
    )
    auth_key = args.auth_key.encode() if args.auth_key else None
    transport = UcxxTransport(make_metadata(f"holder-{args.seed}", caches), caches, port=0,
                              auth_key=auth_key)
    evict_after_check = set(args.evict_after_check)
    transport.set_callbacks(
        block_validator=make_hash_validator(evict_after_check),
        lease_validator=make_hash_validator(evict_after_check, by_lease=True),
        lease_pin=lambda lease, seconds: lease == HELPER_LEASE,
        lease_unpin=lambda lease: None,
        lease_pending=lambda lease: lease == PENDING_LEASE,
    )
    await transport.start()
    print(f"PORT {transport.address.port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await transport.close()


def _group_block(text: str) -> tuple[int, int]:
    """``"GROUP:BLOCK"`` -> ``(group_id, block_id)``."""
    group_id, block_id = text.split(":")
    return int(group_id), int(block_id)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-delay-s", type=float, default=0.0)
    parser.add_argument("--layers-per-group", default=",".join(map(str, LAYERS_PER_GROUP)))
    parser.add_argument("--evict-after-check", type=_group_block, action="append", default=[])
    parser.add_argument("--auth-key", default="", help="the cluster key (none: no auth)")
    asyncio.run(_serve(parser.parse_args()))
