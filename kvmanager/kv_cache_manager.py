"""``KVCacheManager``: the scheduler's narrow interface to KV block ownership (seed 000, "第一层").

It answers two questions per request: which prefix is already cached (``get_computed_blocks``)
and can this step's tokens get slots (``allocate_slots``, all-or-nothing). Hashes of full blocks
are published by ``cache_blocks``; ``free`` returns a request's blocks. Mirrors
vllm/v1/core/kv_cache_manager.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .block_hash import BlockHash, HashFn, get_hash_fn_by_name, get_request_block_hasher
from .coordinator import get_kv_cache_coordinator
from .integrity import check_manager_integrity
from .kv_cache_block import KVCacheBlock
from .kv_cache_spec import KVCacheConfig
from .kv_events import KVCacheEvent
from .request import Request

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of one request: ``blocks[group_id]`` is that group's list, in table order."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group (null positions read 0)."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the first group's blocks that have no hash (single-group helper: ValueError
        with more than one group)."""
        if len(self.blocks) != 1:
            raise ValueError(f"only defined for one group, have {len(self.blocks)}")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        if len(self.blocks) != len(other.blocks):
            raise ValueError(f"group counts differ: {len(self.blocks)} vs {len(other.blocks)}")
        return KVCacheBlocks(
            tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def num_blocks(self) -> int:
        """Total blocks over all groups (null positions included)."""
        return sum(len(group) for group in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``make_prefix_cache_stats``.

    ``queries`` and ``hits`` are in tokens. Requests that were preempted before are counted
    separately (their re-lookup would inflate the hit rate). ``reset`` is True when the cache was
    cleared in the interval.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one lookup of ``num_tokens`` tokens that hit ``num_hits`` (mutates the
        counters; ``preempted`` picks the separate set)."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` in tokens over non-preempted requests; 0.0 with no query."""
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block ownership of one node.

    Args:
        kv_cache_config: the groups and ``num_blocks`` (block 0 is the null block).
        max_model_len: longest sequence, in tokens.
        enable_caching: automatic prefix caching on/off.
        hash_block_size: token granularity of request block hashes; default: gcd of the groups'
            block sizes. Must divide every group's block size (ValueError otherwise).
        enable_kv_cache_events: record BlockStored/BlockRemoved/AllBlocksCleared.
        hash_fn: name of the block hash function ("sha256_cbor", "sha256", "xxhash_cbor").
        log_stats: keep ``prefix_cache_stats``.
        kv_event_medium: ``medium`` field of recorded events.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        hash_block_size: int | None = None,
        enable_kv_cache_events: bool = False,
        hash_fn: str = "sha256_cbor",
        log_stats: bool = True,
        kv_event_medium: str | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        if hash_block_size is None:
            hash_block_size = math.gcd(*block_sizes)
        bad = [bs for bs in block_sizes if bs % hash_block_size]
        if hash_block_size < 1 or bad:
            raise ValueError(
                f"hash_block_size {hash_block_size} must divide every block size {block_sizes}"
            )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.hash_fn_name = hash_fn
        self.hash_fn: HashFn = get_hash_fn_by_name(hash_fn)
        self.num_kv_cache_groups = len(block_sizes)
        # One block size when all groups agree; otherwise the hash granularity.
        self.block_size = block_sizes[0] if len(set(block_sizes)) == 1 else hash_block_size
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            kv_event_medium,
        )
        self.block_pool = self.coordinator.block_pool
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in block_sizes))

    # -- helpers for callers --------------------------------------------------------------------
    @property
    def request_block_hasher(self) -> Callable[[Request], list[BlockHash]]:
        """A block hasher matching this manager (pass it to ``Request(block_hasher=...)``)."""
        return get_request_block_hasher(self.hash_block_size, self.hash_fn)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        """Blocks on the free queue, cached ones included (the null block never counts)."""
        return self.block_pool.get_num_free_blocks()

    def create_empty_block_list(self) -> KVCacheBlocks:
        """A ``KVCacheBlocks`` with an empty list per group."""
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones (None if off)."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # -- prefix hits ----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of ``request``: (hit blocks per group, hit length in tokens).

        Empty when caching is off or ``request.skip_reading_prefix_cache``. The hit is capped at
        ``num_tokens - 1`` (the last token is recomputed to get logits) and block aligned, so a
        fully cached 32-token prompt with block size 16 hits 16 tokens (seed 001, section 2).
        Does not touch the blocks (``allocate_slots`` does). Records prefix-cache stats.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        max_cache_hit_length = request.num_tokens - 1
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, preempted=request.num_preemptions > 0
            )
        return KVCacheBlocks(blocks), num_hit_tokens

    # -- allocation -----------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for this step, all or nothing.

        Token layout (one row, left to right)::

            | computed | new local hit | external computed | new tokens | lookahead |
            ^ request.num_computed_tokens
                       ^ num_new_computed_tokens (hit blocks in new_computed_blocks)
                                       ^ num_external_computed_tokens (loaded by a connector)
                                                           ^ num_new_tokens
                                                                        ^ num_lookahead_tokens

        Steps: (1) free blocks no attention reads again, measured from committed
        ``request.num_computed_tokens``; (2) predict blocks needed over all groups, including
        ref_cnt-0 hit blocks that touching removes from the free queue, and return None with
        nothing changed if they exceed the free count; (3) touch every group's hits; (4) take new
        blocks (external + new + lookahead); (5) unless ``delay_cache_blocks``, publish full
        blocks up to ``min(computed + new, request.num_tokens)`` (never lookahead tokens).

        Args:
            num_encoder_tokens: encoder tokens for cross-attention groups (first call only).
        Returns the blocks newly taken from the pool per group, or None when they do not fit.
        Raises ValueError when there is nothing to allocate (no new, lookahead or external
        tokens), on negative counts, or when hits are given for a request that holds blocks.
        """
        if min(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
               num_external_computed_tokens, num_encoder_tokens) < 0:
            raise ValueError(f"negative token count for request {request.request_id}")
        if num_new_tokens == 0 and num_lookahead_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError(
                f"request {request.request_id}: num_new_tokens must be > 0 (or lookahead or "
                f"external computed tokens given)"
            )
        hit_blocks = (
            new_computed_blocks.blocks if new_computed_blocks is not None else ()
        )
        request_id = request.request_id
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(
            num_local_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        num_tokens_need_slot = min(
            total_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit_blocks, total_computed_tokens, num_encoder_tokens
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        if hit_blocks and any(hit_blocks):
            coordinator.add_local_computed_blocks(request_id, hit_blocks, total_computed_tokens)
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, total_computed_tokens, num_encoder_tokens
        )
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = min(total_computed_tokens + num_new_tokens, request.num_tokens)
            coordinator.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks up to ``num_computed_tokens`` (used after a delayed
        external load has landed). No-op when caching is off."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release every block of ``request`` in reverse table order (no-op if it holds none)."""
        self.coordinator.free(request.request_id)

    # -- queries --------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (empty lists if unknown)."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (null positions read 0)."""
        return self.get_blocks(request_id).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash if no block is held; False (nothing changed) otherwise."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Recorded KV cache events since the last call (empty when events are off)."""
        return self.block_pool.take_events()

    def check_integrity(self) -> None:
        """Verify pool and table invariants; RuntimeError naming the block on any violation."""
        check_manager_integrity(self.block_pool, self.coordinator.single_type_managers)
