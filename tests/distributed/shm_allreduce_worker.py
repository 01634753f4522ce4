"""One rank of a ShmAllReduce test: `python -m tests.distributed.shm_allreduce_worker '<json>'`.

Runs `iterations` back-to-back all-reduces (no barrier between them) of shapes and dtypes drawn
from a seeded sequence that every rank draws alike, with rank-dependent seeded values; every
rank regenerates all ranks' inputs locally and compares its result bitwise with the expected
sum (fp32: summed in rank order; bf16/fp16: summed in fp32 in rank order, rounded once).
Random short sleeps on some calls let the ranks drift apart, so a fast rank often writes its
next call while a slow one still reads the previous one (the double buffering case).
Writes {"ok", "mismatches", "digest", "calls", "error"} as JSON to `out`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from pagedserve.distributed.shm_allreduce import ShmAllReduce

TOKENS = (1, 1, 1, 2, 3, 7, 32, 32, 100, 256)
HIDDEN = (576, 576, 64, 5)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def inputs(seed: int, call: int, world_size: int, max_bytes: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + call)
    tokens = TOKENS[int(torch.randint(len(TOKENS), (), generator=g))]
    hidden = HIDDEN[int(torch.randint(len(HIDDEN), (), generator=g))]
    dtype = DTYPES[int(torch.randint(len(DTYPES), (), generator=g))]
    if call % 50 == 7:  # exactly max_bytes
        tokens, hidden, dtype = 1, max_bytes // 4, torch.float32
    while tokens * hidden * dtype.itemsize > max_bytes:
        tokens //= 2
    out = []
    for r in range(world_size):
        gr = torch.Generator().manual_seed((seed * 1_000_003 + call) * 97 + r)
        out.append((torch.randn(tokens, hidden, generator=gr) * (r + 1)).to(dtype))
    return out


def expected_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def file_barrier(directory: str, rank: int, world_size: int, timeout_s: float) -> None:
    Path(directory, f"arrived{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while not all(Path(directory, f"arrived{r}").exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            raise RuntimeError("file barrier timed out")
        time.sleep(0.001)


def main(args: dict) -> None:
    torch.set_num_threads(1)
    rank, world_size = args["rank"], args["world_size"]
    seed, max_bytes = args["seed"], args["max_bytes"]
    barrier = None
    if args.get("barrier_dir"):
        barrier = lambda: file_barrier(args["barrier_dir"], rank, world_size,  # noqa: E731
                                       args["timeout_s"])
    shm = ShmAllReduce(args["group_ranks"], rank, args["name"], max_bytes, barrier=barrier,
                       timeout_s=args["timeout_s"])
    result = {"ok": 0, "mismatches": [], "error": None, "calls": 0,
              "segment_left_after_init": os.path.exists(shm.path) if rank == 0 else None}
    digest = hashlib.sha256()
    delays = torch.Generator().manual_seed(seed * 31 + rank + 1)
    try:
        for call in range(args["iterations"]):
            xs = inputs(seed, call, world_size, max_bytes)
            x = xs[rank].clone()
            if float(torch.rand((), generator=delays)) < args.get("delay_p", 0.0):
                time.sleep(float(torch.rand((), generator=delays)) * 0.002)
            try:
                out = shm.all_reduce(x)
            except RuntimeError as e:
                result["error"] = str(e)
                break
            result["calls"] += 1
            assert out is x
            view = INT_VIEW[x.dtype]
            if torch.equal(x.view(view), expected_sum(xs).view(view)):
                result["ok"] += 1
            else:
                result["mismatches"].append([call, str(x.dtype), list(x.shape)])
            digest.update(x.view(view).numpy().tobytes())
    finally:
        shm.close()
    result["digest"] = digest.hexdigest()
    Path(args["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
