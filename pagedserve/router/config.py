"""RouterConfig: how the router picks workers, checks their health and reports their metrics.

Worker URLs are not configuration: they change at run time (add_worker / remove_worker), so the
Router takes them as arguments. Flags are read in router/cli.py and nowhere deeper.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

POLICY_NAMES = ("round_robin", "least_load", "cache_aware")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    """round_robin | least_load | cache_aware (see router/policies.py)."""
    pd: bool = False
    """Prefill/decode disaggregation: each request is prefilled on a prefill worker (max_tokens 1),
    then sent whole to a decode worker, which finds the prompt's KV through its KV connector."""

    # cache_aware (SGLang's router defaults)
    cache_threshold: float = 0.5
    """Route to the worker whose prefix tree matches at least this fraction of the request text."""
    balance_abs_threshold: int = 32
    """Load is imbalanced when max - min in-flight requests exceeds this ..."""
    balance_rel_threshold: float = 1.5
    """... and max exceeds this times min: then the least loaded worker gets the request."""
    max_tree_chars: int = 2_000_000
    """Characters kept per worker's prefix tree; least recently used leaves are evicted past it."""

    # health and upstream connections
    health_check_interval_s: float = 2.0
    """Every worker's /health (and /load) is polled this often, healthy or not."""
    health_check_timeout_s: float = 5.0
    """A /health, /load or /metrics poll slower than this counts as a failure."""
    connect_timeout_s: float = 5.0
    """Connecting to a worker; reads have no timeout (a generation may take minutes)."""
    max_retries: int = 1
    """Extra attempts, each on another healthy worker, for a request that failed before its
    first response byte (connection error, or 502/503/504)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM, seconds open requests get to finish before they are cut."""

    api_key: str | None = None
    """If set, every route but /health needs `Authorization: Bearer <api_key>` (the header is
    forwarded to the workers as it came)."""

    worker_metrics_label: str | None = None
    """If set, /metrics also serves every healthy worker's own metrics, each sample labelled
    `<worker_metrics_label>="<worker label>"` (data parallelism uses "replica")."""

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(
                f"policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_chars < 1:
            raise ValueError(f"max_tree_chars must be >= 1, got {self.max_tree_chars}")
        for name in ("health_check_interval_s", "health_check_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if self.worker_metrics_label is not None and not self.worker_metrics_label.isidentifier():
            raise ValueError("worker_metrics_label must be a Prometheus label name, got "
                             f"{self.worker_metrics_label!r}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RouterConfig:
        return cls(
            policy=args.policy,
            pd=args.pd,
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            max_tree_chars=args.max_tree_chars,
            health_check_interval_s=args.health_check_interval,
            health_check_timeout_s=args.health_check_timeout,
            connect_timeout_s=args.connect_timeout,
            max_retries=args.max_retries,
            shutdown_timeout_s=args.shutdown_timeout,
            api_key=args.api_key,
            worker_metrics_label=args.worker_metrics_label,
        )
