"""Gemma 3 against transformers: a tiny random model whose window is shorter than the prompts,
and the real Gemma-3-270M GGUF (slow) on the same dequantized weights, both in fp32."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from tests.engine.tiny_models import GEMMA3_SLIDING_WINDOW, write_tiny_gemma3

transformers = pytest.importorskip("transformers")

PROMPTS = [list(range(100, 130)), [5, 17, 300, 42] * 10, [7] * 3, list(range(20, 60)),
           list(range(400, 421))]
"""Mostly longer than the window (8): the windowed layer masks, the global one does not."""


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        return hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
        )[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, tokenizer):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), tokenizer)


GEMMA_KERNELS = ("add_rms_norm", "rms_norm_heads_inplace", "gelu_tanh_and_mul", "rotary_inplace")
"""The compiled kernels Gemma's layers call one by one (its norms, QK-norm, gating, rotary)."""


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_tiny_gemma3_greedy_matches_transformers(tiny_gemma3, cpu_kernels, monkeypatch):
    """With the compiled kernels each of Gemma's kernels is called, and the tokens stay HF's."""
    from pagedserve.engine.llm import LLM
    from pagedserve.kernels import cpu_ops

    calls = {name: 0 for name in GEMMA_KERNELS}
    ops = cpu_ops.load()
    if cpu_kernels:
        if ops is None:
            pytest.skip("the compiled CPU kernels are unavailable")
        def counting(name, kernel):
            def counted(*args, **kwargs):
                calls[name] += 1
                return kernel(*args, **kwargs)
            return counted

        for name in GEMMA_KERNELS:
            monkeypatch.setattr(ops, name, counting(name, getattr(ops, name)))
    path, hf_model = tiny_gemma3
    assert max(map(len, PROMPTS)) > GEMMA3_SLIDING_WINDOW
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=128,
              max_num_seqs=8, cpu_kernels=cpu_kernels)
    model = llm.engine.executor.worker.model_runner.model
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [
        GEMMA3_SLIDING_WINDOW, None]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(calls.values()) if cpu_kernels else not any(calls.values()), calls
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
    llm.engine.assert_idle()



# ---- engine features leave the tiny model's output unchanged ----

FEATURE_PROMPTS = [list(range(100, 140)), list(range(100, 120)) + [9] * 25, list(range(30, 90)),
                   [5, 17, 300, 42] * 9, list(range(200, 233)), list(range(100, 136)) + [1, 2]]
"""33 to 60 tokens (window 8, blocks of 16); the first, second and last share 20+ tokens."""
FEATURE_GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)


def make_tiny_llm(path: str, **overrides):
    from pagedserve.engine.llm import LLM

    args = dict(dtype="float32", kv_cache_memory="16MiB", max_num_seqs=8, max_model_len=256)
    return LLM(model=path, **{**args, **overrides})


def generate_ids(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in FEATURE_PROMPTS], FEATURE_GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain_gemma3_outputs(tiny_gemma3) -> list[list[int]]:
    """No chunking, no prefix caching, room for every request at once, and one block table for
    both layers (the windowed layer keeps every block and masks)."""
    llm = make_tiny_llm(tiny_gemma3[0], enable_chunked_prefill=False,
                        enable_prefix_caching=False, max_num_batched_tokens=512,
                        disable_hybrid_kv_cache_manager=True)
    assert llm.engine.scheduler.kv_cache_manager.group_windows == (None,)
    outputs = generate_ids(llm)
    llm.engine.assert_idle()
    return outputs


def window_freed_blocks(llm) -> int:
    return llm.engine.scheduler.kv_cache_manager.num_window_freed_blocks


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_gemma3_windowed_layer_lets_go_of_blocks_and_keeps_output(tiny_gemma3,
                                                                   plain_gemma3_outputs,
                                                                   cpu_kernels):
    """Per-layer-group KV (vLLM's hybrid allocator): the windowed layer's group frees the blocks
    its window has passed; the output is the one that kept every block."""
    llm = make_tiny_llm(tiny_gemma3[0], enable_chunked_prefill=False,
                        enable_prefix_caching=False, max_num_batched_tokens=512,
                        cpu_kernels=cpu_kernels)
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.group_windows == (None, GEMMA3_SLIDING_WINDOW)
    outputs = generate_ids(llm)
    assert window_freed_blocks(llm) > 0
    assert outputs == plain_gemma3_outputs
    llm.engine.assert_idle()


