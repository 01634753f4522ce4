"""Gemma 3 (text): Llama's blocks with Gemma's norms, QK-norm, GELU-tanh gating, a scaled
embedding, and local (sliding-window) layers interleaved with global ones.

What differs from llama.py, and where it lives:
  norms        GemmaRMSNorm: x / rms(x) * (1 + weight) in fp32, rounded once; four per layer
               (input, post-attention, pre- and post-feed-forward), and QK-norm (qk_norm) with
               them on q and k per head
  embedding    looked-up rows times sqrt(hidden_size), rounded to the compute dtype (as HF)
  MLP          gelu_tanh(gate) * up
  attention    scores scaled by query_pre_attn_scalar ** -0.5; layers marked in
               sliding_window_layers see the last sliding_window positions and rotate with
               rope_local_theta, the others see everything and rotate with rope_theta
  head         tied; logits soft-capped when final_logit_softcapping is set
The layers take the compiled kernels one by one (Gemma's norms, QK-norm in place, the gated GELU
in one pass on the codes, rotary in place); small steps run the same kernels in one call, the
compiled decoder stack (models/decoder_stack.py), where it applies. Weights keep HF names and
HF's zero-centred norm weights (gguf_loader.py converts).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import AttentionBackend, create_attention_backend
from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import get_pp_group
from pagedserve.kernels import cpu_ops
from pagedserve.layers.activation import gelu_tanh_and_mul
from pagedserve.layers.linear import VocabEmbedding
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import (
    LayerOnAnotherStage,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    MLPFactory,
    StagedDecoder,
    layer_range,
)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm's contract (optionally fused with the residual add before it), Gemma's arithmetic:
    x * rsqrt(mean(x^2) + eps) * (1 + weight), all in fp32, rounded once to x's dtype (HF's
    Gemma3RMSNorm; Llama's rounds before the weight). weight is zero-centred. The compiled CPU
    kernel has both forms (unit_offset); the Triton one computes Llama's only."""

    unit_offset = True

    def __init__(self, dim: int, eps: float, kernels: ModuleType | None) -> None:
        super().__init__(dim, eps, kernels)
        self.gpu_kernels = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # 1 + weight per call (dim elements): a stored fp32 copy would be cast by model.to(dtype).
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), scale.shape, scale, self.eps).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """Llama's attention with QK-norm (config.qk_norm), in Gemma's norm."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, local_layer_idx: int,
                 prefix: str, backend: AttentionBackend, kernels: ModuleType | None,
                 sliding_window: int | None) -> None:
        if not config.qk_norm:
            raise ValueError("Gemma 3 normalizes q and k per head (qk_norm)")
        super().__init__(config, rotary_emb, local_layer_idx, prefix, backend, kernels,
                         sliding_window)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, kernels)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, kernels)


class Gemma3MLP(LlamaMLP):
    activation = "gelu_tanh"

    def act_fn(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(gate_up, self.kernels)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, local_layer_idx: int,
                 prefix: str, backend: AttentionBackend, kernels: ModuleType | None,
                 sliding_window: int | None, mlp: nn.Module | None) -> None:
        """mlp: the layer's MLP, if not Gemma3MLP (see MLPFactory)."""
        super().__init__()
        self.self_attn = Gemma3Attention(config, rotary_emb, local_layer_idx,
                                         f"{prefix}.self_attn", backend, kernels, sliding_window)
        self.mlp = mlp if mlp is not None else Gemma3MLP(config, f"{prefix}.mlp", kernels)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, kernels)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama's contract: returns (this layer's feed-forward output, the residual stream
        before it); the next layer (or the final norm) adds them. residual=None: hidden_states
        is the stream (the first layer)."""
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        attn_out, _ = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(attn_out, residual)
        mlp_out, _ = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return mlp_out, residual


class Gemma3Model(StagedDecoder):
    """LlamaModel's stage layout (layer_range, placeholders for other stages' layers)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 make_mlp: MLPFactory | None = None) -> None:
        super().__init__()
        if not config.tie_word_embeddings:
            raise ValueError("Gemma 3's head is its embedding (tie_word_embeddings)")
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = layer_range(
            config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, serves_as_head=True
        ) if self.is_first_stage or self.is_last_stage else None
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype).item()
        """sqrt(hidden_size) as the compute dtype holds it (HF rounds it so too)."""
        kernels = cpu_ops.for_new_layer()
        backend = create_attention_backend(torch.get_default_device(), dtype, kernels)
        # Each table is looked up once per step by its first layer (RotaryEmbedding._lookup).
        global_rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, dtype, kernels)
        local_rope = global_rope if config.rope_local_theta in (None, config.rope_theta) else (
            RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                            config.rope_local_theta, dtype, kernels))

        def layer(i: int) -> nn.Module:
            if not self.start_layer <= i < self.end_layer:
                return LayerOnAnotherStage()
            window = config.layer_sliding_window(i)
            mlp = make_mlp(i, f"model.layers.{i}.mlp", None) if make_mlp else None
            return Gemma3DecoderLayer(config, global_rope if window is None else local_rope,
                                      i - self.start_layer, f"model.layers.{i}", backend,
                                      kernels, window, mlp)

        self.layers = nn.ModuleList(layer(i) for i in range(config.num_hidden_layers))
        self.norm = (GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
                     if self.is_last_stage else None)
        self.init_decoder_stack(config, kernels)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        if config.qkv_bias or config.o_bias or config.mlp_bias:
            raise ValueError("Gemma 3 has no biases")
        super().__init__(config, dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
