"""The router: a pool of OpenAI-compatible workers behind one FastAPI app, and its server.

Owns the worker pool (health polls, in-flight counts, run-time add/remove), proxying of the
OpenAI routes and of /tokenize, /detokenize and /version (one retry on another worker before the
first response byte, the upstream request closed the moment the client leaves), P/D two-step
requests, and the routes. Which worker gets a request is the
policy's (policies.py); relaying a stream is streaming.py's; metrics are metrics.py's.
Knows nothing of the engine: a worker is a URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from collections.abc import Set as AbstractSet
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import quote

import httpx
import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from pagedserve.entrypoints.openai.auth import ApiKeyGate
from pagedserve.entrypoints.openai.errors import APIError, add_exception_handlers, bad_request
from pagedserve.router.config import RouterConfig
from pagedserve.router.metrics import RouterMetrics, merge_metrics
from pagedserve.router.policies import WorkerLoad, create_policy, routing_text
from pagedserve.router.streaming import ProxiedStream, UpstreamError, until_disconnect

logger = logging.getLogger(__name__)

ROLES = ("regular", "prefill", "decode")
"""A worker serves whole requests (regular), or one half of them in P/D mode."""
_RETRY_STATUSES = frozenset({502, 503, 504})
_FORWARDED_HEADERS = ("authorization",)


def _no_healthy_worker(role: str) -> UpstreamError:
    what = "worker" if role == "regular" else f"{role} worker"
    return UpstreamError(f"no healthy {what}", code="no_healthy_workers", status_code=503)


@dataclass(frozen=True)
class PolledLoad:
    """A worker's answer to GET /load."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float


@dataclass(eq=False)
class Worker:
    url: str
    label: str
    role: str
    healthy: bool = False
    """In rotation; False until a health check passes."""
    in_flight: int = 0
    """Requests the router sent and has not finished (a stream counts until it ends)."""
    polled_load: PolledLoad | None = None
    removed: bool = False
    """Out of the pool; its in-flight requests still finish."""

    def describe(self) -> dict[str, Any]:
        polled = self.polled_load
        return {"url": self.url, "label": self.label, "role": self.role, "healthy": self.healthy,
                "in_flight": self.in_flight, "load": None if polled is None else asdict(polled)}