def test_gemma3_chunked_prefill_keeps_output(tiny_gemma3, plain_gemma3_outputs):
    from tests.e2e.test_engine_features import record_schedules

    llm = make_tiny_llm(tiny_gemma3[0], max_num_batched_tokens=16, enable_prefix_caching=False)
    schedules = record_schedules(llm)
    outputs = generate_ids(llm)
    num_chunks = {}  # request -> steps that prefilled part of its prompt
    for out in schedules:
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            num_chunks[req_id] = num_chunks.get(req_id, 0) + (num_tokens > 1)
    assert max(num_chunks.values()) > 1, "no prompt was chunked"
    assert window_freed_blocks(llm) > 0
    assert outputs == plain_gemma3_outputs
    llm.engine.assert_idle()


def test_gemma3_prefix_caching_keeps_output(tiny_gemma3, plain_gemma3_outputs):
    llm = make_tiny_llm(tiny_gemma3[0], max_num_batched_tokens=64, enable_prefix_caching=True)
    first = generate_ids(llm)
    second = generate_ids(llm)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and window_freed_blocks(llm) > 0
    assert first == second == plain_gemma3_outputs
    llm.engine.assert_idle()


def test_gemma3_preemption_keeps_output(tiny_gemma3, plain_gemma3_outputs):
    # 10 usable blocks of 16 tokens of one layer each, shared by the global group (a request of
    # <= 76 tokens holds up to 5) and the windowed one (up to 3): room for any one request, not
    # for all at once.
    llm = make_tiny_llm(tiny_gemma3[0], max_num_batched_tokens=64, num_gpu_blocks_override=11,
                        max_model_len=128, enable_prefix_caching=False)
    outputs = generate_ids(llm)
    assert llm.engine.get_stats().num_preemptions > 0 and window_freed_blocks(llm) > 0
    assert outputs == plain_gemma3_outputs
    llm.engine.assert_idle()

@pytest.mark.parametrize("speculative_config", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
     "prompt_lookup_min": 1},
    {"method": "draft_model", "model": "self", "draft_num_layers": 1, "num_speculative_tokens": 3},
], ids=["ngram", "self-draft"])
def test_gemma3_speculative_decoding_keeps_output(tiny_gemma3, plain_gemma3_outputs,
                                                  speculative_config):
    """Drafts, their rejections rolled back, on top of the windowed group letting go of blocks
    (a self-draft runs the first layer, windowed, on a draft cache of its own)."""
    llm = make_tiny_llm(tiny_gemma3[0], max_num_batched_tokens=64,
                        speculative_config=speculative_config)
    outputs = generate_ids(llm)
    spec = llm.engine.get_stats().spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert window_freed_blocks(llm) > 0
    assert outputs == plain_gemma3_outputs
    llm.engine.assert_idle()


# ---- the real Gemma-3-270M GGUF (slow) ----

NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma3_270m_path() -> str:
    from pagedserve.models.loader import resolve_model_path

    try:
        return resolve_model_path("gemma3-270m")
    except ValueError as e:  # its packages are not installed
        pytest.skip(str(e))


