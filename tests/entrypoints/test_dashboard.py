"""GET /dashboard in real headless Chromium.

The main test runs the real server (the default model, an API key, a tiny KV pool and a small
token budget so prompts are chunked and requests get preempted) under streaming load from
background threads, opens the page without the key, gives it a wrong key, then the right one, and
waits on the DOM: charts with non-zero throughput and KV usage, the memory breakdown, Gantt rows
with segments, and a request's timeline in the drawer. It saves a screenshot as a test artifact
($PAGEDSERVE_TEST_ARTIFACTS, else test-artifacts/ under the repo root).

Skips when selenium, /usr/bin/chromium or /usr/bin/chromedriver is missing (scripts/test.sh
installs the last two).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.utils import API_KEY, MODEL_NAME, serving

CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PAGEDSERVE_CHROMEDRIVER", "/usr/bin/chromedriver")
REPO_ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_STREAMS = 4
WAIT_S = 180  # generous: two shared CPU cores, and the model may still be compiling kernels

pytestmark = pytest.mark.skipif(
    not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)),
    reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver; "
           f"scripts/test.sh does it)")


def artifact_path(name: str) -> Path:
    directory = Path(os.environ.get("PAGEDSERVE_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1300", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, timeout: float = WAIT_S, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(
        lambda d: condition(d) or None, message)


def fetch_status(driver, path: str, key: str | None = None) -> int:
    """The status of a fetch() made by the page (so by the browser, with or without the key)."""
    return driver.execute_async_script(
        "const [path, key, done] = arguments;"
        "fetch(path, {headers: key ? {Authorization: 'Bearer ' + key} : {}})"
        ".then(r => done(r.status), e => done(String(e)));", path, key)


def chart_number(driver, chart: str, attribute: str) -> float:
    element = driver.find_element("css selector", f'svg[data-chart="{chart}"]')
    return float(element.get_attribute(f"data-{attribute}") or 0)


def enter_key(driver, key: str) -> None:
    field = driver.find_element("id", "key-input")
    field.clear()
    field.send_keys(key)
    driver.find_element("id", "key-submit").click()


class StreamingLoad:
    """`num_streams` threads, each sending streaming completions back to back until stop()."""

    def __init__(self, base_url: str, num_streams: int) -> None:
        self.base_url = base_url
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.num_completed = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"load-{i}",
                                         daemon=True) for i in range(num_streams)]

    def start(self) -> StreamingLoad:
        for thread in self.threads:
            thread.start()
        return self

    def _run(self, index: int) -> None:
        # A shared preamble (prefix-cache hits) and a distinct long tail (chunked prefill).
        preamble = "You are a careful assistant who explains how paged attention works. " * 3
        try:
            with httpx.Client(base_url=self.base_url, headers=AUTH, timeout=120) as client:
                round_ = 0
                while not self.stop_event.is_set():
                    prompt = (preamble + f"Stream {index}, round {round_}: "
                              + " ".join(f"item{index}-{round_}-{k}" for k in range(40)))
                    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 160,
                            "temperature": 0.8, "seed": index, "ignore_eos": True,
                            "stream": True}
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        response.raise_for_status()
                        for _ in response.iter_lines():
                            if self.stop_event.is_set():
                                break  # closing the stream aborts the request
                    self.num_completed += 1
                    round_ += 1
        except BaseException as error:  # surfaced by stop()
            if not self.stop_event.is_set():
                self.errors.append(error)

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in self.threads), "a load thread hangs"
        assert not self.errors, f"load failed: {self.errors!r}"


@pytest.fixture
def live_server(make_llm):
    """The real server over the shared weights, with LiveStats, an API key, 40 KV blocks of 16
    tokens (4 streams of ~130 + 160 tokens do not fit: preemptions) and a 48-token step budget
    (prompts prefill in several chunks)."""
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app
    from pagedserve.metrics import PrometheusStatLogger
    from pagedserve.observability.live_stats import LiveStats

    engine = make_llm(max_model_len=512, num_gpu_blocks_override=40, block_size=16,
                      max_num_batched_tokens=48, max_num_seqs=8).engine
    stat_logger = PrometheusStatLogger(MODEL_NAME, max_model_len=512)
    live_stats = LiveStats()
    async_llm = AsyncLLM(engine, [stat_logger, live_stats])
    app = build_app(async_llm, ServerConfig(served_model_name=MODEL_NAME, api_key=API_KEY,
                                            log_level="warning"))
    with serving(app, async_llm, stat_logger) as handle:
        yield handle
        handle.wait_until_idle(timeout=60)
        assert stat_logger.num_tracked_requests == 0
        assert live_stats.num_tracked_requests == 0


def test_dashboard_live_under_load(live_server, browser):
    base_url = live_server.base_url
    with httpx.Client(base_url=base_url, timeout=30) as client:
        page = client.get("/dashboard")  # no key: the page itself carries no data
        assert page.status_code == 200 and "pagedserve" in page.text
        # nothing external: no linked script, style, image or font
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|url\(|@import|<link",
                             page.text)
        assert client.get("/debug/stats").status_code == 401

    load = StreamingLoad(base_url, NUM_STREAMS).start()
    try:
        # 1. Without a key: the data calls get 401 and the page asks for the key.
        browser.get(base_url + "/dashboard")
        wait_for(browser, lambda d: d.find_element("id", "key-prompt").is_displayed(), 30,
                 "the key prompt did not appear")
        assert browser.find_element("tag name", "body").get_attribute("data-auth") == "required"
        assert fetch_status(browser, "/debug/stats") == 401
        assert fetch_status(browser, "/v1/requests?limit=1") == 401
        assert fetch_status(browser, "/debug/stats", API_KEY) == 200

        # 2. A wrong key is rejected with a clear message.
        enter_key(browser, "not-the-key")
        wait_for(browser, lambda d: d.find_element("tag name", "body")
                 .get_attribute("data-auth") == "rejected", 30, "a wrong key was not rejected")
        assert browser.find_element("id", "key-prompt").is_displayed()
        assert "rejected" in browser.find_element("id", "key-message").text

        # 3. The right key: the prompt goes and the data comes.
        enter_key(browser, API_KEY)
        wait_for(browser, lambda d: not d.find_element("id", "key-prompt").is_displayed()
                 and d.find_element("tag name", "body").get_attribute("data-auth") == "ok", 30,
                 "the right key was not accepted")

        # 4. Charts with non-zero throughput and KV usage.
        wait_for(browser, lambda d: chart_number(d, "throughput", "max") > 0
                 and chart_number(d, "kv", "max") > 0 and chart_number(d, "requests", "max") > 0,
                 message="the charts show no throughput or KV usage")
        assert chart_number(browser, "throughput", "points") > 0
        assert browser.find_elements("css selector", 'svg[data-chart="throughput"] path')

        # 5. The memory breakdown: weights and the KV pool.
        wait_for(browser, lambda d: float(d.find_element("id", "memory")
                                          .get_attribute("data-weights-bytes")) > 0
                 and float(d.find_element("id", "memory").get_attribute("data-kv-bytes")) > 0,
                 60, "the memory breakdown shows no weights or KV pool")
        assert browser.find_elements("css selector", "#memory-bar > div")

        # 6. The Gantt chart: request rows with segments, prefill chunks among them. Latency
        # percentiles need finished first tokens; a preemption shows if the pool ran out.
        wait_for(browser, lambda d: d.find_elements(
            "css selector", ".gantt-row rect.seg.prefill")
            and d.find_elements("css selector", ".gantt-row rect.seg.decode")
            and chart_number(d, "ttft", "max") > 0 and chart_number(d, "itl", "max") > 0,
            message="no Gantt row with prefill and decode segments, or no latency samples")
        try:  # not asserted: whether the pool runs out depends on timing
            wait_for(browser, lambda d: d.find_elements("css selector", "rect.seg.preempted"),
                     45)
        except Exception:
            pass
        browser.save_screenshot(str(artifact_path("dashboard-overview.png")))

        # 7. Clicking a row opens its timeline: request id and explanation.
        def click_a_decoded_row(driver) -> str | None:
            from selenium.common.exceptions import StaleElementReferenceException

            try:
                row = driver.find_elements(
                    "css selector", ".gantt-row:has(rect.seg.decode)")[-1]
                request_id = row.get_attribute("data-request-id")
                row.find_element("css selector", "rect.seg.decode").click()
                return request_id
            except StaleElementReferenceException:
                return None  # the live view re-rendered between find and click: again

        request_id = wait_for(browser, click_a_decoded_row, 30, "no decoded row could be clicked")
        wait_for(browser, lambda d: d.find_element("id", "detail").is_displayed()
                 and d.find_element("id", "detail").get_attribute("data-loaded") == "true", 30,
                 "the timeline panel did not open")
        detail = browser.find_element("id", "detail")
        assert detail.get_attribute("data-request-id") == request_id
        assert browser.find_element("id", "detail-id").text == request_id
        explanation = browser.find_element("id", "detail-explanation").text
        assert explanation.startswith("TTFT") or "waiting" in explanation, explanation
        assert "first_token" in detail.text  # the events table
        browser.save_screenshot(str(artifact_path("dashboard.png")))
    finally:
        load.stop()


# ---- the page over canned data (no model): the drawing and the key handling alone --------------


def canned_timeline(index: int, arrival: float, state: str) -> dict:
    """A timeline shaped like TimelineStore's: queued, three prefill chunks, decode runs, and
    (for odd indexes) a preemption and a recomputing chunk."""
    segments = [{"kind": "queued", "start": 0.0, "end": 0.3}]
    t = 0.3
    for step in range(3):
        segments.append({"kind": "prefill", "start": t, "end": t + 0.2, "first_step": step,
                         "num_tokens": 48, "num_computed_tokens": 48 * step})
        t += 0.25
    segments.append({"kind": "decode", "start": t, "end": t + 2.0, "first_step": 3,
                     "num_tokens": 40, "last_step": 42, "num_steps": 40})
    t += 2.0
    if index % 2:
        segments.append({"kind": "preempted", "start": t, "end": t + 1.0, "step": 43,
                         "num_tokens_lost": 180})
        segments.append({"kind": "prefill", "start": t + 1.0, "end": t + 1.3, "first_step": 60,
                         "num_tokens": 48, "num_computed_tokens": 0})
        t += 1.3
    end = None if state == "running" else t + 1.5
    segments.append({"kind": "decode", "start": t, "end": end, "first_step": 61,
                     "num_tokens": 30, "last_step": 90, "num_steps": 30})
    return {
        "object": "request.timeline", "request_id": f"cmpl-{index:04d}abcdef",
        "sequence_id": f"cmpl-{index:04d}abcdef", "state": state, "arrival_time": arrival,
        "finish_reason": None if state == "running" else "length", "lora_name": None,
        "num_prompt_tokens": 144, "num_output_tokens": 70, "max_tokens": 160,
        "summary": {"queue_s": 0.3, "prefill_s": 0.75, "decode_s": 4.0, "e2e_s": end,
                    "ttft_s": 1.05, "admission_wait_s": 0.0, "num_prefill_chunks": 3,
                    "num_decode_steps": 70, "cached_tokens": {"device": 32},
                    "num_preemptions": index % 2, "num_recomputed_tokens": 180 * (index % 2),
                    "ttft_breakdown": {"admission_wait_s": 0.0, "queued_s": 0.3,
                                       "in_steps_s": 0.6, "preempted_s": 0.0,
                                       "between_steps_s": 0.15},
                    "explanation": f"TTFT 1.050 s: 0.600 s in 3 prefill step(s) (57%), 0.300 s "
                                   f"queued before its first step (29%) [{index}]"},
        "segments": segments,
        "events": [{"t": 0.0, "type": "queued", "num_prompt_tokens": 144},
                   {"t": 1.05, "type": "first_token"}],
        "itl": {"count": 69, "mean_s": 0.05, "p50_s": 0.045, "p90_s": 0.08, "p99_s": 0.2,
                "max_s": 0.3},
        "speculative": None, "grammar": None,
    }


@pytest.fixture
def canned_server():
    import time
    from types import SimpleNamespace

    from fastapi import FastAPI, Request
    from starlette.responses import JSONResponse

    from pagedserve.core.stats import SchedulerStats
    from pagedserve.entrypoints.openai.dashboard import add_dashboard_routes
    from pagedserve.observability.live_stats import LiveStats

    live_stats = LiveStats()
    start = time.monotonic() - 150
    for second in range(151):
        busy = 30 <= second <= 140
        live_stats.record_step(SchedulerStats(
            num_running_reqs=4 if busy else 0, num_waiting_reqs=2 if busy else 0,
            kv_cache_usage=0.6 + 0.3 * (second % 7) / 7 if busy else 0.0,
            prefix_cache_queries=second * 100, prefix_cache_hits=second * 40,
            num_preemptions=second // 20, num_prompt_tokens_computed=second * 150,
            num_generation_tokens=second * 60), start + second)
    now = time.time()
    timelines = [canned_timeline(i, now - 40 + 3 * i, "running" if i >= 10 else "finished")
                 for i in range(12)][::-1]
    memory = {"process": {"rss_bytes": 900 << 20, "rss_at_start_bytes": 300 << 20,
                          "rss_growth_bytes": 600 << 20},
              "components": {"weights_packed": 90 << 20, "weights_dense": 270 << 20,
                             "kv_pool": 29 << 20, "activations_peak": 40 << 20},
              "attributed_bytes": 429 << 20, "unattributed_bytes": 471 << 20,
              "kv_pool": {"num_blocks": 40, "block_size": 16, "bytes_per_block": 737280,
                          "used_blocks": 30, "cached_free_blocks": 4, "free_blocks": 6},
              "capacity": [{"context_len": 512, "max_requests": 1},
                           {"context_len": 128, "max_requests": 5}]}
    app = FastAPI()

    @app.middleware("http")
    async def gate(request: Request, call_next):
        if (request.url.path != "/dashboard"
                and request.headers.get("authorization") != f"Bearer {API_KEY}"):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return await call_next(request)

    @app.get("/v1/requests")
    async def requests(limit: int = 50) -> dict:
        return {"object": "list", "data": timelines[:limit]}

    @app.get("/v1/requests/{request_id}/timeline")
    async def timeline(request_id: str) -> dict:
        return next(t for t in timelines if t["sequence_id"] == request_id)

    @app.get("/debug/memory")
    async def debug_memory() -> dict:
        return memory

    add_dashboard_routes(app, SimpleNamespace(stat_loggers=[live_stats]))
    with serving(app, SimpleNamespace(shutdown=_no_shutdown)) as handle:
        yield handle


async def _no_shutdown(drain_timeout=None) -> None:
    pass


def test_dashboard_over_canned_data(canned_server, browser):
    # The key in the URL fragment: no prompt, and the fragment leaves the address bar.
    browser.get(canned_server.base_url + f"/dashboard#key={API_KEY}")
    wait_for(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-auth")
             == "ok", 30, "the key from the fragment was not used")
    assert "key=" not in browser.current_url
    wait_for(browser, lambda d: chart_number(d, "throughput", "points") > 100
             and int(d.find_element("id", "gantt").get_attribute("data-rows")) == 12
             and float(d.find_element("id", "memory").get_attribute("data-kv-bytes")) > 0, 30)
    assert chart_number(browser, "throughput", "max") == 150.0
    assert chart_number(browser, "kv", "max") > 0.6
    assert browser.find_elements("css selector", "rect.seg.preempted")
    assert len(browser.find_elements("css selector", "rect.seg.prefill")) >= 12 * 3
    browser.find_element("css selector", '.gantt-row[data-request-id="cmpl-0003abcdef"] '
                                         'rect.seg.decode').click()
    wait_for(browser, lambda d: d.find_element("id", "detail")
             .get_attribute("data-request-id") == "cmpl-0003abcdef", 30)
    assert "[3]" in browser.find_element("id", "detail-explanation").text
    browser.save_screenshot(str(artifact_path("dashboard-canned.png")))
