"""One KV block as one self-checking payload, so a tier may hold anything and we use only our own.

    b"PSKV" | u32 header length | header (JSON) | body (the block's tensors' bytes, in layout order)

The header names the key, the chained block hash, the block's token ids, the layout (each tensor's
dtype and per-block shape) and a digest of the body. `decode` checks all of them against what the
loader expects: a truncated or corrupted payload is "corrupt", a payload of another block, model
or layout is "foreign"; either way the block is recomputed. JSON and raw bytes only: nothing in a
payload is unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import json
import struct

MAGIC = b"PSKV"
VERSION = 1
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER_BYTES = 1 << 20

Layout = list[tuple[str, list[int]]]
"""Per tensor of the block, in order: (dtype name, shape of one block's slice)."""


class BlockDecodeError(ValueError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        """"corrupt" or "foreign"."""


def _digest(body: bytes | memoryview) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def encode(key: str, block_hash: bytes, token_ids: list[int], layout: Layout,
           segments: list[bytes | memoryview]) -> bytes:
    body = b"".join(segments)
    header = json.dumps({
        "v": VERSION, "key": key, "hash": block_hash.hex(), "tokens": list(token_ids),
        "layout": [[dtype, list(shape)] for dtype, shape in layout],
        "sizes": [len(s) if isinstance(s, bytes) else s.nbytes for s in segments],
        "digest": _digest(body),
    }, separators=(",", ":")).encode()
    return b"".join((MAGIC, _HEADER_LEN.pack(len(header)), header, body))


def decode(payload: bytes, key: str, block_hash: bytes, token_ids: list[int],
           layout: Layout) -> list[memoryview]:
    """The block's tensor segments, after checking the payload is whole and is this block's."""
    view = memoryview(payload)
    prefix = len(MAGIC) + _HEADER_LEN.size
    if len(view) < prefix or bytes(view[: len(MAGIC)]) != MAGIC:
        raise BlockDecodeError("corrupt", "not a KV block payload (bad magic or truncated)")
    (header_len,) = _HEADER_LEN.unpack_from(view, len(MAGIC))
    if header_len > _MAX_HEADER_BYTES or prefix + header_len > len(view):
        raise BlockDecodeError("corrupt", "truncated header")
    try:
        header = json.loads(bytes(view[prefix : prefix + header_len]))
        sizes = [int(s) for s in header["sizes"]]
        fields = (header["v"], header["key"], header["hash"], header["tokens"],
                  header["layout"], header["digest"])
    except (ValueError, KeyError, TypeError) as e:
        raise BlockDecodeError("corrupt", f"unreadable header ({e})") from None
    version, stored_key, stored_hash, stored_tokens, stored_layout, digest = fields
    body = view[prefix + header_len :]
    if len(body) != sum(sizes):
        raise BlockDecodeError("corrupt", f"body has {len(body)} bytes, expected {sum(sizes)}")
    if _digest(body) != digest:
        raise BlockDecodeError("corrupt", "body checksum mismatch")
    if version != VERSION:
        raise BlockDecodeError("foreign", f"payload version {version}, expected {VERSION}")
    if stored_key != key or stored_hash != block_hash.hex():
        raise BlockDecodeError("foreign", "payload belongs to another block")
    if stored_tokens != list(token_ids):
        raise BlockDecodeError("foreign", "payload holds other token ids")
    if stored_layout != [[dtype, list(shape)] for dtype, shape in layout]:
        raise BlockDecodeError("foreign", f"payload layout {stored_layout} differs from ours")
    segments, offset = [], 0
    for size in sizes:
        segments.append(body[offset : offset + size])
        offset += size
    return segments
