"""The decoder layers of a Llama-family or Gemma 3 model as one compiled call, for steps of a
few tokens.

A decode step of one request runs ~80 small ops per layer from Python; on this kind of CPU that
dispatch cost was half the step. `DecoderStack` (csrc/cpu_ops.cpp) runs the same kernels the
Python modules call for such a step, in the same order and dtypes, from C++: same output, bitwise
(tests/models/test_decoder_stack.py). It applies to steps of at most FUSED_MAX_TOKENS tokens (a
batch of up to 32 decodes); anything else runs the modules.

Each projection multiplies as Linear does: packed for the compiled kernel
(`GroupQuantizedWeight`, the default on the CPU for GGUF 4/5/8-bit files), by its codes up to
PACKED_MAX_ROWS rows, and above that, in bf16, by torch's matmul on its weights dequantized from
the codes (fp32 and quantized-on-load layers use their codes for every row count); dense (a GGUF
type the codes cannot hold, such as a Q4_K_M file's Q6_K layers), by dense_rows or F.linear.

It implements the plain Llama layer (Llama, Qwen2 and Phi-3 build it) and Gemma 3's (four norms
in Gemma's form, QK-norm, GELU gating, each layer's own rotary table and KV cache group), not
QK-norm in Llama's block (Qwen3), an MoE block (Mixtral, Qwen2-MoE) nor any subclassed block:
those models always run the modules (`implements`). Its kernels know no sliding window: it serves
a step only while every sequence fits in every layer's window, where the window changes nothing.
It runs every layer in one call, with no all-reduce between layers and no stage boundary, so it
is off under tensor or pipeline parallelism (the modules then run, reducing in the layers).
Whether to use it at all is the model's KernelConfig.fused_decoder_layers (DeviceConfig;
kernels/cpu_ops.py).

A step with LoRA adapters runs them in the stack too, in their masked form (lora/layers.py):
the same ops, so the same output as the modules.

It reads the KV cache of any --kv-cache-dtype: each layer's cache tuple goes to the same write_kv
and paged_attention kernels the modules call, with the scales of a quantized (int8 / fp8) cache
(tests/attention/test_quantized_kv.py checks it against the modules).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.attention.cpu_kernel_backend import KERNEL_MAX_TOKENS
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.paged import token_rows_and_lens
from pagedserve.distributed.parallel_state import get_pp_group, get_tp_group
from pagedserve.layers import linear as linear_layers
from pagedserve.layers.linear import Linear
from pagedserve.layers.quantized import GroupQuantizedWeight

FUSED_MAX_TOKENS = KERNEL_MAX_TOKENS
"""The longest step the stack serves: the attention backend's limit for the paged-attention
kernel the stack calls (longer steps' attention runs other kernels in the modules)."""


def _linears(layer) -> list[Linear]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj]


def _stack_linear_args(linear: Linear) -> tuple | None:
    """The linear as DecoderStack.add_layer takes it: its codes (and how Linear multiplies by
    them), or its dense weight (a GGUF type the codes' layout cannot hold, such as Q6_K) with the
    row count up to which Linear uses the dense_rows kernel (0: it does not); None where Linear
    multiplies another way."""
    packed = linear.packed
    if packed is None:
        weight = linear.weight
        if weight is None or weight.device.type != "cpu":
            return None
        rows_max = linear_layers.DENSE_ROWS_MAX if linear.dense_rows_kernels is not None else 0
        return (weight, linear.bias, rows_max)
    if not isinstance(packed, GroupQuantizedWeight) or linear.weight is not None:
        return None
    return (packed.codes, packed.scales, packed.mins, linear.bias, packed.out_features,
            packed.bits, packed.activation_bits, linear.dense_above_max_rows,
            linear_layers.PACKED_MAX_ROWS,  # read when built, as Linear reads it when called
            packed.outlier_channels, packed.outlier_weights)


def implements(layer) -> bool:
    """Whether the compiled layer computes exactly what `layer` does: the Llama block as
    llama.py builds it, without QK-norm, or Gemma 3's (gemma3.py: sandwich norms, QK-norm, GELU
    gating). A subclassed block (another family's) may compute something else, so only the
    exact classes qualify."""
    from pagedserve.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3MLP  # (cycle)
    from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if type(layer) is Gemma3DecoderLayer:
        return type(layer.self_attn) is Gemma3Attention and type(layer.mlp) is Gemma3MLP
    return (type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
            and type(layer.mlp) is LlamaMLP and layer.self_attn.q_norm is None)


def build_decoder_stack(model, kernels: ModuleType | None) -> object | None:
    """A DecoderStack over `model` (a LlamaModel or Gemma3Model) from `kernels` (the compiled
    CPU kernels), or None where it does not apply."""
    if get_tp_group().world_size > 1 or get_pp_group().world_size > 1:
        return None
    ops = kernels
    first = model.layers[0]
    if ops is None or first.input_layernorm.weight.device.type != "cpu":
        return None
    if not all(implements(layer) for layer in model.layers):
        return None
    attn = first.self_attn
    stack = ops.DecoderStack(
        attn.num_heads, attn.num_kv_heads, attn.head_dim, first.input_layernorm.eps,
        model.norm.weight, attn.attn.scale, first.input_layernorm.unit_offset,
        first.mlp.activation,
    )
    for layer in model.layers:
        linears = [_stack_linear_args(linear) for linear in _linears(layer)]
        if any(args is None for args in linears):
            return None
        attn = layer.self_attn

        def weight(norm):  # an optional norm's weight (QK-norm, Gemma 3's sandwich norms)
            return norm.weight if norm is not None else None

        stack.add_layer(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, linears,
            attn.rotary_emb.cos_cache, attn.rotary_emb.signed_sin_cache,
            weight(attn.q_norm), weight(attn.k_norm),
            weight(getattr(layer, "pre_feedforward_layernorm", None)),
            weight(getattr(layer, "post_feedforward_layernorm", None)),
        )
    return stack


def run_decoder_stack(
    stack, hidden_states: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
    num_layers: int, lora_step=None,
) -> torch.Tensor:
    """Each layer reads and writes its KV cache group's slots (meta.for_layer). lora_step: the
    step's LoRAStep (lora/layers.py), whose masked form the stack runs."""
    rows, lens = token_rows_and_lens(meta)
    groups = (meta, *meta.other_groups)
    lora_factors, lora_masks = lora_step.stack_args() if lora_step is not None else ([], [])
    return stack.forward(
        hidden_states, positions, meta.kv_caches, [g.slot_mapping for g in groups],
        [g.block_table for g in groups], list(meta.layer_groups), rows, lens, num_layers,
        lora_factors, lora_masks,
    )
