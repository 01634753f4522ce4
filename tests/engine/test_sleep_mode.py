"""The engine's lifecycle offline: sleep (level 1: the KV pool; level 2: the weights too),
wake_up, update_weights and their rules (sleep mode must be on, the engine idle).

Greedy output after a wake or a weight update must equal the output of an engine that never
slept (fp32). The memory must really go back to the system: the process's RSS falls by at least
80% of the KV pool (level 1) and of the weights (level 2). Tiny random Llama directories for
most tests; one test runs the default model. Every engine is checked idle afterwards.
"""

from __future__ import annotations

import argparse
import json

import psutil
import pytest

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import EngineBusyError, EngineSleepingError
from pagedserve.observability.memory import resident_bytes
from pagedserve.sampling_params import SamplingParams
from tests.engine.tiny_models import checked_llms, write_tiny_llama

pytest.importorskip("transformers")

PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42]},
           {"prompt_token_ids": list(range(100, 160))},  # 3 full blocks: prefix-cached
           {"prompt_token_ids": [7] * 9}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
SELF_DRAFT = {"method": "draft_model", "model": "self", "draft_num_layers": 1,
              "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer) -> dict[str, str]:
    """a, b: same shape, other weights; deeper: one layer more."""
    root = tmp_path_factory.mktemp("tiny")
    specs = {"a": (0, 2), "b": (1, 2), "deeper": (2, 3)}
    dirs = {}
    for name, (seed, num_layers) in specs.items():
        (root / name).mkdir()
        dirs[name] = write_tiny_llama(root / name, tokenizer, seed, num_layers)
    return dirs


@pytest.fixture
def make_tiny():
    """Factory: make_tiny(path, **engine_args) -> LLM (fp32, its own weights); each is checked
    idle and shut down on teardown."""
    with checked_llms() as factory:
        yield factory


def greedy_tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]


def num_cached_blocks(llm: LLM) -> int:
    return sum(block.block_hash is not None
               for block in llm.engine.scheduler.kv_cache_manager.block_pool.blocks)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


# ---- sleep and wake -----------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
def test_greedy_output_after_wake_equals_output_before_sleep(tiny_dirs, make_tiny, level):
    llm = make_tiny(tiny_dirs["a"], enable_sleep_mode=True)
    expected = greedy_tokens(llm)
    assert num_cached_blocks(llm) > 0
    llm.sleep(level)
    assert llm.engine.is_sleeping and llm.engine.sleep_level == level
    assert num_cached_blocks(llm) == 0, "the prefix cache outlived the KV it indexed"
    assert llm.engine.executor.worker.model_runner.kv_caches == []
    if level == 2:
        assert llm.engine.executor.worker.model is None
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, GREEDY)
    llm.engine.assert_idle()  # the refused request left nothing behind
    llm.wake_up()
    assert not llm.engine.is_sleeping
    assert greedy_tokens(llm) == expected
    assert greedy_tokens(llm) == expected  # again, now from the prefix cache


def test_sleep_deeper_then_wake_and_repeated_calls(tiny_dirs, make_tiny):
    llm = make_tiny(tiny_dirs["a"], enable_sleep_mode=True)
    expected = greedy_tokens(llm)
    llm.wake_up()  # awake: a no-op
    llm.sleep(1)
    llm.sleep(1)  # the same level: a no-op
    llm.sleep(2)  # deeper: the weights go too
    assert llm.engine.executor.worker.model is None
    llm.sleep(1)  # lighter: a no-op
    assert llm.engine.sleep_level == 2
    llm.wake_up()
    assert greedy_tokens(llm) == expected


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_draft_kv_and_speculation_still_matches(tiny_dirs, make_tiny, level):
    llm = make_tiny(tiny_dirs["a"], enable_sleep_mode=True, speculative_config=SELF_DRAFT)
    expected = greedy_tokens(llm)
    runner = llm.engine.executor.worker.model_runner
    draft_kv = runner.proposer.kv
    assert draft_kv.kv_caches
    llm.sleep(level)
    assert draft_kv.kv_caches == [] if level == 1 else runner.proposer is None
    llm.wake_up()
    assert runner.proposer.model is runner.model  # a self-draft runs the (reloaded) target
    assert greedy_tokens(llm) == expected


def test_sleep_needs_sleep_mode_an_idle_engine_and_a_valid_level(tiny_dirs, make_tiny):
    llm = make_tiny(tiny_dirs["a"])
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        llm.sleep(1)
    llm = make_tiny(tiny_dirs["a"], enable_sleep_mode=True)
    for level in (0, 3, "1"):
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            llm.sleep(level)
    engine = llm.engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(EngineBusyError, match=r"requests are in flight \(1\)"):
        engine.sleep(1)
    with pytest.raises(EngineBusyError):
        engine.update_weights(tiny_dirs["b"])
    assert not engine.is_sleeping
    engine.abort_request("busy")
    engine.sleep(1)
    engine.wake_up()