def write_gguf_without_vocabulary(source: str, target: str) -> None:
    """A copy of `source` without the tokenizer's arrays and with the vocabulary size stated.

    transformers parses GGUF metadata value by value with numpy views (~40 s for Gemma's 262k
    entries, twice per load); the model needs none of it. Tensors are copied as stored."""
    import gguf
    import numpy as np

    from pagedserve.models.gguf_header import read_gguf_header, tensor_data

    header = read_gguf_header(source)
    architecture = header.get("general.architecture")
    writer = gguf.GGUFWriter(target, architecture)
    value_types = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32,
                   float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    for key, value in header.metadata.items():
        if key.startswith("tokenizer.") or key in ("general.architecture", "general.alignment"):
            continue
        if isinstance(value, list):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY,
                                 value_types[type(value[0])])
        else:
            writer.add_key_value(key, value, value_types[type(value)])
    writer.add_uint32(f"{architecture}.vocab_size", len(header.get("tokenizer.ggml.tokens")))
    file_data = np.memmap(source, mode="r")
    for info in header.tensors:
        data = tensor_data(file_data, header.byte_order, info)
        writer.add_tensor(info.name, data, raw_shape=data.shape, raw_dtype=info.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def long_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """Prompts of about num_tokens tokens (past the 512-token window) from the Declaration."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "data" / "declaration_of_independence.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id]
    return [bos + ids[i * 97 : i * 97 + num_tokens] for i in range(num_prompts)]


@pytest.mark.slow
def test_gemma3_270m_gguf_greedy_matches_transformers(gemma3_270m_path, tmp_path):
    import os

    from pagedserve.engine.llm import LLM

    # Dense fp32 (the dequantized weights as transformers holds them): faster prefill here.
    llm = LLM(model="gemma3-270m", dtype="float32", quantization="none",
              kv_cache_memory="256MiB", max_num_batched_tokens=2048, max_num_seqs=8)
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.encode(text) for text in (
        "The capital of France is", "def fibonacci(n):", "Once upon a time",
        "Water boils at a temperature of", "<start_of_turn>user\nName a colour.<end_of_turn>\n"
        "<start_of_turn>model\n", "1, 2, 3, 4,")] + long_prompts(tokenizer, 2, 530)
    assert len(prompts) >= 8 and sum(len(p) > 512 for p in prompts) == 2
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    # The windowed layers' KV cache groups let go of the blocks their window passed.
    assert llm.engine.scheduler.kv_cache_manager.num_window_freed_blocks > 0
    llm.engine.assert_idle()
    del llm

    slim_path = str(tmp_path / "gemma3-270m-no-vocabulary.gguf")
    write_gguf_without_vocabulary(gemma3_270m_path, slim_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(slim_path), gguf_file=os.path.basename(slim_path), dtype=torch.float32,
    ).eval()
    assert hf_model.config.sliding_window == 512
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)


TRANSFORMERS_TOKEN_IDS = {
    # AutoTokenizer.from_pretrained(dir, gguf_file="gemma-3-270m-q4_k_m.gguf") (transformers
    # 5.24): 34 s to build, so its ids are written here.
    "Hello world": [2, 9259, 1902],
    "  two  spaces\n\nnewlines\ttab": [2, 138, 13498, 138, 35220, 108, 208697, 255968, 4823],
    "café naïve 日本語 🙂": [2, 123125, 236859, 120362, 33375, 238582, 57235],
    "<start_of_turn>user\nhi<end_of_turn>\n": [2, 105, 2364, 107, 2202, 106, 107],
    "def f(x):\n    return x**2": [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018,
                                   236778],
}


@pytest.mark.slow
def test_gemma3_270m_tokenizer_and_chat_template(gemma3_270m_path):
    from pagedserve.models.loader import load_model_config
    from pagedserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(gemma3_270m_path)
    assert tokenizer.vocab_size == 262144
    for text, expected in TRANSFORMERS_TOKEN_IDS.items():
        assert tokenizer.encode(text) == expected
        assert tokenizer.decode(expected[1:]) == text  # without the BOS the encoder added
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                      "<start_of_turn>model\n")
    # the template's turn end stops generation
    eos_token_ids = load_model_config(gemma3_270m_path).eos_token_ids
    assert tokenizer.token_to_id("<end_of_turn>") in eos_token_ids
    assert tokenizer.eos_token_id in eos_token_ids
