"""GGUF specifics: a llama.cpp GGUF file's metadata as a ModelConfig, its tensors as HF weights.

llama.cpp names tensors `blk.{i}.attn_q.weight` and, for the llama architecture only, permutes
the rows of q/k so its interleaved RoPE works; we rename to Hugging Face names and undo that
permutation, and for gemma3 undo the converter's +1 on norm weights, so models see exactly the
weights transformers would load. Knows nothing about
where the file came from. The header is parsed once per file (gguf_header.py); the `gguf` package
dequantizes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator

import gguf
import numpy as np
import torch

from pagedserve.chat_templates import default_chat_template
from pagedserve.config import ModelConfig, MoEConfig
from pagedserve.layers.quantized import PACKABLE_TYPES, GGUFQuantWeight, decode_gguf_blocks
from pagedserve.models import unsupported_architecture
from pagedserve.models.gguf_header import GGUFHeader, read_gguf_header, tensor_data

logger = logging.getLogger(__name__)


_ROPE_PERMUTED_ARCHITECTURES = ("llama", "mixtral")
"""Our architectures whose GGUF q/k rows llama.cpp permuted (a Mixtral GGUF says "llama")."""
_MOE_ARCHITECTURES = {"llama": "mixtral", "mixtral": "mixtral", "qwen2moe": "qwen2_moe"}
"""GGUF architecture with expert tensors -> our registry key."""
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2moe",
                               "gemma3")

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused, split by the model (phi3.py)
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's QK-norm
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # mixture of experts (Mixtral, Qwen2-MoE): the router, the experts stacked (E, rows, cols)
    # and yielded one by one, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ARCHITECTURE_BLOCK_TENSOR_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused (gate rows first), no ffn_gate
    "gemma3": {  # four norms per layer; Llama's ffn_norm is its post_attention_layernorm
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
"""Where an architecture's tensor holds something else under the same GGUF name."""
_BLOCK_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_CHAT_TURN_END_TOKENS = ("<|im_end|>", "<end_of_turn>")
"""Tokens that end a chat turn (ChatML's, Gemma's); each is an EOS where the template uses it."""
GEMMA3_SLIDING_WINDOW_PATTERN = 6
"""Gemma 3: every 6th layer is global, the others windowed (llama.cpp fixes it too; the GGUF
stores no pattern; an HF config that names neither layer_types nor a pattern means it too)."""
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
"""Gemma 3's windowed layers' RoPE base (rope_local_base_freq; not in the GGUF either)."""
PROGRESS_MIN_BYTES = 200 * 2**20
"""A file with at least this many bytes of tensors logs its loading progress every 10%."""


def load_gguf_config(path: str) -> ModelConfig:
    return _read_config(read_gguf_header(path), path)