def test_sleep_returns_the_memory_to_the_system(tmp_path, tokenizer, make_tiny):
    """RSS falls by >= 80% of the KV pool (level 1), then of the weights (level 2); a random
    Llama of ~200 MB of fp32 weights and a 256 MiB pool make the figures clear of noise."""
    path = write_tiny_llama(tmp_path, tokenizer, seed=3, num_hidden_layers=4, hidden_size=1024,
                            intermediate_size=3072)
    llm = make_tiny(path, enable_sleep_mode=True, kv_cache_memory="256MiB")
    expected = greedy_tokens(llm)
    worker = llm.engine.executor.worker
    # A pool in use: every page written (the CPU pool's pages are mapped as they are first
    # written, attention/kv_cache.py), its values kept.
    for tensor in [t for layer in worker.model_runner.kv_caches for t in layer]:
        tensor.mul_(1)
    del tensor  # no reference may outlive sleep
    kv_bytes = resident_bytes(worker.model_runner.kv_caches)
    weight_bytes = sum(t.nbytes for t in [*worker.model.parameters(), *worker.model.buffers()])
    assert kv_bytes >= 200 << 20 and weight_bytes >= 150 << 20

    awake = rss_bytes()
    llm.sleep(1)
    level1 = rss_bytes()
    llm.sleep(2)
    level2 = rss_bytes()
    print(f"RSS {awake / 2**20:.0f} MiB awake; level 1 freed {(awake - level1) / 2**20:.0f} MiB "
          f"(KV pool {kv_bytes / 2**20:.0f} MiB); level 2 freed {(level1 - level2) / 2**20:.0f} "
          f"MiB more (weights {weight_bytes / 2**20:.0f} MiB)")
    assert awake - level1 >= 0.8 * kv_bytes
    assert level1 - level2 >= 0.8 * weight_bytes
    llm.wake_up()
    assert rss_bytes() - level2 >= 0.8 * weight_bytes  # the weights back; a fresh pool, unused
    assert resident_bytes(worker.model_runner.kv_caches) < 0.2 * kv_bytes
    assert greedy_tokens(llm) == expected


@pytest.mark.slow
def test_default_model_sleeps_and_wakes_with_the_same_text(make_llm):
    """The default model (SmolLM2-135M, the session's shared fp32 weights, which level 1 keeps
    in place); slow only where it is the first test to load them."""
    llm = make_llm(enable_sleep_mode=True, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = [output.outputs[0].text for output in llm.generate(prompts, params)]
    llm.sleep(1)
    llm.wake_up()
    assert [output.outputs[0].text for output in llm.generate(prompts, params)] == expected


def test_enable_sleep_mode_flag():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).enable_sleep_mode is False
    args = EngineArgs.from_cli_args(parser.parse_args(["--enable-sleep-mode"]))
    assert args.enable_sleep_mode is True


# ---- weight reload --------------------------------------------------------------------------


def test_update_weights_serves_the_new_weights_and_back(tiny_dirs, make_tiny):
    llm = make_tiny(tiny_dirs["a"])
    expected_a = greedy_tokens(llm)
    expected_b = greedy_tokens(make_tiny(tiny_dirs["b"]))
    assert expected_a != expected_b
    llm.update_weights(tiny_dirs["b"])
    assert num_cached_blocks(llm) == 0  # a's KV must not be reused under b's weights
    assert greedy_tokens(llm) == expected_b
    llm.update_weights(tiny_dirs["a"])
    assert greedy_tokens(llm) == expected_a


def test_update_weights_with_a_self_draft(tiny_dirs, make_tiny):
    expected_b = greedy_tokens(make_tiny(tiny_dirs["b"]))
    llm = make_tiny(tiny_dirs["a"], speculative_config=SELF_DRAFT)
    greedy_tokens(llm)
    llm.update_weights(tiny_dirs["b"])
    assert greedy_tokens(llm) == expected_b


def test_update_weights_refuses_another_shape_and_keeps_serving(tiny_dirs, make_tiny, tmp_path):
    llm = make_tiny(tiny_dirs["a"], enable_sleep_mode=True)
    expected = greedy_tokens(llm)
    with pytest.raises(ValueError, match=r"num_hidden_layers 3 \(serving 2\)"):
        llm.update_weights(tiny_dirs["deeper"])
    with pytest.raises(ValueError, match="cannot read a model"):
        llm.update_weights(str(tmp_path / "missing"))
    llm.sleep(1)
    with pytest.raises(ValueError, match="sleeping"):
        llm.update_weights(tiny_dirs["b"])
    llm.wake_up()
    assert greedy_tokens(llm) == expected


# ---- with KV tiers, with worker processes -------------------------------------------------------


def test_kv_tiers_keep_their_blocks_through_sleep(tiny_dirs, make_tiny, tmp_path):
    """Sleep empties the device pool, not the tiers: after a wake the prompts' KV comes back from
    the disk tier (its queued saves were written before the KV went)."""
    tiers = json.dumps({"kv_connector": "DiskConnector", "kv_connector_extra_config": {
        "path": str(tmp_path), "max_bytes": "64MiB", "load_policy": "always",
        "sync_saves": False}})
    llm = make_tiny(tiny_dirs["a"], enable_sleep_mode=True, kv_transfer_config=tiers)
    expected = greedy_tokens(llm)
    llm.sleep(1)
    llm.wake_up()
    assert greedy_tokens(llm) == expected
    assert llm.engine.get_stats().kv_tier.loaded_tokens >= 48  # PROMPTS[1]'s 3 full blocks
    with pytest.raises(ValueError, match="KV tiers"):
        llm.update_weights(tiny_dirs["b"])


@pytest.mark.slow
def test_worker_processes_sleep_wake_and_update_weights(tiny_dirs, make_tiny):
    """Tensor parallel ranks (one process each) get every lifecycle call."""
    expected_a = greedy_tokens(make_tiny(tiny_dirs["a"]))
    expected_b = greedy_tokens(make_tiny(tiny_dirs["b"]))
    llm = make_tiny(tiny_dirs["a"], enable_sleep_mode=True, tensor_parallel_size=2)
    assert greedy_tokens(llm) == expected_a
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        assert greedy_tokens(llm) == expected_a
    llm.update_weights(tiny_dirs["b"])
    assert greedy_tokens(llm) == expected_b
