"""Process groups and collectives for tensor and pipeline parallelism (torch.distributed).

The names below load on first use, so torch-free code (the CPU binding, which the test harness
pins its workers with) can import this package's plain submodules without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.distributed.parallel_state import (
        GroupCoordinator,
        get_pp_group,
        get_tp_group,
    )

__all__ = ["GroupCoordinator", "get_pp_group", "get_tp_group"]


def __getattr__(name: str):
    if name in __all__:
        from pagedserve.distributed import parallel_state

        return getattr(parallel_state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
