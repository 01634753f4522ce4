"""Process groups and collectives for tensor and pipeline parallelism (torch.distributed)."""

from pagedserve.distributed.parallel_state import (
    GroupCoordinator,
    get_pp_group,
    get_tp_group,
)

__all__ = ["GroupCoordinator", "get_pp_group", "get_tp_group"]
