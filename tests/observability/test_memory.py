"""The memory breakdown accounts for the process's growth, and the capacity report is the pool's
arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.observability.memory import capacity_report, rss_bytes

# A fresh process: a test process's RSS reuses memory earlier tests freed, so its growth would
# say little. The baseline is read once the code is imported (torch's libraries are not the
# model) and before anything of the model loads (the config's GGUF header read included).
_SCRIPT = """
import json
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.observability.memory import rss_bytes
from pagedserve.sampling_params import SamplingParams
rss_before = rss_bytes()
engine = LLMEngine(EngineArgs(kv_cache_memory="256MiB", num_threads=1).create_engine_config())
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
for i in range(4):
    engine.add_request(None, {"prompt_token_ids": list(range(100 + i, 356 + i))}, params)
while engine.has_unfinished_requests():
    engine.step()
engine.assert_idle()
breakdown = engine.memory_breakdown()
engine.shutdown()
print(json.dumps({"rss_before": rss_before, "rss_after": rss_bytes(), "breakdown": breakdown}))
"""


@pytest.mark.skipif(rss_bytes() is None, reason="reads /proc/self/status (Linux only)")
def test_the_parts_add_up_to_the_rss_growth():
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                            timeout=600, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    breakdown = report["breakdown"]
    components = breakdown["components"]
    assert components["kv_pool"] == pytest.approx(256 << 20, rel=0.01)
    # The default quantization keeps the GGUF codes alone (the norms are the dense weights).
    assert components["weights_packed"] > 50 << 20 and components["weights_dense"] < 1 << 20
    assert components["tokenizer"] > 0 and components["runtime_peak"] > 0
    # The pool's pages are mapped lazily: the RSS holds the blocks written (4 requests of 17
    # blocks, and the warm-up's), not the whole pool.
    pool = breakdown["kv_pool"]
    resident_kv = breakdown["resident_bytes"]["kv_pool"]
    assert pool["resident_bytes"] == resident_kv
    assert 4 * 17 * pool["bytes_per_block"] <= resident_kv < components["kv_pool"] // 4
    growth = report["rss_after"] - report["rss_before"]
    parts = sum(components.values()) - components["kv_pool"] + resident_kv
    assert abs(parts - growth) <= 0.10 * growth, (parts, growth, components)
    assert abs(breakdown["unattributed_bytes"]) <= 0.10 * breakdown["process"]["rss_growth_bytes"]
    assert pool["used_blocks"] == 0 and pool["cached_free_blocks"] == 4 * 256 // 16
    assert pool["bytes_per_block"] * pool["num_blocks"] == components["kv_pool"]


def test_capacity_report_is_the_pools_arithmetic():
    report = capacity_report(num_blocks=101, block_size=16, max_model_len=1500,
                             bytes_per_block=1000)
    assert report == [
        {"context_len": 512, "max_requests": 3, "kv_bytes_per_request": 32000},
        {"context_len": 1024, "max_requests": 1, "kv_bytes_per_request": 64000},
        {"context_len": 1500, "max_requests": 1, "kv_bytes_per_request": 94000},
    ]


def test_capacity_report_counts_a_windowed_group_at_its_window():
    from pagedserve.core.kv_cache_manager import KVCacheManager

    # one global group and one with a 64-token window: at 1024 tokens a request holds 64
    # blocks in the first and window_blocks(64, 16) + 1 = 6 in the second
    manager = KVCacheManager(num_blocks=701, block_size=16, group_windows=(None, 64))
    report = capacity_report(num_blocks=701, block_size=16, max_model_len=1024,
                             bytes_per_block=1000, blocks_for=manager.max_blocks_for)
    assert report == [
        {"context_len": 512, "max_requests": 700 // 38, "kv_bytes_per_request": 38000},
        {"context_len": 1024, "max_requests": 700 // 70, "kv_bytes_per_request": 70000},
    ]
