"""`pagedserve router`: one OpenAI-compatible endpoint in front of several workers (pagedserve
servers or any OpenAI-compatible ones), routed round_robin, least_load or cache_aware, with
health checks, retries, run-time add/remove, P/D disaggregation and merged metrics.

    router = Router(RouterConfig(policy="cache_aware"), worker_urls=["http://127.0.0.1:9001"])
    await serve_router(router, "127.0.0.1", 8000)

The package's names are imported on first use: `pagedserve serve` reads router.config's policy
names without paying for the router's HTTP client stack.
"""

import importlib

_EXPORTS = {"Router": "app", "build_app": "app", "serve_router": "app", "RouterConfig": "config"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
