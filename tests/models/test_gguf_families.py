"""Qwen3 and Phi-3 from GGUF files, against transformers on the same weights.

Each test writes a tiny random HF model's weights into a GGUF file with gguf's own GGUFWriter and
llama.cpp's tensor names (gguf's TensorNameMap), the matrices as Q8_0 and the norms as F32, and
gives transformers the Q8_0-dequantized values: the engine (fp32, running on the Q8_0 codes) must
then generate transformers' greedy tokens. Phi-3's fused attn_qkv / ffn_up (gate + up) are split
on load, and its layers run in the compiled decoder stack; Qwen3's QK-norm (attn_q_norm /
attn_k_norm) keeps them on the modules.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.sampling_params import SamplingParams
from tests.models.gguf_writing import add_byte_vocabulary, add_shape_metadata, quantized_round_trip
from tests.models.test_tiny_parity import CONFIGS, PROMPTS, VOCAB

transformers = pytest.importorskip("transformers")

GGUF_ARCHITECTURES = {"qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3}
NUM_NEW_TOKENS = 8
PHI3_SLIDING_WINDOW = 2047
"""As llama.cpp writes Phi-3 mini-4k's: wider than these prompts, so the decoder stack serves
(the tiny parity tests cover a window shorter than the prompts)."""


def _write_gguf(path, architecture: str, hf_model,
                qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0) -> None:
    """Write hf_model to `path` (`qtype` matrices, F32 norms) and set its weights to the values
    the file holds, so both sides compute with the same numbers."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    add_shape_metadata(writer, config)
    writer.add_feed_forward_length(config.intermediate_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == "phi3":
        writer.add_sliding_window(config.sliding_window)
    add_byte_vocabulary(writer, VOCAB)

    names = gguf.get_tensor_name_map(GGUF_ARCHITECTURES[architecture], config.num_hidden_layers)
    state = hf_model.state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    with torch.no_grad():
        for hf_name, tensor in state.items():
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf_name
            weight = tensor.numpy()
            if weight.ndim == 2:
                codes, dequantized = quantized_round_trip(weight, qtype)
                writer.add_tensor(gguf_name, codes, raw_dtype=qtype)
                hf_model.get_parameter(hf_name).copy_(torch.from_numpy(dequantized))
            else:
                writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture,qtype", [
    *((architecture, "Q8_0") for architecture in sorted(GGUF_ARCHITECTURES)),
    ("qwen3", "Q5_0"),  # held as 5-bit codes (layers/quantized.py)
    ("phi3", "Q5_1"),  # 5-bit codes in the decoder stack
])
def test_gguf_greedy_matches_transformers(tmp_path, architecture, qtype, stack_calls):
    from pagedserve.engine.llm import LLM

    torch.manual_seed(0)
    config = CONFIGS[architecture]()
    if architecture == "phi3":
        config.sliding_window = PHI3_SLIDING_WINDOW
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at ones: spread them, so a swapped one shows
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path / f"tiny-{architecture}.gguf"
    _write_gguf(path, architecture, hf_model, gguf.GGMLQuantizationType[qtype])

    # The exact mode (the GGUF's weights, fp32 activations): a random tiny model has near-ties
    # everywhere; the default's quantized activations are bounded on the real model
    # (tests/models/test_quantized_model.py).
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64,
              max_num_seqs=8, activation_quantization="none")
    model = llm.engine.executor.worker.model_runner.model
    assert model.config.architecture == architecture
    assert model.config.sliding_window == getattr(hf_model.config, "sliding_window", None)
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.weight is None  # fp32 runs on the codes alone
    assert (layer.self_attn.q_norm is not None) == (architecture == "qwen3")
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    if cpu_ops.load() is not None:  # the stack implements Phi-3's layers, not QK-norm
        assert bool(stack_calls) == (architecture == "phi3")
    for prompt, output in zip(PROMPTS, outputs):
        with torch.inference_mode():
            expected = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones_like(torch.tensor([prompt])),
                max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False,
            )[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == expected
    llm.engine.assert_idle()
