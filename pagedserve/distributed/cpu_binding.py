"""Which CPUs a rank runs on: each local rank gets its own contiguous share, so ranks do not
stall each other's OpenMP threads (the founding document's CPU-binding point)."""

from __future__ import annotations

import os


def usable_cpus() -> list[int]:
    """CPUs this process may run on (taskset / cgroup cpusets narrow it). torch's default counts
    every core of the machine, and more threads than usable cores stall each other badly."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return list(range(os.cpu_count() or 1))


def cpu_share(cpus: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The CPUs a local rank is pinned to: an even, contiguous share (neighbouring cores tend to
    share caches); with fewer CPUs than ranks, ranks take turns over them."""
    if len(cpus) < local_world_size:
        return [cpus[local_rank % len(cpus)]]
    share = len(cpus) // local_world_size
    return cpus[local_rank * share : (local_rank + 1) * share]


def bind_to_cpus(cpus: list[int]) -> None:
    os.sched_setaffinity(0, cpus)
