"""`pagedserve router`: flags -> RouterConfig + worker URLs -> serve_router.

    pagedserve router --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002 --port 8000
    pagedserve router --pd --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import os
import asyncio
import logging
import sys

from pagedserve.router.app import Router, serve_router
from pagedserve.router.config import POLICY_NAMES, RouterConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8001 "
                             "(repeatable; more can be added at run time: POST /add_worker)")
    parser.add_argument("--policy", choices=POLICY_NAMES, default=RouterConfig.policy)
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $PAGEDSERVE_API_KEY)")
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--pd", action="store_true",
                    help="prefill each request on a --prefill worker, then decode it on a "
                         "--decode worker (their KV connectors move the KV)")
    pd.add_argument("--prefill", action="append", default=[], metavar="URL", help="repeatable")
    pd.add_argument("--decode", action="append", default=[], metavar="URL", help="repeatable")
    cache = parser.add_argument_group("cache_aware policy")
    cache.add_argument("--cache-threshold", type=float, default=RouterConfig.cache_threshold,
                       help="route by prefix when a worker's tree matches this fraction of the "
                            "request text")
    cache.add_argument("--balance-abs-threshold", type=int,
                       default=RouterConfig.balance_abs_threshold,
                       help="load is imbalanced when max - min in-flight exceeds this ...")
    cache.add_argument("--balance-rel-threshold", type=float,
                       default=RouterConfig.balance_rel_threshold,
                       help="... and max exceeds this times min")
    cache.add_argument("--max-tree-chars", type=int, default=RouterConfig.max_tree_chars,
                       help="characters of request text remembered per worker")
    health = parser.add_argument_group("health and upstream")
    health.add_argument("--health-check-interval", type=float,
                        default=RouterConfig.health_check_interval_s, help="seconds")
    health.add_argument("--health-check-timeout", type=float,
                        default=RouterConfig.health_check_timeout_s, help="seconds")
    health.add_argument("--connect-timeout", type=float, default=RouterConfig.connect_timeout_s,
                        help="seconds to connect to a worker")
    health.add_argument("--max-retries", type=int, default=RouterConfig.max_retries,
                        help="retries on another worker before the first response byte")
    health.add_argument("--shutdown-timeout", type=float,
                        default=RouterConfig.shutdown_timeout_s,
                        help="seconds open requests get to finish after SIGTERM")
    health.add_argument("--worker-metrics-label", default=None, metavar="LABEL",
                        help="also serve every worker's /metrics on /metrics, labelled "
                             "LABEL=<worker>")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])


def run_router(args: argparse.Namespace) -> int:
    """Serve the router `args` describe until SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: each health poll would fill the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    config = RouterConfig.from_cli_args(args)
    if config.pd and not (args.prefill and args.decode):
        raise ValueError("--pd needs at least one --prefill and one --decode worker")
    router = Router(config, args.worker, prefill_urls=args.prefill, decode_urls=args.decode)
    asyncio.run(serve_router(router, args.host, args.port, log_level=args.log_level))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve router",
                                     description="Route OpenAI API requests across workers.")
    add_cli_args(parser)
    try:
        return run_router(parser.parse_args(argv))
    except ValueError as error:
        print(f"pagedserve router: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
