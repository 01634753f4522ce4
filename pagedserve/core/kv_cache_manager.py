"""Per-request block tables on top of the block pool, and prefix-cache lookups.

The scheduler asks two things: which leading blocks of a new request are cached already
(`get_computed_blocks`), and to make room for N more tokens (`allocate_slots`, None when the pool
is short: the caller preempts and retries). This module knows tokens and blocks, not models.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.block_hash import extend_block_hashes
from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.observability.events import EventBus
from pagedserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per admission of a request (first scheduling or resumption)."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: EventBus | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """How many leading blocks of each request are in the prefix-cache index."""
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def max_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of leading full blocks already cached, and the tokens they cover.

        Nothing is reserved: the blocks are only safe to use if passed to `allocate_slots` in the
        same scheduling pass.
        """
        if not self.enable_caching or request.needs_every_prompt_position:
            # Prompt logprobs and mean pooling need the output of every prompt position (a hit
            # reuses KV, not hidden states): compute them all. Their blocks are still indexed.
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_namespace)
        # The last token is always recomputed: its logits give the first new token.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if the pool is short.

        new_computed_blocks: cache hits from `get_computed_blocks` (admission only).
        ```
        | computed | prefix-cache hit | new (this step)               |
        |<- has blocks ->|<- touched ->|<- new blocks ---------------->|
                                       | known tokens | draft tokens   |
        ```
        Only blocks full of known tokens enter the prefix-cache index.
        delay_cache_blocks: the new blocks are to be loaded from a KV tier, not computed: index
        them once loaded and verified (`cache_blocks`), so nothing hits them before.
        """
        assert num_new_tokens > 0
        hits = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + len(hits) * self.block_size
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_total_tokens, self.block_size) - len(req_blocks) - len(hits)
        # Hits sitting in the free queue stop being allocatable once touched.
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks is not None:
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += len(hits) * self.block_size
        self.block_pool.touch(hits)
        req_blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if delay_cache_blocks:
            self.num_cached_blocks[request.request_id] = max(
                self.num_cached_blocks.get(request.request_id, 0), len(hits))
        elif self.enable_caching:
            # Blocks are indexed when scheduled, before their KV is written: the forward pass
            # writes every token's KV before any attention reads, so a request scheduled later
            # in this same step may already hit them.
            num_cached = max(self.num_cached_blocks.get(request.request_id, 0), len(hits))
            # NOTE: only tokens whose ids are final: scheduled draft tokens (past num_tokens) may
            # be rejected, and a block indexed with them would serve wrong KV to later hits.
            num_full = min(num_total_tokens, request.num_tokens) // self.block_size
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                request.cache_namespace)
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
            self.num_cached_blocks[request.request_id] = max(num_cached, num_full)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks up to `num_tokens` (their KV was loaded, not computed)."""
        if not self.enable_caching:
            return
        req_blocks = self.req_to_blocks[request.request_id]
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_namespace)
        self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
        self.num_cached_blocks[request.request_id] = max(num_cached, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its chain's tail is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # NOTE: blocks are indexed when scheduled. A request preempted in the very step that
        # scheduled them never gets their KV written, so blocks past its computed tokens must
        # not stay hittable.
        self.block_pool.uncache_blocks(blocks[request.num_computed_tokens // self.block_size :])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        num_refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                num_refs[block.block_id] = num_refs.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            if block.ref_cnt != num_refs.get(block.block_id, 0):
                raise RuntimeError(
                    f"{block} is held by {num_refs.get(block.block_id, 0)} block tables"
                )