class Router:
    """The worker pool and the proxy. P/D mode (config.pd) takes prefill_urls and decode_urls
    instead of worker_urls; worker_labels (default: the URLs) go with worker_urls, prefill and
    decode workers are labelled by URL. Call start() in the serving loop (build_app's lifespan
    does) and close() when done (serve_router does)."""

    def __init__(self, config: RouterConfig, worker_urls: Sequence[str] = (),
                 worker_labels: Sequence[str] | None = None, *, prefill_urls: Sequence[str] = (),
                 decode_urls: Sequence[str] = ()) -> None:
        if config.pd and worker_urls:
            raise ValueError("P/D mode takes prefill and decode workers, not regular ones")
        if not config.pd and (prefill_urls or decode_urls):
            raise ValueError("prefill and decode workers need P/D mode (RouterConfig.pd)")
        if worker_labels is not None and len(worker_labels) != len(worker_urls):
            raise ValueError(f"{len(worker_labels)} worker labels for {len(worker_urls)} workers")
        self.config = config
        self.metrics = RouterMetrics()
        self._workers: dict[str, Worker] = {}
        self._policies = {role: create_policy(config) for role in ROLES}
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()
        """The health loop and one-off checks of added workers; cancelled by close()."""
        for index, url in enumerate(worker_urls):
            self.add_worker(url, None if worker_labels is None else worker_labels[index])
        for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
            for url in urls:
                self.add_worker(url, role=role)

    # ---- the pool ----

    @property
    def serving_role(self) -> str:
        """The role whose workers answer clients."""
        return "decode" if self.config.pd else "regular"

    @property
    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def add_worker(self, url: str, label: str | None = None, *, role: str = "regular") -> None:
        """Add a worker; it enters rotation once a health check passes (at once if started)."""
        url = _normalize_url(url)
        allowed = ("prefill", "decode") if self.config.pd else ("regular",)
        if role not in allowed:
            raise ValueError(f"role must be one of {', '.join(allowed)} here, got {role!r}")
        if url in self._workers:
            raise ValueError(f"worker {url} is already in the pool")
        label = url if label is None else label
        if any(worker.label == label for worker in self._workers.values()):
            raise ValueError(f"worker label {label!r} is already taken")
        worker = self._workers[url] = Worker(url, label, role)
        self._update_metrics(worker)
        if self._client is not None:
            self._spawn(self._check_worker(worker))

    def remove_worker(self, url: str) -> bool:
        """Take a worker out of the pool (its in-flight requests finish); False if unknown."""
        worker = self._workers.pop(_normalize_url(url), None)
        if worker is None:
            return False
        worker.removed = True
        self._policies[worker.role].remove_worker(worker.url)
        self.metrics.remove_worker(worker.label)
        logger.info("removed worker %s (%d requests in flight)", worker.label, worker.in_flight)
        return True

    def mark_unhealthy(self, url: str, reason: str = "marked unhealthy") -> None:
        """Out of rotation until a health check passes."""
        worker = self._workers.get(_normalize_url(url))
        if worker is not None:
            self._set_healthy(worker, False, reason)

    def has_healthy_worker(self) -> bool:
        return any(w.healthy for w in self._workers.values() if w.role == self.serving_role)

    def _set_healthy(self, worker: Worker, healthy: bool, reason: str = "") -> None:
        if healthy != worker.healthy and not worker.removed:
            if healthy:
                logger.info("worker %s is healthy", worker.label)
            else:
                logger.warning("worker %s is out of rotation: %s", worker.label, reason)
        worker.healthy = healthy
        self._update_metrics(worker)

    def _update_metrics(self, worker: Worker) -> None:
        if not worker.removed:  # a removed worker's series are gone; its requests still finish
            self.metrics.set_worker(worker.label, worker.healthy, worker.in_flight)

    def _select(self, role: str, text: str,
                exclude: AbstractSet[str] = frozenset()) -> Worker | None:
        candidates = [w for w in self._workers.values()
                      if w.role == role and w.healthy and w.url not in exclude]
        if not candidates:
            return None
        loads = [WorkerLoad(w.url, w.in_flight) if w.polled_load is None else WorkerLoad(
                     w.url, w.in_flight, w.polled_load.num_running + w.polled_load.num_waiting,
                     w.polled_load.kv_cache_usage) for w in candidates]
        decision = self._policies[role].select(loads, text)
        if decision.affinity_hit:
            self.metrics.affinity_hits.inc()
        return self._workers[decision.url]

    def _acquire(self, worker: Worker) -> None:
        worker.in_flight += 1
        self.metrics.requests.labels(worker.label).inc()
        self._update_metrics(worker)

    def _release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        assert worker.in_flight >= 0, worker
        self._update_metrics(worker)

    # ---- lifecycle and health checks ----

    async def start(self) -> None:
        """Open the upstream client, check every worker once, then keep polling. Idempotent."""
        if self._client is not None:
            return
        # trust_env=False: workers are reached directly, never through an HTTP(S)_PROXY.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s), trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024))
        await self.check_health()
        self._spawn(self._health_loop())

    async def close(self) -> None:
        """Stop the health checks and close every upstream connection."""
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        """Poll every worker's /health (and /load) once."""
        await asyncio.gather(*(self._check_worker(w) for w in self.workers))

    async def _check_worker(self, worker: Worker) -> None:
        assert self._client is not None
        timeout = self.config.health_check_timeout_s
        try:
            response = await self._client.get(worker.url + "/health", timeout=timeout)
            problem = None if response.status_code == 200 else f"/health {response.status_code}"
        except httpx.HTTPError as error:
            problem = f"/health failed: {error!r}"
        polled_load = None
        if problem is None:
            try:  # a worker without /load (404) is balanced on in-flight counts alone
                response = await self._client.get(worker.url + "/load", timeout=timeout)
                if response.status_code == 200:
                    data = response.json()
                    polled_load = PolledLoad(int(data["num_running"]), int(data["num_waiting"]),
                                             float(data["kv_cache_usage"]))
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
        worker.polled_load = polled_load
        self._set_healthy(worker, problem is None, problem or "")

    # ---- proxying ----

    async def forward(self, path: str, content: bytes, body: dict,
                      headers: dict[str, str]) -> Response:
        """Send a completion/chat request (`content`, parsed as `body`) to a worker and return
        the client's response. A streamed one holds its worker slot until the stream ends."""
        text = routing_text(body)
        if not self.has_healthy_worker():
            raise _no_healthy_worker(self.serving_role)
        if self.config.pd:
            await self._prefill(path, body, headers, text)
        return await self._forward_with_retry(path, content, headers, text,
                                              stream=body.get("stream") is True)

    async def forward_plain(self, path: str, content: bytes,
                            headers: dict[str, str]) -> Response:
        """A request that generates nothing (/tokenize, /detokenize): any healthy worker that
        serves clients, with the same retry; no prefix affinity, no P/D prefill."""
        if not self.has_healthy_worker():
            raise _no_healthy_worker(self.serving_role)
        return await self._forward_with_retry(path, content, headers, "", stream=False)

    async def _forward_with_retry(self, path: str, content: bytes, headers: dict[str, str],
                                  text: str, stream: bool) -> Response:
        tried: set[str] = set()
        response: Response | None = None
        for attempt in range(1 + self.config.max_retries):
            worker = self._select(self.serving_role, text, exclude=tried)
            if worker is None:
                break  # no other worker: the client gets the last failure as it was
            if attempt > 0:
                self.metrics.retries.inc()
                logger.info("retrying on worker %s", worker.label)
            tried.add(worker.url)
            response, retryable = await self._attempt(worker, path, content, headers, stream)
            if not retryable:
                break
        if response is None:
            raise _no_healthy_worker(self.serving_role)
        return response

    async def _attempt(self, worker: Worker, path: str, content: bytes, headers: dict[str, str],
                       stream: bool) -> tuple[Response, bool]:
        """One try on `worker`: (the client's response, whether it failed before the first
        response byte, so that another worker may be tried)."""
        assert self._client is not None
        self._acquire(worker)
        upstream: httpx.Response | None = None
        handed_over = False
        try:
            request = self._client.build_request("POST", worker.url + path, content=content,
                                                 headers=headers)
            try:
                upstream = await self._client.send(request, stream=True)  # returns at headers
            except httpx.TransportError as error:
                self.mark_unhealthy(worker.url, f"request failed: {error!r}")
                return UpstreamError(f"worker {worker.label} failed: {error!r}").response(), True
            if stream and upstream.status_code == 200:
                handed_over = True  # the response owns the upstream and the worker slot now
                return ProxiedStream(upstream, worker.label,
                                     on_error=lambda error: self._stream_failed(worker, error),
                                     on_close=lambda: self._release(worker)), False
            try:
                data = await upstream.aread()
            except httpx.TransportError as error:  # after the first byte: no retry
                self.mark_unhealthy(worker.url, f"response failed: {error!r}")
                return UpstreamError(f"worker {worker.label} failed: {error!r}").response(), False
            return (Response(data, upstream.status_code,
                             media_type=upstream.headers.get("content-type")),
                    upstream.status_code in _RETRY_STATUSES)
        finally:
            if not handed_over:
                try:
                    if upstream is not None:
                        await upstream.aclose()  # also on cancellation: the worker sees it close
                finally:
                    self._release(worker)

    async def _prefill(self, path: str, body: dict, headers: dict[str, str], text: str) -> None:
        """P/D: run the prompt on a prefill worker (1 token) so that the decode worker finds its
        KV; on failure count a fallback (the decode worker computes the prompt itself)."""
        assert self._client is not None
        worker = self._select("prefill", text)
        if worker is None:
            self._pd_fallback("no healthy prefill worker")
            return
        content = json.dumps(_prefill_body(body)).encode()
        self._acquire(worker)
        try:
            response = await self._client.post(worker.url + path, content=content,
                                               headers=headers)
            if response.status_code != 200:
                self._pd_fallback(f"prefill on {worker.label} answered {response.status_code}")
        except httpx.TransportError as error:
            self.mark_unhealthy(worker.url, f"prefill failed: {error!r}")
            self._pd_fallback(f"prefill on {worker.label} failed: {error!r}")
        finally:
            self._release(worker)

    def _pd_fallback(self, reason: str) -> None:
        logger.warning("%s: the decode worker computes the prompt", reason)
        self.metrics.pd_fallbacks.inc()

    def _stream_failed(self, worker: Worker, error: Exception) -> None:
        self.metrics.stream_errors.inc()
        self.mark_unhealthy(worker.url, f"stream failed: {error!r}")

    async def get_from_any(self, path: str, headers: dict[str, str]) -> Response:
        """GET `path` (/v1/models, /version) from the first healthy worker serving clients
        (P/D: a decode worker) that answers."""
        assert self._client is not None
        for worker in [w for w in self._workers.values()
                       if w.healthy and w.role == self.serving_role]:
            try:
                response = await self._client.get(worker.url + path, headers=headers,
                                                  timeout=self.config.health_check_timeout_s)
            except httpx.TransportError as error:
                self.mark_unhealthy(worker.url, f"{path} failed: {error!r}")
                continue
            if response.status_code not in _RETRY_STATUSES:
                return Response(response.content, response.status_code,
                                media_type=response.headers.get("content-type"))
        raise _no_healthy_worker(self.serving_role)

    async def get_from_each(self, path: str, headers: dict[str, str]
                            ) -> list[tuple[Worker, httpx.Response]]:
        """GET `path` from every healthy worker serving clients, at once; the answers of those
        that answered (a worker's timelines and memory are its own)."""
        assert self._client is not None
        workers = [w for w in self._workers.values()
                   if w.healthy and w.role == self.serving_role]

        async def get(worker: Worker) -> httpx.Response | None:
            try:
                return await self._client.get(worker.url + path, headers=headers,
                                              timeout=self.config.health_check_timeout_s)
            except httpx.TransportError:
                return None

        responses = await asyncio.gather(*(get(worker) for worker in workers))
        return [(w, r) for w, r in zip(workers, responses) if r is not None]

    async def render_metrics(self) -> bytes:
        """The router's metrics, plus, with worker_metrics_label, every healthy worker's."""
        text = self.metrics.render()
        label_name = self.config.worker_metrics_label
        if label_name is None:
            return text
        workers = [w for w in self._workers.values() if w.healthy]
        texts = await asyncio.gather(*(self._worker_metrics(w) for w in workers))
        return text + merge_metrics([(worker.label, worker_text) for worker, worker_text
                                     in zip(workers, texts) if worker_text is not None],
                                    label_name)

    async def _worker_metrics(self, worker: Worker) -> str | None:
        assert self._client is not None
        try:
            response = await self._client.get(worker.url + "/metrics",
                                              timeout=self.config.health_check_timeout_s)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None


