"""`pagedserve serve` on the default model, as a user starts it: healthy within a generous bound,
every start-up phase logged, nothing compiled, and the warm-up counted nowhere."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME
from tests.processes import ServedProcess, free_port, metric

pytestmark = pytest.mark.slow

HEALTHY_WITHIN_S = 120.0
"""A regression guard, not a benchmark (generous for a loaded machine): a few seconds when quiet;
53 s before the kernels were built at install and the GGUF header read once."""
PHASES = ("config", "tokenizer", "kernels", "weights", "KV pool", "outliers", "warm-up")
"""In the order they run; then the server listens."""
PROMPT_TOKENS = "pagedserve:prompt_tokens_computed_total"


def test_serve_is_healthy_soon_logs_its_phases_and_compiles_nothing(tmp_path):
    from pagedserve.kernels import cpu_ops

    extensions_dir = tmp_path / "torch_extensions"  # where a serve-time build would write
    port = free_port()
    # One thread: two OpenMP threads on a loaded machine (the suite beside a CPU burner) wait on
    # each other's time slices, and loading alone took over a minute that way.
    with ServedProcess(["serve", MODEL_NAME, "--port", str(port), "--kv-cache-memory", "128MiB",
                        "--num-threads", "1"],
                       tmp_path / "serve.log", f"http://127.0.0.1:{port}",
                       start_timeout_s=HEALTHY_WITHIN_S,
                       env={"TORCH_EXTENSIONS_DIR": str(extensions_dir)}) as server:
        log = server.log_tail(num_chars=100_000)
        for phase in PHASES:
            assert re.search(rf"startup: {phase} +\d+\.\d\d s", log), (phase, log)
        assert "startup: listening on http://" in log
        # In order, and /health answered only after the warm-up (the server listens last).
        positions = [log.index(f"startup: {phase}") for phase in (*PHASES, "listening")]
        assert positions == sorted(positions), log
        # the default model in fp32 keeps fp16 codes (engine/arg_utils.py resolve_kv_cache_dtype)
        assert re.search(r"KV pool .* \d+ blocks of 16 tokens = \d+ tokens of (fp16|bfloat16) KV",
                         log)
        kernels_line = next(line for line in log.splitlines() if "startup: kernels" in line)
        if cpu_ops.load() is not None:  # built here, so the server must use them
            assert "C++ CPU kernels" in kernels_line
            # its int8 layers' outlier channels, chosen on the calibration text (layers/outliers.py)
            assert re.search(r"outliers .* \d+ int8 input channels multiplied exactly in each of "
                             r"\d+ layers, chosen on \d+ calibration tokens", log), log
        assert not extensions_dir.exists() or not any(extensions_dir.iterdir())

        # The warm-up's tokens are counted nowhere; a real request's are (the metric exists).
        assert metric(server.base_url, PROMPT_TOKENS) == 0
        response = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 30
        while metric(server.base_url, PROMPT_TOKENS) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(server.base_url, PROMPT_TOKENS) > 0
