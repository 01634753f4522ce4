"""Content hashes of full KV blocks, chained so that a hash names the whole prefix up to its block.

hash(block i) = sha256(hash(block i-1) | token ids of block i | extra keys). Extra keys carry what
else changes the KV for the same tokens (a request's cache namespace: its cache salt and its LoRA
adapter's digest). The encoding is explicit bytes: nothing user-controlled is pickled or
evaluated.
"""

from __future__ import annotations

import hashlib
import json
from array import array

BlockHash = bytes

_ROOT_HASH = hashlib.sha256(b"pagedserve-prefix-root").digest()


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra_keys: tuple = ()
) -> BlockHash:
    hasher = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_HASH)
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys:
        # json of a tuple of str/int is canonical and cannot execute anything.
        hasher.update(json.dumps(extra_keys, separators=(",", ":")).encode())
    return hasher.digest()


def extra_keys_for_block(block_index: int, namespace: tuple) -> tuple:
    """The namespace (Request.cache_namespace: salt, adapter) enters the first block only: the
    chain carries it into every later hash."""
    return namespace if block_index == 0 else ()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: list[int], block_size: int, namespace: tuple = ()
) -> None:
    """Append the hash of every full block of `token_ids` not hashed yet (in place)."""
    num_full_blocks = len(token_ids) // block_size
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size
        parent = block_hashes[-1] if block_hashes else None
        block_hashes.append(
            hash_block_tokens(
                parent,
                token_ids[start : start + block_size],
                extra_keys_for_block(block_index, namespace),
            )
        )


def group_block_key(block_hash: BlockHash, group: int) -> BlockHash:
    """A block's key in the prefix-cache index: its hash, and for KV cache groups after the
    first (core/kv_cache_groups.py) the group too, since the same tokens' KV differs between
    groups (other layers)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
