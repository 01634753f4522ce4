"""Counters of structured output work, carried in SchedulerStats to the stat loggers.

Pure data, no llguidance: the scheduler's stats import it.
"""

from __future__ import annotations

from dataclasses import dataclass

RECENT_OBSERVATIONS = 256
"""Timings kept for the histograms; a stat logger that falls further behind loses the oldest
ones (their totals still count)."""


@dataclass
class StructuredOutputStats:
    """Totals since the engine started, plus the most recent timings with their sequence numbers
    so that a stat logger can observe each timing once."""

    num_constrained_requests: int = 0
    """Scheduler requests (each of n sequences counts) that ran with a constraint."""
    num_compiles: int = 0
    """Grammars compiled (cache misses that finished, successfully or not)."""
    num_compile_failures: int = 0
    """Grammars that did not compile or ran past the time budget."""
    num_cache_hits: int = 0
    compile_seconds_total: float = 0.0
    num_mask_steps: int = 0
    """Steps that filled a bitmask for at least one constrained row."""
    mask_seconds_total: float = 0.0
    recent_compile_seconds: tuple[float, ...] = ()
    """The last compile times, oldest first; the last one is compile number num_compiles."""
    recent_mask_seconds: tuple[float, ...] = ()
    """The last per-step mask fill times; the last one is step number num_mask_steps."""
