"""torch.profiler over one rank's steps, between start_profile and stop_profile.

The profiler runs on the thread that calls start (the thread that runs the model: the engine
thread in one process, a worker process's main thread otherwise) and, at stop, writes one
Chrome trace (`.pt.trace.json`, open it in Perfetto or chrome://tracing) named after the rank,
the process and the time. Knows nothing of engines, executors or HTTP.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import ContextManager

import torch
from torch.profiler import ProfilerActivity

from pagedserve.config import ProfilerConfig

NO_RANGE: ContextManager[None] = contextlib.nullcontext()
"""What `step_range` gives while nothing profiles. NOTE: a record_function range costs about
16 us even with no profiler active (measured on the 2-core CPU), so ranges exist only while
profiling."""


def step_range(name: str, profiling: bool) -> ContextManager:
    """A named range in the trace (e.g. "pagedserve::schedule") while profiling, else a no-op."""
    return torch.profiler.record_function(name) if profiling else NO_RANGE


class StepProfiler:
    def __init__(self, config: ProfilerConfig, rank: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self._profile: torch.profiler.profile | None = None

    @property
    def is_active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        """Start recording CPU ops (and CUDA kernels on a GPU); ValueError if already started
        or the trace directory cannot be created."""
        if self._profile is not None:
            raise ValueError(f"the profiler is already running on rank {self.rank}")
        try:
            os.makedirs(self.config.trace_dir, exist_ok=True)
        except OSError as error:
            raise ValueError(f"cannot create the profiler's directory: {error}") from None
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities,
                                         record_shapes=self.config.record_shapes,
                                         with_stack=self.config.with_stack)
        profile.start()
        self._profile = profile

    def stop(self, export: bool = True) -> str | None:
        """Stop recording and write the trace; returns its path (None with export=False: the
        recording is dropped). ValueError if not started or the trace cannot be written."""
        if self._profile is None:
            raise ValueError(f"the profiler is not running on rank {self.rank}")
        profile, self._profile = self._profile, None
        profile.stop()
        if not export:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() // 1_000_000 % 1000:03d}"
        path = os.path.join(self.config.trace_dir,
                            f"pagedserve-rank{self.rank}-pid{os.getpid()}-{stamp}.pt.trace.json")
        try:
            profile.export_chrome_trace(path)
        except OSError as error:
            raise ValueError(f"cannot write the trace: {error}") from None
        return path
