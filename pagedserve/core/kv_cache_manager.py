"""Per-request block tables on top of the block pool, and prefix-cache lookups.

The scheduler asks two things: which leading blocks of a new request are cached already
(`get_computed_blocks`), and to make room for N more tokens (`allocate_slots`, None when the pool
is short: the caller preempts and retries). This module knows tokens and blocks, not models.

A request has one block table per KV cache group (core/kv_cache_groups.py): one for most models,
several where windowed and global layers mix. Tables are tuples of lists, one list per group, all
of the same length; a windowed group's table holds the null block where its window has let go of
a block (`_free_outside_windows`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.block_hash import BlockHash, extend_block_hashes
from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.kv_cache_groups import first_needed_block, window_blocks
from pagedserve.observability.events import EventBus
from pagedserve.request import Request

BlockTables = tuple[list[KVCacheBlock], ...]
"""A request's blocks, one list per KV cache group."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per admission of a request (first scheduling or resumption)."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: EventBus | None = None,
                 group_windows: tuple[int | None, ...] = (None,)) -> None:
        """group_windows: per KV cache group, its layers' sliding window (None: global; see
        KVCacheLayout.windows). One global group keeps every block of every request."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.block_pool = BlockPool(num_blocks, enable_caching, events)
        self.null_block = self.block_pool.blocks[BlockPool.NULL_BLOCK_ID]
        """Stands in a windowed group's table for the blocks its window has let go of."""
        self.req_to_blocks: dict[str, BlockTables] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """How many leading blocks of each request are in the prefix-cache index."""
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_window_freed_blocks = 0
        """Blocks let go of while their request ran, because every window had passed them."""
        self.peak_used_blocks = 0
        """Most blocks held by requests at once since start (or reset_peak_usage)."""
        self._all_global = all(window is None for window in self.group_windows)
        self._no_new_blocks: BlockTables = tuple(() for _ in self.group_windows)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens holds at most while it decodes, every group's
        together (a windowed group keeps only the blocks its window can reach)."""
        num_blocks = cdiv(num_tokens, self.block_size)
        return sum(num_blocks if window is None
                   else min(num_blocks, window_blocks(window, self.block_size) + 1)
                   for window in self.group_windows)

    def _no_blocks(self) -> BlockTables:
        return tuple([] for _ in self.group_windows)

    def get_computed_blocks(self, request: Request) -> tuple[BlockTables, int]:
        """The longest prefix whose KV is cached in every group, as blocks per group, and the
        tokens it covers. A global group needs every block of the prefix; a windowed one only
        those its window reaches from the prefix's end (the rest are the null block).

        Nothing is reserved: the blocks are only safe to use if passed to `allocate_slots` in the
        same scheduling pass.
        """
        if not self.enable_caching or request.needs_every_prompt_position:
            # Prompt logprobs and mean pooling need the output of every prompt position (a hit
            # reuses KV, not hidden states): compute them all. Their blocks are still indexed.
            return self._no_blocks(), 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_namespace)
        # The last token is always recomputed: its logits give the first new token.
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        cached = self.block_pool.get_cached_block
        num_hit = len(hashes)
        for group, window in enumerate(self.group_windows):
            if window is None:
                num_hit = next((i for i in range(num_hit) if cached(hashes[i], group) is None),
                               num_hit)
        # Each windowed group needs its window's blocks before the prefix's end; where one is
        # missing, no prefix past it can be a hit in that group: try the prefix ending there.
        while num_hit:
            missing = [
                i for group, window in enumerate(self.group_windows) if window is not None
                for i in range(first_needed_block(num_hit * self.block_size, window,
                                                  self.block_size), num_hit)
                if cached(hashes[i], group) is None
            ]
            if not missing:
                break
            num_hit = max(missing)
        hits = []
        for group, window in enumerate(self.group_windows):
            first = first_needed_block(num_hit * self.block_size, window, self.block_size)
            hits.append([self.null_block] * first
                        + [cached(hashes[i], group) for i in range(first, num_hit)])
        return tuple(hits), num_hit * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: BlockTables | None = None,
        delay_cache_blocks: bool = False,
    ) -> BlockTables | None:
        """Give the request blocks for `num_new_tokens` more tokens in every group; returns the
        new blocks per group, or None if the pool is short.

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
        req_blocks = self.req_to_blocks.get(request.request_id)
        if (new_computed_blocks is None and req_blocks is not None and self._all_global
                and not delay_cache_blocks):
            # Most calls: a running request whose blocks already hold its next tokens (a decode
            # inside its last block). Nothing to take from the pool, at most a block to index.
            num_total_tokens = request.num_computed_tokens + num_new_tokens
            if cdiv(num_total_tokens, self.block_size) <= len(req_blocks[0]):
                if (self.enable_caching and min(num_total_tokens, request.num_tokens)
                        // self.block_size > self.num_cached_blocks.get(request.request_id, 0)):
                    self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens))
                return self._no_new_blocks
        hits = new_computed_blocks or self._no_blocks()
        if req_blocks is None:
            req_blocks = self._no_blocks()
        else:  # first let go of what no query from now on sees: those blocks count as free
            self._free_outside_windows(req_blocks, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_blocks = cdiv(num_total_tokens, self.block_size)
        num_new_blocks = [max(0, num_blocks - len(blocks) - len(group_hits))
                          for blocks, group_hits in zip(req_blocks, hits)]
        # Hits sitting in the free queue stop being allocatable once touched.
        num_free_hits = sum(1 for group_hits in hits for block in group_hits
                            if block.ref_cnt == 0 and block is not self.null_block)
        if sum(num_new_blocks) > self.block_pool.num_free_blocks - num_free_hits:
            return None

        if new_computed_blocks is not None:
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += len(hits[0]) * self.block_size
        self.req_to_blocks[request.request_id] = req_blocks
        # Every group's hits leave the free queue before any group takes new blocks from it.
        for blocks, group_hits in zip(req_blocks, hits):
            self.block_pool.touch(block for block in group_hits if block is not self.null_block)
            blocks.extend(group_hits)
        new_blocks = tuple(self.block_pool.get_new_blocks(n) for n in num_new_blocks)
        for blocks, group_new_blocks in zip(req_blocks, new_blocks):
            blocks.extend(group_new_blocks)
        pool = self.block_pool
        self.peak_used_blocks = max(self.peak_used_blocks,
                                    pool.num_usable_blocks - pool.num_free_blocks)

        num_hit_blocks = len(hits[0])
        if delay_cache_blocks:
            self.num_cached_blocks[request.request_id] = max(
                self.num_cached_blocks.get(request.request_id, 0), num_hit_blocks)
        elif self.enable_caching:
            # Blocks are indexed when scheduled, before their KV is written: the forward pass
            # writes every token's KV before any attention reads, so a request scheduled later
            # in this same step may already hit them.
            # NOTE: only tokens whose ids are final: scheduled draft tokens (past num_tokens) may
            # be rejected, and a block indexed with them would serve wrong KV to later hits.
            self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens),
                                    num_hit_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks up to `num_tokens` (their KV was loaded, not computed)."""
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))

    def _cache_full_blocks(self, request: Request, num_tokens: int, num_hit_blocks: int = 0
                           ) -> None:
        """Index every group's blocks that `num_tokens` final tokens fill and that are not
        indexed yet (hits are, already)."""
        req_id = request.request_id
        num_cached = max(self.num_cached_blocks.get(req_id, 0), num_hit_blocks)
        num_full = num_tokens // self.block_size
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_namespace)
        for group, blocks in enumerate(self.req_to_blocks[req_id]):
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full,
                                              group)
        self.num_cached_blocks[req_id] = max(num_cached, num_full)

    def _free_outside_windows(self, req_blocks: BlockTables, num_computed_tokens: int) -> None:
        """In each windowed group, put the null block in place of the blocks no query from
        `num_computed_tokens` on can see, and free them (they stay hittable while free)."""
        for blocks, window in zip(req_blocks, self.group_windows):
            first = min(first_needed_block(num_computed_tokens, window, self.block_size),
                        len(blocks))
            freed: list[KVCacheBlock] = []
            # The null blocks are a prefix of the table: walk back from `first` to them.
            for index in range(first - 1, -1, -1):
                if blocks[index] is self.null_block:
                    break
                freed.append(blocks[index])
                blocks[index] = self.null_block
            self.block_pool.free_blocks(freed)  # latest first: the chain's tail evicted first
            self.num_window_freed_blocks += len(freed)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its chain's tail is evicted first."""
        tables = self.req_to_blocks.pop(request.request_id, ())
        self.num_cached_blocks.pop(request.request_id, None)
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for blocks in tables:
            # NOTE: blocks are indexed when scheduled. A request preempted in the very step that
            # scheduled them never gets their KV written, so blocks past its computed tokens must
            # not stay hittable.
            self.block_pool.uncache_blocks(blocks[num_computed_blocks:])
            self.block_pool.free_blocks(
                block for block in reversed(blocks) if block is not self.null_block)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (the null block's id where a window let
        go of a block)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return tuple([] for _ in self.group_windows)
        return tuple([block.block_id for block in blocks] for blocks in tables)

    def reset_peak_usage(self) -> None:
        pool = self.block_pool
        self.peak_used_blocks = pool.num_usable_blocks - pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        num_refs: dict[int, int] = {}
        for req_id, tables in self.req_to_blocks.items():
            if len(tables) != self.num_groups or len({len(b) for b in tables}) > 1:
                raise RuntimeError(f"{req_id}'s block tables disagree in number or length")
            for blocks, window in zip(tables, self.group_windows):
                num_null = sum(1 for block in blocks if block is self.null_block)
                if num_null and (window is None
                                 or any(b is not self.null_block for b in blocks[:num_null])):
                    raise RuntimeError(f"{req_id} has null blocks that are not a window's prefix")
                for block in blocks[num_null:]:
                    num_refs[block.block_id] = num_refs.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != num_refs.get(block.block_id, 0):
                raise RuntimeError(
                    f"{block} is held by {num_refs.get(block.block_id, 0)} block tables"
                )
