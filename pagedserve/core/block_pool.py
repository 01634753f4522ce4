"""The pool of KV blocks: reference counts, the free queue, and the prefix-cache index.

A block with no user is free but keeps its content and its hash: a later request with the same
prefix can take it back out of the free queue (a cache hit) until it is reallocated. The free queue
is LRU: freed blocks go to the tail, allocation takes from the head, so callers free a request's
blocks tail-first to have chain tails evicted before the prefixes they depend on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedserve.core.block_hash import BlockHash, group_block_key
from pagedserve.observability.events import BlocksEvicted, BlocksStored, EventBus


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        """Set while the block is a full block in the prefix-cache index."""

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    NULL_BLOCK_ID = 0
    """Block 0 is never handed out: padded slots of a batch write into it."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: EventBus | None = None) -> None:
        """events: where BlocksStored and BlocksEvicted go (None: nowhere)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.events = events or EventBus()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold cached content (a later prefix can hit them)."""
        return sum(1 for block in self._free.values() if block.block_hash is not None)

    def free_queue(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order (first is evicted first)."""
        return list(self._free.values())

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= self.num_free_blocks, f"{num_blocks=} > {self.num_free_blocks=}"
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks left unused join the free queue in this order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """The block holding KV cache group `group`'s copy of this content, if indexed."""
        return self._cached.get(group_block_key(block_hash, group))

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Index blocks[num_cached_blocks:num_full_blocks] of KV cache group `group`, which have
        just become full."""
        stored = [] if self.events.enabled else None
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks],
            block_hashes[num_cached_blocks:num_full_blocks],
        ):
            # A block that came from a cache hit is indexed already; and when another block with
            # the same content got there first, the index keeps that one and this block stays
            # private to its request.
            # (The null block stands in a windowed group's table for blocks let go of.)
            key = group_block_key(block_hash, group)
            if (block.block_hash is None and key not in self._cached
                    and block.block_id != self.NULL_BLOCK_ID):
                block.block_hash = key
                self._cached[key] = block
                if stored is not None:
                    stored.append(key)
        if stored:
            self.events.emit(BlocksStored(tuple(stored)))

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the prefix-cache index (their KV will not be written after all)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no request holds a block."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        if self._cached and self.events.enabled:
            self.events.emit(BlocksEvicted(tuple(self._cached)))
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            assert self._cached.get(block.block_hash) is block
            del self._cached[block.block_hash]
            if self.events.enabled:
                self.events.emit(BlocksEvicted((block.block_hash,)))
            block.block_hash = None

    def check_integrity(self) -> None:
        """Raise if the reference counts, the free queue and the cache index disagree."""
        null = self.blocks[self.NULL_BLOCK_ID]
        if null.ref_cnt != 0 or null.block_id in self._free or null.block_hash is not None:
            raise RuntimeError(f"the null block was handed out: {null}")
        num_referenced = 0
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise RuntimeError(f"negative ref_cnt: {block}")
            in_free_queue = block.block_id in self._free
            if (block.ref_cnt == 0) != in_free_queue:
                raise RuntimeError(f"{block} ref_cnt disagrees with free queue ({in_free_queue=})")
            num_referenced += block.ref_cnt > 0
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise RuntimeError(f"{block} has a hash the index does not map to it")
        if num_referenced + self.num_free_blocks != self.num_usable_blocks:
            raise RuntimeError(
                f"{num_referenced=} + {self.num_free_blocks=} != {self.num_usable_blocks=}"
            )
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"index entry points at {block} with another hash")