def iter_gguf_weights(
    path: str, dtype: torch.dtype, keep_packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFQuantWeight]]:
    """Yield (HF name, dequantized tensor of `dtype`) one at a time; matrices are [out, in].

    keep_packed: yield the matrices of layers/quantized.py's PACKABLE_TYPES (Q4_0 / Q4_1 / Q4_K,
    Q5_0 / Q5_1 / Q5_K, Q8_0) as GGUFQuantWeight (codes with fp32 scales and mins, exactly the
    values dequantization would give), stacked expert tensors as one such matrix per expert;
    other types stay dense.
    """
    header = read_gguf_header(path)
    config = _read_config(header, path)
    file_data = np.memmap(path, mode="r")
    total_bytes = sum(tensor.num_bytes for tensor in header.tensors)
    done_bytes, reported_tenths = 0, 0
    for tensor in header.tensors:
        done_bytes += tensor.num_bytes
        if total_bytes >= PROGRESS_MIN_BYTES and done_bytes * 10 // total_bytes > reported_tenths:
            reported_tenths = done_bytes * 10 // total_bytes
            logger.info("startup: weights  %3d%%  %.0f of %.0f MiB read", reported_tenths * 10,
                        done_bytes / 2**20, total_bytes / 2**20)
        hf_name = _hf_tensor_name(tensor.name, config.architecture, path)
        shape = tuple(reversed(tensor.shape))  # GGUF lists dims innermost first
        data = tensor_data(file_data, header.byte_order, tensor)
        packable = keep_packed and tensor.tensor_type in PACKABLE_TYPES
        if packable and len(shape) == 2:
            weight = decode_gguf_blocks(data, tensor.tensor_type, shape)
        elif packable and len(shape) == 3 and ".mlp.experts." in hf_name:
            # Stacked experts (E, rows, cols): each matrix row is one row of blocks, so the
            # tensor decodes as one (E * rows, cols) matrix.
            num_experts, rows, cols = shape
            stacked = decode_gguf_blocks(data, tensor.tensor_type, (num_experts * rows, cols))
            yield from _per_expert(hf_name, (stacked.narrow(0, expert * rows, rows)
                                             for expert in range(num_experts)))
            continue
        else:
            # NOTE: dequantize returns numpy (row-major) order.
            weight = gguf.quants.dequantize(data, tensor.tensor_type)
        assert tuple(weight.shape) == shape, (tensor.name, weight.shape)
        permuted_rope = config.architecture in _ROPE_PERMUTED_ARCHITECTURES
        if permuted_rope and ".q_proj." in hf_name:
            weight = _unpermute_rope_rows(weight, config.num_attention_heads)
        elif permuted_rope and ".k_proj." in hf_name:
            weight = _unpermute_rope_rows(weight, config.num_key_value_heads)
        if isinstance(weight, GGUFQuantWeight):
            yield hf_name, weight
            continue
        if config.architecture == "gemma3" and tensor.name.endswith("norm.weight"):
            # llama.cpp's converter stored 1 + w for Gemma's (1 + w) norms; HF keeps w. The same
            # fp32 subtraction as transformers' GGUF loader, so both see the same weights.
            weight = weight - np.float32(1)
        if not weight.flags.writeable:  # F32 tensors come back as views of the read-only mmap
            weight = weight.copy()
        weight = torch.from_numpy(weight).to(dtype)
        if ".mlp.experts." in hf_name:  # (E, rows, cols), dequantized: one matrix per expert
            yield from _per_expert(hf_name, weight)
        elif hf_name.endswith(".shared_expert_gate.weight"):
            yield hf_name, weight.reshape(1, -1)  # llama.cpp stores the (1, H) gate as (H,)
        else:
            yield hf_name, weight


def _per_expert(hf_name: str, matrices: Iterable[torch.Tensor | GGUFQuantWeight]
                ) -> Iterator[tuple[str, torch.Tensor | GGUFQuantWeight]]:
    """A stacked expert tensor's matrices, in expert order, under their per-expert HF names
    (model.layers.N.mlp.experts.gate_proj.weight -> ...experts.E.gate_proj.weight)."""
    stem, shard, _ = hf_name.rsplit(".", 2)
    for expert, matrix in enumerate(matrices):
        yield f"{stem}.{expert}.{shard}.weight", matrix


