"""Routes that explain the server's requests and memory (observability/):

    GET /v1/requests                      recent requests' timelines, newest first (?limit=N)
    GET /v1/requests/{id}/timeline        one request's timeline, by its response id
    GET /debug/memory                     where the memory went, and how many requests fit
    GET /debug/experts                    an MoE model's expert load: tokens routed to each
                                          expert of each layer since start-up

The memory breakdown is also exported as the gauge `pagedserve:memory_bytes{component}`,
refreshed on each scrape of /metrics (see `refresh_memory_gauges`).
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge
from starlette.responses import JSONResponse

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.errors import APIError, bad_request
from pagedserve.observability.timeline import TimelineStore


def add_debug_routes(app: FastAPI, async_llm: AsyncLLM, timelines: TimelineStore) -> None:
    @app.get("/v1/requests")
    async def list_requests(limit: int = 50) -> JSONResponse:
        if not 1 <= limit <= timelines.history:
            raise bad_request(f"limit must be in [1, {timelines.history}] (--timeline-history), "
                              f"got {limit}", "limit")
        return JSONResponse({"object": "list", "data": timelines.recent(limit)})

    @app.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> JSONResponse:
        timeline = timelines.get(request_id)
        if timeline is None:
            raise APIError(404, f"no timeline for request {request_id!r}: unknown, or older "
                           f"than the last {timelines.history} requests (--timeline-history)",
                           code="request_not_found")
        return JSONResponse(timeline)

    @app.get("/debug/memory")
    async def debug_memory() -> JSONResponse:
        return JSONResponse(await async_llm.memory_breakdown())

    @app.get("/debug/experts")
    async def debug_experts() -> JSONResponse:
        # JSON on demand rather than a Prometheus series per (layer, expert): thousands of
        # series on a real MoE (24 layers x 60 experts) for a metric read now and then.
        load = await async_llm.expert_load()
        return JSONResponse({"object": "expert_load",
                             "layers": [{"layer": layer, "expert_tokens": counts}
                                        for layer, counts in load.items()]})


class MemoryGauges:
    """`pagedserve:memory_bytes{model_name, component}` (plus the process's RSS as component
    "rss"), set from a fresh breakdown before each scrape."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        self.gauge = Gauge("pagedserve:memory_bytes",
                           "Memory by part (GET /debug/memory): tensors by their bytes, the "
                           "tokenizer and the runtime peak by RSS growth; rss is the engine "
                           "process's resident set.", ["model_name", "component"],
                           registry=registry)

    async def refresh(self, async_llm: AsyncLLM) -> None:
        breakdown = await async_llm.memory_breakdown()
        for component, value in breakdown["components"].items():
            self.gauge.labels(model_name=self.model_name, component=component).set(value or 0)
        rss = breakdown["process"]["rss_bytes"]
        if rss is not None:
            self.gauge.labels(model_name=self.model_name, component="rss").set(rss)
