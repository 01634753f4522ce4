"""The live dashboard: `GET /dashboard` (a self-contained page) and `GET /debug/stats` (the time
series it charts, from a LiveStats among the engine's stat loggers).

The page carries no data, so it is served without the API key (api_server.py lists its path);
its fetch() calls send the key themselves. Its files live in dashboard/ (package data) and are
inlined into one HTML response: one unauthenticated path, no external resources.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from starlette.responses import HTMLResponse, JSONResponse

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.observability.live_stats import LiveStats

DASHBOARD_PATH = "/dashboard"
_PAGE_HEADERS = {
    # Everything is inline; data comes from this origin only.
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                               "style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
}


def render_page() -> str:
    """dashboard.html with dashboard.css and dashboard.js inlined."""
    files = resources.files("pagedserve.entrypoints.openai") / "dashboard"
    html = (files / "dashboard.html").read_text(encoding="utf-8")
    css = (files / "dashboard.css").read_text(encoding="utf-8")
    js = (files / "dashboard.js").read_text(encoding="utf-8")
    assert "</script" not in js and "</style" not in css, "an asset would end its inline tag"
    return html.replace("/*__DASHBOARD_CSS__*/", css).replace("/*__DASHBOARD_JS__*/", js)


def find_live_stats(async_llm: AsyncLLM) -> LiveStats | None:
    return next((s for s in async_llm.stat_loggers if isinstance(s, LiveStats)), None)


def add_dashboard_routes(app: FastAPI, async_llm: AsyncLLM,
                         live_stats: LiveStats | None = None) -> None:
    """`live_stats`: default, the LiveStats among `async_llm.stat_loggers`; without one,
    /debug/stats answers 404 (the page says so and charts nothing)."""
    if live_stats is None:
        live_stats = find_live_stats(async_llm)
    page = render_page()

    @app.get(DASHBOARD_PATH, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    @app.get("/debug/stats")
    async def debug_stats() -> JSONResponse:
        if live_stats is None:
            raise APIError(404, "this server records no live stats (no LiveStats among the "
                           "engine's stat loggers)", code="not_found")
        return JSONResponse(live_stats.snapshot())
