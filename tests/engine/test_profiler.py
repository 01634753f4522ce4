"""LLM.start_profile / stop_profile (torch.profiler around the engine's steps).

Offline over a tiny random Llama in one process, and with two tensor-parallel worker processes:
every rank writes its own Chrome trace (rank and pid in the name) with aten ops and the step
ranges. Starting twice, stopping when stopped, or profiling an engine without a profiler
directory is a ValueError that leaves the engine serving. The engine is idle after every run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.engine.tiny_models import write_tiny_llama

pytest.importorskip("transformers")

PROMPTS = [{"prompt_token_ids": list(range(100, 140))}, {"prompt_token_ids": [5, 6, 7]}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), tokenizer, seed=0)


def make_llm(model: str, **engine_args):
    from pagedserve.engine.llm import LLM

    return LLM(model=model, dtype="float32", kv_cache_memory="16MiB", **engine_args)


def generate(llm) -> list[list[int]]:
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
    outputs = llm.generate(PROMPTS, params)
    llm.engine.assert_idle()
    return [output.outputs[0].token_ids for output in outputs]


def trace_names(path: str) -> set[str]:
    events = json.loads(Path(path).read_text())["traceEvents"]
    return {event["name"] for event in events if "name" in event}


def test_offline_profile(tiny_dir, tmp_path):
    llm = make_llm(tiny_dir, profiler_dir=str(tmp_path / "traces"))
    try:
        with pytest.raises(ValueError, match="not running"):
            llm.stop_profile()
        expected = generate(llm)
        llm.start_profile()
        with pytest.raises(ValueError, match="already running"):
            llm.start_profile()
        assert generate(llm) == expected  # profiling changes no token
        (path,) = llm.stop_profile()
        with pytest.raises(ValueError, match="not running"):
            llm.stop_profile()
        assert generate(llm) == expected
    finally:
        llm.engine.shutdown()
    assert Path(path).parent == tmp_path / "traces"
    assert Path(path).name.startswith(f"pagedserve-rank0-pid{os.getpid()}-")
    assert path.endswith(".pt.trace.json")
    names = trace_names(path)
    assert any(name.startswith("aten::") for name in names)
    assert {"pagedserve::schedule", "pagedserve::execute_model", "pagedserve::update",
            "pagedserve::worker.execute_model"} <= names


def test_profiling_is_off_without_a_directory(tiny_dir, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = make_llm(tiny_dir)
    try:
        with pytest.raises(ValueError, match="profiling is off.*--profiler-dir"):
            llm.start_profile()
        generate(llm)
    finally:
        llm.engine.shutdown()


def test_profiler_dir_flag_and_vllm_env_var(monkeypatch, tmp_path):
    import argparse

    from pagedserve.engine.arg_utils import EngineArgs

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert EngineArgs().create_profiler_config() is None
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    assert EngineArgs().create_profiler_config().trace_dir == str(tmp_path / "env")
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert args.profiler_dir == str(tmp_path / "env")
    args = EngineArgs.from_cli_args(parser.parse_args(["--profiler-dir", "rel/traces"]))
    config = args.create_profiler_config()
    assert config.trace_dir == os.path.abspath("rel/traces")  # workers may run elsewhere
    assert not config.with_stack and config.record_shapes


@pytest.mark.slow
def test_tensor_parallel_ranks_write_their_own_traces(tiny_dir, tmp_path):
    expected = generate(llm := make_llm(tiny_dir))
    llm.engine.shutdown()
    llm = make_llm(tiny_dir, profiler_dir=str(tmp_path), tensor_parallel_size=2)
    try:
        llm.start_profile()
        assert generate(llm) == expected
        paths = llm.stop_profile()
        with pytest.raises(ValueError, match="not running"):
            llm.stop_profile()
        assert generate(llm) == expected  # the workers still serve
    finally:
        llm.engine.shutdown()
    pids = {process.pid for process in llm.engine.executor.processes}
    assert all(process.poll() is not None for process in llm.engine.executor.processes)
    assert len(paths) == 2
    for rank, path in enumerate(paths):
        name = Path(path).name
        assert name.startswith(f"pagedserve-rank{rank}-pid")
        assert int(name.split("-pid")[1].split("-")[0]) in pids
        names = trace_names(path)
        assert any(name.startswith("aten::") for name in names)
        assert "pagedserve::worker.execute_model" in names
