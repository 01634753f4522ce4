"""Adapters that cannot be served are refused with a clear error before anything is loaded:
the files, the options, the rank, the shapes, the path (traversal and symlink escapes)."""

from __future__ import annotations

import os

import pytest

from pagedserve.lora.peft import AdapterError, inspect_adapter
from tests.distributed.tiny_llama import tiny_config
from tests.lora.helpers import write_random_adapter

CONFIG = tiny_config("llama")


@pytest.fixture
def good(tmp_path):
    return write_random_adapter(tmp_path / "root" / "good", CONFIG, 8, ["q_proj", "down_proj"], 0)


def _error(path, root=None, max_rank=16) -> str:
    with pytest.raises(AdapterError) as info:
        inspect_adapter(str(path), CONFIG, max_rank, root)
    return str(info.value)


def test_a_good_adapter_is_described(good, tmp_path):
    adapter = inspect_adapter(good, CONFIG, 16, str(tmp_path / "root"))
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert adapter.target_modules == ("q_proj", "down_proj")
    assert len(adapter.modules) == 2 * CONFIG.num_hidden_layers
    assert len(adapter.digest) == 64
    # the digest names the content: another adapter differs
    other = write_random_adapter(tmp_path / "other", CONFIG, 8, ["q_proj", "down_proj"], 1)
    assert inspect_adapter(other, CONFIG, 16).digest != adapter.digest


def test_missing_files(tmp_path):
    assert "no adapter directory" in _error(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json" in _error(tmp_path / "empty")


def test_pickled_weights_are_refused(good):
    os.rename(os.path.join(good, "adapter_model.safetensors"),
              os.path.join(good, "adapter_model.bin"))
    assert "pickle" in _error(good)


def test_rank_above_the_limit(good):
    assert "exceeds max_lora_rank 4" in _error(good, max_rank=4)


@pytest.mark.parametrize("overrides, message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"r": 0}, "positive integer"),
    ({"peft_type": "IA3"}, "IA3"),
])
def test_unsupported_options(tmp_path, overrides, message):
    path = write_random_adapter(tmp_path / "a", CONFIG, 8, ["q_proj"], 0,
                                config_overrides=overrides)
    assert message in _error(path)


def test_wrong_shapes(tmp_path):
    wrong = tiny_config("llama")
    import dataclasses

    wrong = dataclasses.replace(wrong, intermediate_size=wrong.intermediate_size * 2)
    path = write_random_adapter(tmp_path / "a", wrong, 8, ["down_proj"], 0)
    assert "has shape" in _error(path)


def test_corrupt_and_truncated_files(good):
    weights = os.path.join(good, "adapter_model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2])
    assert "not a valid safetensors file" in _error(good)
    with open(weights, "wb") as f:
        f.write(b"\xff" * 64)
    assert "not a valid safetensors file" in _error(good)
    with open(os.path.join(good, "adapter_config.json"), "w") as f:
        f.write("{not json")
    assert "cannot read adapter_config.json" in _error(good)


def test_paths_must_stay_inside_the_root(good, tmp_path):
    root = tmp_path / "root"
    outside = write_random_adapter(tmp_path / "outside", CONFIG, 8, ["q_proj"], 0)
    assert "outside the LoRA directory" in _error("../outside", root=str(root))
    assert "outside the LoRA directory" in _error(outside, root=str(root))
    os.symlink(outside, root / "link")  # a link inside pointing out
    assert "outside the LoRA directory" in _error("link", root=str(root))
    inner = root / "inner"
    inner.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # files linked out
        os.symlink(os.path.join(outside, name), inner / name)
    assert "outside the LoRA directory" in _error("inner", root=str(root))
    assert inspect_adapter("good", CONFIG, 16, str(root)).rank == 8  # relative, inside: fine


def test_engine_refuses_a_bad_adapter_and_keeps_nothing(tmp_path, tokenizer):
    from pagedserve.engine.llm import LLM
    from pagedserve.lora import LoRARequest
    from pagedserve.sampling_params import SamplingParams
    from tests.lora.helpers import tiny_llama_dir

    pytest.importorskip("transformers")
    model_dir, _ = tiny_llama_dir(tmp_path / "base", tokenizer)
    llm = LLM(model=model_dir, dtype="float32", kv_cache_memory="16MiB", enable_lora=True,
              max_lora_rank=8)
    big = write_random_adapter(tmp_path / "big", tiny_like(model_dir), 16, ["q_proj"], 0)
    params = SamplingParams(max_tokens=4, detokenize=False)
    with pytest.raises(ValueError, match="exceeds max_lora_rank"):
        llm.generate([[1, 2, 3]], params, lora_request=LoRARequest("big", 1, big))
    assert llm.list_loras() == set()
    # the engine goes on serving, with and without adapters
    good = write_random_adapter(tmp_path / "ok", tiny_like(model_dir), 8, ["v_proj"], 0)
    outputs = llm.generate([[1, 2, 3]] * 2, params,
                           lora_request=[None, LoRARequest("ok", 2, good)])
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    with pytest.raises(ValueError, match="already loaded"):
        llm.add_lora(LoRARequest("ok", 3, big))
    llm.engine.assert_idle()
    assert llm.remove_lora(2) and llm.list_loras() == set()
    llm.engine.shutdown()


def tiny_like(model_dir):
    from pagedserve.models.loader import load_model_config

    return load_model_config(model_dir)
