"""The process groups of one engine's ranks, and the collectives the model layers call.

Ranks are laid out tensor-parallel first: global rank = pp_rank * tp_size + tp_rank, so the ranks
of one pipeline stage are consecutive (and, on several nodes, share a node where they can):

    tp=2, pp=2:   stage 0: ranks 0 1      stage 1: ranks 2 3
    TP groups: [0, 1], [2, 3]            PP groups: [0, 2], [1, 3]

Before `initialize_model_parallel` (one process, the uni-process executor) both groups have one
rank and every collective is the identity, so models and layers call them unconditionally. These
groups are the only module-level state in the package besides the forward context.

On the CPU, a tensor-parallel group whose ranks share a node all-reduces through shared memory
(shm_allreduce.py). Nothing here pickles: tensors only (torch.distributed's *_object collectives pickle; never use
them).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.distributed.shm_allreduce import ShmAllReduce


@dataclass
class GroupCoordinator:
    """One group of ranks: who is in it, where this rank stands, and its collectives."""

    ranks: list[int]
    """Global ranks in the group, in group order."""
    rank_in_group: int
    device_group: dist.ProcessGroup | None
    """Collectives on the model's tensors: gloo on the CPU, NCCL on CUDA (None: one rank)."""
    shm: ShmAllReduce | None = None
    """All-reduce through shared memory, for a group of CPU ranks on one node (gloo's costs
    milliseconds on busy cores); larger tensors than it holds go to device_group."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (a pipeline stage's successor)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns x."""
        if self.world_size == 1:
            return x
        if self.shm is not None and self.shm.supports(x):  # the same choice on every rank
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's x along dim, in group order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def send(self, tensors: list[torch.Tensor], dst: int) -> list[dist.Work]:
        """Start sending tensors to global rank dst; wait on the returned handles before the
        tensors are reused. Point-to-point messages between two ranks arrive in order."""
        return [dist.isend(t.contiguous(), dst, group=self.device_group) for t in tensors]

    def recv(self, tensors: list[torch.Tensor], src: int) -> None:
        """Receive into preallocated tensors (the shapes are known from the step) from src."""
        for t in tensors:
            dist.recv(t, src, group=self.device_group)


def _single() -> GroupCoordinator:
    return GroupCoordinator(ranks=[0], rank_in_group=0, device_group=None)


_TP: GroupCoordinator = _single()
_PP: GroupCoordinator = _single()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, backend: str, timeout_s: float = 600.0,
) -> None:
    """Join the default group (one call per rank; blocks until all world_size ranks arrive or
    timeout_s passes)."""
    dist.init_process_group(
        backend=backend, init_method=init_method, world_size=world_size, rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


SHM_ALL_REDUCE_MAX_BYTES = 4 << 20
"""Largest tensor the shared-memory all-reduce takes (a decode step's are a few KiB; a long
prefill chunk's go to gloo). The segment holds 2 x tp slots of it under /dev/shm."""


def initialize_model_parallel(
    tensor_parallel_size: int, pipeline_parallel_size: int, shm_name: str | None = None,
) -> None:
    """Build the TP and PP groups. Every rank creates every group, in the same order (a
    torch.distributed rule), and keeps the ones it is in. shm_name: give the TP group a
    shared-memory all-reduce under this name (unique per engine; CPU ranks on one node only)."""
    global _TP, _PP
    world_size = dist.get_world_size()
    assert world_size == tensor_parallel_size * pipeline_parallel_size, (
        f"{world_size=} != {tensor_parallel_size=} * {pipeline_parallel_size=}")
    rank = dist.get_rank()
    backend = dist.get_backend()
    tp_groups = [list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size))
                 for stage in range(pipeline_parallel_size)]
    pp_groups = [list(range(tp_rank, world_size, tensor_parallel_size))
                 for tp_rank in range(tensor_parallel_size)]
    for groups, name in ((tp_groups, "tp"), (pp_groups, "pp")):
        for ranks in groups:
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                coordinator = GroupCoordinator(ranks, ranks.index(rank), group)
                if name == "tp":
                    if shm_name is not None and len(ranks) > 1:
                        coordinator.shm = ShmAllReduce(
                            ranks, ranks.index(rank), name=f"{shm_name}-tp{ranks[0]}",
                            max_bytes=SHM_ALL_REDUCE_MAX_BYTES,
                            barrier=lambda group=group: dist.barrier(group=group))
                    _TP = coordinator
                else:
                    _PP = coordinator


def destroy_model_parallel() -> None:
    """Back to one rank (tests and a worker's shutdown)."""
    global _TP, _PP
    if _TP.shm is not None:
        _TP.shm.close()
    _TP, _PP = _single(), _single()
    if dist.is_initialized():
        dist.destroy_process_group()
