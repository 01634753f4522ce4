"""Writing tiny GGUF files from transformers models, as llama.cpp's converter lays them out: the
shape metadata every architecture has, and quantized matrices (Q8_0, Q5_0) with the values they
dequantize to (the reference model is given those, so both sides compute with the same numbers)."""

from __future__ import annotations

import gguf
import numpy as np


def add_shape_metadata(writer: gguf.GGUFWriter, hf_config) -> None:
    """Context length, widths, layer and head counts, norm epsilon and RoPE base."""
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_rope_freq_base(hf_config.rope_parameters["rope_theta"])


def add_byte_vocabulary(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A byte-level vocabulary of vocab_size ids, the last one EOS (the tests' prompts are token
    ids; the text is never used)."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"<t{i}>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    writer.add_token_merges([])
    writer.add_eos_token_id(vocab_size - 1)


def quantized_round_trip(weight: np.ndarray, qtype=gguf.GGMLQuantizationType.Q8_0
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(the `qtype` bytes for the file, the values they dequantize to, in weight's shape)."""
    codes = gguf.quants.quantize(weight, qtype)
    return codes, gguf.quants.dequantize(codes, qtype).reshape(weight.shape)
