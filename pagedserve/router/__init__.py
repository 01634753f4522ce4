"""`pagedserve router`: one OpenAI-compatible endpoint in front of several workers (pagedserve
servers or any OpenAI-compatible ones), routed round_robin, least_load or cache_aware, with
health checks, retries, run-time add/remove, P/D disaggregation and merged metrics.

    router = Router(RouterConfig(policy="cache_aware"), worker_urls=["http://127.0.0.1:9001"])
    await serve_router(router, "127.0.0.1", 8000)
"""

from pagedserve.router.app import Router, build_app, serve_router
from pagedserve.router.config import RouterConfig

__all__ = ["Router", "RouterConfig", "build_app", "serve_router"]