def _read_config(header: GGUFHeader, path: str) -> ModelConfig:
    field = header.get

    architecture = field("general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise unsupported_architecture(architecture, path)

    def arch_field(key: str, default=None):
        return field(f"{architecture}.{key}", default)

    rope_scaling = arch_field("rope.scaling.type", "none")
    tensor_names = {tensor.name for tensor in header.tensors}
    if "rope_factors_long.weight" in tensor_names:  # Phi-3 128k: longrope as factor tensors
        rope_scaling = "longrope"
    if rope_scaling != "none":
        raise ValueError(f"unsupported RoPE scaling {rope_scaling!r} in {path}: only plain RoPE "
                         "is implemented")
    tokens = field("tokenizer.ggml.tokens")
    hidden_size = arch_field("embedding_length")
    num_attention_heads = arch_field("attention.head_count")
    num_experts = arch_field("expert_count", 0)
    moe, model_architecture = None, architecture
    if num_experts:
        moe = MoEConfig(
            num_experts=num_experts,
            num_experts_per_tok=arch_field("expert_used_count"),
            expert_intermediate_size=(arch_field("expert_feed_forward_length")
                                      or arch_field("feed_forward_length")),
            # llama.cpp renormalizes Mixtral's top-k weights, not Qwen2-MoE's (unless told)
            norm_topk_prob=arch_field("expert_weights_norm", architecture != "qwen2moe"),
            shared_expert_intermediate_size=arch_field("expert_shared_feed_forward_length", 0),
        )
        model_architecture = _MOE_ARCHITECTURES[architecture]
    elif architecture in ("mixtral", "qwen2moe"):
        raise ValueError(f"GGUF architecture {architecture!r} without {architecture}.expert_count "
                         f"in {path}")

    # The chat models end a turn with <|im_end|> (<end_of_turn> for Gemma); when the GGUF eos is
    # another token (e.g. Qwen's <|endoftext|>), generation must stop on both. A file without a
    # template gets ours (chat_templates/), as the tokenizer does.
    eos_token_ids = [field("tokenizer.ggml.eos_token_id")]
    chat_template = field("tokenizer.chat_template") or default_chat_template(architecture) or ""
    for turn_end in _CHAT_TURN_END_TOKENS:
        if turn_end in chat_template and tokens is not None:
            eos_token_ids.append(next((i for i, token in enumerate(tokens) if token == turn_end),
                                      None))
    return ModelConfig(
        architecture=model_architecture,
        vocab_size=arch_field("vocab_size") or len(tokens),
        hidden_size=hidden_size,
        intermediate_size=(arch_field("feed_forward_length")
                           or (moe.expert_intermediate_size if moe else None)),
        num_hidden_layers=arch_field("block_count"),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=arch_field("attention.head_count_kv", num_attention_heads),
        head_dim=arch_field("attention.key_length")
        or arch_field("rope.dimension_count")
        or hidden_size // num_attention_heads,
        rms_norm_eps=arch_field("attention.layer_norm_rms_epsilon"),
        rope_theta=arch_field("rope.freq_base", 10000.0),
        max_position_embeddings=arch_field("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_token_ids if i is not None)),
        name=field("general.name") or os.path.basename(path),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=arch_field("attention.sliding_window"),
        moe=moe,
        **(_gemma3_fields(arch_field) if architecture == "gemma3" else {}),
    )


def _gemma3_fields(arch_field) -> dict:
    """Gemma 3's ModelConfig fields beyond the window: as llama.cpp sets them."""
    num_layers = arch_field("block_count")
    head_dim = arch_field("attention.key_length")
    # llama.cpp scales scores by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for the 27B
    # model (62 layers): what query_pre_attn_scalar says in each model's HF config.
    query_pre_attn_scalar = (arch_field("embedding_length") // arch_field("attention.head_count")
                             if num_layers == 62 else head_dim)
    return dict(
        sliding_window_layers=tuple((i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN != 0
                                    for i in range(num_layers)),
        rope_local_theta=_GEMMA3_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=query_pre_attn_scalar,
        final_logit_softcapping=arch_field("final_logit_softcapping"),
    )


def _hf_tensor_name(gguf_name: str, architecture: str, path: str) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    block_names = {**_BLOCK_TENSOR_NAMES, **_ARCHITECTURE_BLOCK_TENSOR_NAMES.get(architecture, {})}
    match = _BLOCK_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is None or match[2] not in block_names:
        raise ValueError(f"unexpected tensor {gguf_name!r} in {path}")
    layer_index, gguf_module, kind = match.groups()
    return f"model.layers.{layer_index}.{block_names[gguf_module]}.{kind}"


def _unpermute_rope_rows(weight, num_heads: int):
    """Undo llama.cpp's q/k row permutation (works for weights [rows, in] and biases [rows]).

    Within each head, HF's rotate-half RoPE pairs row j with row j + head_dim/2; llama.cpp's
    interleaved RoPE pairs rows 2j and 2j+1, so its converter stored the rows of each head as
      gguf row:  0   1        2   3          ...
      hf row:    0   hd/2     1   hd/2+1     ...
    Viewing them as (head, hd/2, 2) and swapping the last two axes puts the halves back.
    """
    head_dim = weight.shape[0] // num_heads
    if isinstance(weight, GGUFQuantWeight):  # rows carry their codes, scales and mins along
        order = _unpermute_rope_rows(torch.arange(weight.shape[0]), num_heads)
        return weight.select_rows(order)
    interleaved = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return interleaved.swapaxes(1, 2).reshape(weight.shape)
