"""Where the memory went: a breakdown of one engine's memory, and the capacity report.

Tensors are counted exactly (their bytes): weights, split into packed (GGUF codes and their
scales: integer tensors) and dense (floating-point), the KV pool, the draft model's weights and
KV, LoRA slots and host copies. What has no tensor is measured as the growth of the process's
resident set (RSS) around it: the tokenizer while it loads, and the runtime peak (activations,
kernel workspaces, allocator caches) as the peak RSS since the KV pool was allocated, over the
RSS then (Linux's VmHWM, reset through /proc/self/clear_refs). The CPU KV pool is mapped lazily:
`components` give its size, `resident_bytes` the part of it in memory, which is what the RSS
holds. `unattributed` is what the RSS grew by that no part explains.

The capacity report answers the founding document's question for this model and pool: how many
requests of context L fit at once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys

logger = logging.getLogger(__name__)

CAPACITY_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def _status_field(name: str, pid: int | None = None) -> int | None:
    """A `kB` field of /proc/<pid>/status, in bytes (None off Linux or for a gone process)."""
    path = f"/proc/{pid or 'self'}/status"
    try:
        with open(path, encoding="ascii") as status:
            for line in status:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int | None = None) -> int | None:
    """The resident set size of a process (default: this one)."""
    return _status_field("VmRSS", pid)


def peak_rss_bytes(pid: int | None = None) -> int | None:
    """The RSS high-water mark since the process started or since reset_peak_rss()."""
    return _status_field("VmHWM", pid)


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def model_bytes(model) -> dict[str, int]:
    """Bytes of a model's tensors: `weights_packed` (everything inside a module that holds
    packed weights: codes, scales, mins), `weights_dense` (parameters), `buffers` (other
    tensors: rotary tables, dense copies kept beside packed ones). Tensors that share storage
    (tied embeddings, views) count once."""
    import torch

    seen: set[int] = set()
    parts = {"weights_packed": 0, "weights_dense": 0, "buffers": 0}

    def count(tensor, part: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return
        seen.add(storage.data_ptr())
        parts[part] += storage.nbytes()

    for module in model.modules():
        packed = getattr(type(module), "holds_packed_weights", False)
        for tensor in module._parameters.values():
            count(tensor, "weights_packed" if packed else "weights_dense")
        for tensor in module._buffers.values():
            count(tensor, "weights_packed" if packed else "buffers")
        for value in vars(module).values():  # tensors kept as plain attributes
            count(value, "weights_packed" if packed else "buffers")
    return parts


def resident_bytes(tensors) -> int | None:
    """Bytes of the pages of `tensors`' distinct CPU storages that are in memory now (Linux's
    mincore; None elsewhere). The KV pool is mapped lazily (attention/kv_cache.py): its
    untouched pages take no memory, so the RSS holds only this part of it."""
    import numpy as np

    libc = glibc()
    if libc is None:
        return None
    page = mmap.PAGESIZE
    seen: set[int] = set()
    total = 0
    for tensor in _walk_tensors(tensors):
        storage = tensor.untyped_storage()
        if tensor.device.type != "cpu" or storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        start = storage.data_ptr() // page * page
        length = storage.data_ptr() + storage.nbytes() - start
        pages = -(-length // page)
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) != 0:
            return None
        # Bit 0 of each page's byte: resident; the other bits are reserved.
        resident_pages = int((np.frombuffer(vector, dtype=np.uint8) & 1).sum())
        total += min(storage.nbytes(), resident_pages * page)
    return total


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """glibc, for mincore and malloc_trim; None off Linux or on another libc (e.g. musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _walk_tensors(tensors):
    """The tensors in `tensors`, nested tuples and lists walked."""
    import torch

    stack = list(tensors)
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            yield item


def tensors_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (nested tuples and lists are walked)."""
    seen: set[int] = set()
    total = 0
    for tensor in _walk_tensors(tensors):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def capacity_report(num_blocks: int, block_size: int, max_model_len: int,
                    bytes_per_block: int, blocks_for=None) -> list[dict]:
    """For each context length up to max_model_len: how many requests of that length (prompt
    plus output) the pool holds at once, with no prefix shared. blocks_for: a request's blocks
    at a context length, every KV cache group's (KVCacheManager.max_blocks_for; None: one
    block per block_size tokens)."""
    usable_blocks = num_blocks - 1  # block 0 is reserved
    contexts = [c for c in CAPACITY_CONTEXTS if c < max_model_len] + [max_model_len]
    report = []
    for context_len in contexts:
        blocks_per_request = (blocks_for(context_len) if blocks_for is not None
                              else -(-context_len // block_size))
        report.append({"context_len": context_len,
                       "max_requests": usable_blocks // blocks_per_request,
                       "kv_bytes_per_request": blocks_per_request * bytes_per_block})
    return report


def combine_breakdown(rss_at_start: int | None, tokenizer_bytes: int,
                      rank_reports: list[dict], engine_parts: dict[str, int]) -> dict:
    """The engine's breakdown from its workers' reports (one per rank; the first runs in this
    process with the uni-process executor) and the engine process's own parts."""
    components: dict[str, int] = dict(engine_parts)
    components["tokenizer"] = tokenizer_bytes
    for report in rank_reports:
        for name, value in report["components"].items():
            components[name] = components.get(name, 0) + value
    in_process = [r for r in rank_reports if r["pid"] == os.getpid()]
    others = [r for r in rank_reports if r["pid"] != os.getpid()]
    rss = rss_bytes()
    process = {"pid": os.getpid(), "rss_bytes": rss, "rss_at_start_bytes": rss_at_start,
               "rss_growth_bytes": (rss - rss_at_start
                                    if rss is not None and rss_at_start is not None else None)}
    resident: dict[str, int | None] = {}
    for report in rank_reports:
        for name, value in report["resident_bytes"].items():
            known = resident.get(name, 0)
            resident[name] = None if value is None or known is None else known + value
    attributed = sum(value for value in components.values() if value)
    # The parts held by worker processes are not in this process's RSS: compare like with like.
    # Lazily mapped KV counts by its resident pages (None, not Linux: by its size).
    local = sum(components.get(name, 0) for name in ("tokenizer", *engine_parts))
    for report in in_process:
        parts = dict(report["components"])
        parts.update((name, value) for name, value in report["resident_bytes"].items()
                     if value is not None)
        local += sum(parts.values())
    growth = process["rss_growth_bytes"]
    return {
        "object": "memory.breakdown",
        "process": process,
        "components": components,
        "resident_bytes": resident,
        "attributed_bytes": attributed,
        "unattributed_bytes": growth - local if growth is not None and not others else None,
        "workers": [{"rank": r["rank"], "pid": r["pid"], "rss_bytes": r["rss_bytes"],
                     "components": r["components"], "resident_bytes": r["resident_bytes"]}
                    for r in rank_reports],
    }
