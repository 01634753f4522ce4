"""Llama (SmolLM2 and friends), shaped like the HF module tree so HF weight names load directly.

q/k/v and gate/up are merged into one matmul each; the packed mapping routes the HF weights into
their slices. Qwen2 reuses these blocks with its own biases (see qwen2.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.attention.layer import Attention
from pagedserve.attention.metadata import get_forward_context
from pagedserve.config import ModelConfig
from pagedserve.models.decoder_stack import (
    FUSED_MAX_TOKENS,
    build_decoder_stack,
    run_decoder_stack,
)
from pagedserve.layers.activation import silu_and_mul
from pagedserve.layers.linear import Linear, MergedLinear, VocabEmbedding, default_weight_loader
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qk_size = config.q_size + config.kv_size
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
            bias=config.qkv_bias,
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        # q and k are adjacent columns: rotate them as one (T, H + Hkv, D) view, half the ops.
        qk_heads = self.num_heads + self.num_kv_heads
        if self.rotary_emb.rotate_in_place(positions, qkv, qk_heads):
            qk = qkv[:, : self.qk_size].view(num_tokens, qk_heads, -1)
        else:
            qk = self.rotary_emb(positions, qkv[:, : self.qk_size].view(num_tokens, qk_heads, -1))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v)  # q: (T, H, D), k, v: (T, Hkv, D)
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            config.hidden_size,
            {0: config.intermediate_size, 1: config.intermediate_size},
            bias=config.mlp_bias,
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, serves_as_head=config.tie_word_embeddings
        )
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._stack: object | None | bool = False
        """The compiled DecoderStack for small steps: False until first asked, None if it does
        not apply (models/decoder_stack.py)."""

    def _decoder_stack(self) -> object | None:
        if self._stack is False:  # built on first use: the weights are final by then
            self._stack = build_decoder_stack(self)
        return self._stack

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None
    ) -> torch.Tensor:
        """num_layers: run only the first layers, then the final norm (a self-draft's pass)."""
        hidden_states, residual = self.embed_tokens(input_ids), None
        if input_ids.shape[0] <= FUSED_MAX_TOKENS and (stack := self._decoder_stack()) is not None:
            meta = get_forward_context()
            return run_decoder_stack(stack, hidden_states, positions, meta,
                                     len(self.layers[:num_layers]))
        for layer in self.layers[:num_layers]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, hidden). num_layers: see LlamaModel."""
        return self.model(input_ids, positions, num_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) fp32."""
        head = self.model.embed_tokens.as_head if self.lm_head is None else self.lm_head
        return head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named weights; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            for hf_name, (merged_name, shard_id) in self.packed_modules_mapping.items():
                if f".{hf_name}." in name:
                    target = name.replace(hf_name, merged_name)
                    layer = self.get_submodule(target.rsplit(".", 1)[0])
                    layer.weight_loader(params[target], tensor, shard_id)
                    loaded.add(f"{target}#{shard_id}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r}")
                default_weight_loader(params[name], tensor)
                loaded.add(name)
        expected = set()
        for name in params:
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, MergedLinear):
                expected.update(f"{name}#{shard}" for shard in module.shard_offsets)
            else:
                expected.add(name)
        if missing := sorted(expected - loaded):
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}...")
