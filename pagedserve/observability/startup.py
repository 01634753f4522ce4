"""Start-up, phase by phase: each phase logs one line with its time, as it ends.

    startup: config     0.11 s  smollm2 (llama, 30 layers, hidden 576, vocab 49152)
    startup: tokenizer  0.35 s  49152 tokens
    ...

The phases are config, tokenizer, weights, kernels, KV pool, warm-up and listening; each is logged
by whoever runs it (in a worker process, the worker's log reaches the same stderr).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

logger = logging.getLogger("pagedserve.startup")


@dataclass
class Phase:
    """What a phase found, for its log line (the `with` body fills `detail`)."""

    name: str
    detail: str = ""
    seconds: float = 0.0
    level: int = logging.INFO
    """WARNING where the phase fell back to something slower (the log line says why)."""


@contextmanager
def startup_phase(name: str) -> Iterator[Phase]:
    """Time the body and log `startup: <name> <seconds> <detail>` when it ends (not on error)."""
    phase = Phase(name)
    start = time.perf_counter()
    yield phase
    phase.seconds = time.perf_counter() - start
    logger.log(phase.level, "startup: %-9s %6.2f s  %s", name, phase.seconds, phase.detail)


def log_listening(url: str) -> None:
    """The last phase: the server accepts connections (and /health answers 200) at `url`."""
    since_start = seconds_since_process_start()
    logger.info("startup: listening on %s%s", url,
                f", healthy {since_start:.1f} s after the process started"
                if since_start is not None else "")


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as stat:
            # Field 22 (starttime, in clock ticks since boot) follows the ")" that ends comm.
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            uptime_s = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