def _normalize_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a worker URL starts with http:// or https://, got {url!r}")
    return url.rstrip("/")


def _prefill_body(body: dict) -> dict:
    """The P/D prefill request: the same prompt and options, one token, no stream."""
    prefill = {key: value for key, value in body.items()
               if key not in ("stream_options", "min_tokens")}  # min_tokens > 1 would be a 400
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    return prefill


# ---- the app ----------------------------------------------------------------------------------


def build_app(router: Router) -> FastAPI:
    """The router's HTTP API. Its lifespan starts the router; the caller closes it
    (serve_router does)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield

    app = FastAPI(title="pagedserve router", lifespan=lifespan)
    app.state.router = router
    if router.config.api_key is not None:
        app.add_middleware(ApiKeyGate, api_key=router.config.api_key,
                           open_paths=frozenset({"/health"}))
    add_exception_handlers(app)

    async def proxy(request: Request, path: str, generates: bool = True) -> Response:
        try:
            content = await request.body()
        except ClientDisconnect:
            raise bad_request("the client disconnected while sending the body") from None
        try:
            body = json.loads(content)
        except (ValueError, RecursionError):
            raise bad_request("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        headers = {"content-type": "application/json", **_forwarded_headers(request)}
        work = (router.forward(path, content, body, headers) if generates
                else router.forward_plain(path, content, headers))
        response = await until_disconnect(request.receive, work)
        return Response(status_code=499) if response is None else response  # 499: client left

    @app.get("/health")
    async def health() -> Response:  # P/D: decode workers serve clients (prefill may fall back)
        if not router.has_healthy_worker():
            raise _no_healthy_worker(router.serving_role)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return await router.get_from_any("/v1/models", _forwarded_headers(request))

    @app.get("/version")
    async def version(request: Request) -> Response:
        return await router.get_from_any("/version", _forwarded_headers(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await proxy(request, "/tokenize", generates=False)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await proxy(request, "/detokenize", generates=False)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request) -> Response:
        # Prefill only: no prefix affinity to keep (last pooling's hits are a bonus), no P/D.
        return await proxy(request, "/v1/embeddings", generates=False)

    @app.post("/add_worker")
    async def add_worker(url: str, label: str | None = None, role: str = "regular") -> dict:
        try:
            router.add_worker(url, label, role=role)
        except ValueError as error:  # a bad or known URL, a taken label, a role out of place
            raise bad_request(str(error)) from None
        return {"added": _normalize_url(url)}

    @app.post("/remove_worker")
    async def remove_worker(url: str) -> dict:
        try:
            removed = router.remove_worker(url)
        except ValueError as error:
            raise bad_request(str(error), "url") from None
        if not removed:
            raise APIError(404, f"no worker {url}", param="url", code="worker_not_found")
        return {"removed": _normalize_url(url)}

    @app.get("/list_workers")
    async def list_workers() -> list[dict]:
        return [worker.describe() for worker in router.workers]

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    # Each worker keeps its own requests' timelines: ask them all, label what comes back.
    @app.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request: Request, request_id: str) -> JSONResponse:
        path = f"/v1/requests/{quote(request_id, safe='')}/timeline"
        for worker, response in await router.get_from_each(path, _forwarded_headers(request)):
            if response.status_code == 200:
                return JSONResponse({**response.json(), "worker": worker.label})
        raise APIError(404, f"no worker holds a timeline for request {request_id!r}",
                       code="request_not_found")

    @app.get("/v1/requests")
    async def list_requests(request: Request, limit: int = 50) -> JSONResponse:
        if limit < 1:
            raise bad_request(f"limit must be >= 1, got {limit}", "limit")
        answers = await router.get_from_each(f"/v1/requests?limit={limit}",
                                             _forwarded_headers(request))
        timelines = [{**timeline, "worker": worker.label} for worker, response in answers
                     if response.status_code == 200 for timeline in response.json()["data"]]
        timelines.sort(key=lambda timeline: timeline["arrival_time"], reverse=True)
        return JSONResponse({"object": "list", "data": timelines[:limit]})

    @app.get("/debug/memory")
    async def debug_memory(request: Request) -> JSONResponse:
        answers = await router.get_from_each("/debug/memory", _forwarded_headers(request))
        return JSONResponse({"object": "list", "data": [
            {**response.json(), "worker": worker.label} for worker, response in answers
            if response.status_code == 200]})

    return app


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}


# ---- serving ----------------------------------------------------------------------------------


class _RouterServer(uvicorn.Server):
    """uvicorn's server, except that a signal does not kill the process once the server has
    stopped (uvicorn re-raises it), so that serve_router's cleanup runs. The first SIGTERM/SIGINT
    stops accepting and lets open requests finish (up to shutdown_timeout_s); a second cuts them."""

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


async def serve_router(router: Router, host: str, port: int,
                       on_shutdown: Callable[[], Awaitable[None]] | None = None,
                       log_level: str = "info") -> None:
    """Serve build_app(router) until SIGTERM/SIGINT; then await `on_shutdown()` and close the
    router (health task, upstream client)."""
    config = uvicorn.Config(build_app(router), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=router.config.shutdown_timeout_s)
    server = _RouterServer(config)
    try:
        await router.start()
        await server.serve()
    finally:
        try:
            if on_shutdown is not None:
                await on_shutdown()
        finally:
            await router.close()
