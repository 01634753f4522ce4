"""Llama (SmolLM2 and friends), shaped like the HF module tree so HF weight names load directly.

q/k/v and gate/up are merged into one matmul each; the packed mapping routes the HF weights into
their slices. Qwen2 (q/k/v biases), Qwen3 (QK-norm) and Phi-3 (fused checkpoint weights) reuse
these blocks, the differences carried by ModelConfig (see qwen2.py, qwen3.py, phi3.py).

Parallelism lives in the layers (layers/linear.py): under tensor parallelism each rank holds
num_heads/tp query heads and num_kv_heads/tp KV heads, its columns of the MLP and its rows of the
vocabulary, and the layers all-reduce once after attention and once after the MLP. Under pipeline
parallelism a stage builds only its layers [start_layer, end_layer) (see `layer_range`), the first
stage the embedding, the last the final norm and the head; hidden states pass between stages as
IntermediateTensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from pagedserve.attention import AttentionBackend, create_attention_backend
from pagedserve.attention.layer import Attention
from pagedserve.attention.metadata import get_forward_context, get_lora_step
from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import get_pp_group, get_tp_group
from pagedserve.kernels import cpu_ops, triton_ops
from pagedserve.models.decoder_stack import (
    FUSED_MAX_TOKENS,
    build_decoder_stack,
    run_decoder_stack,
)
from pagedserve.layers.activation import silu_and_mul
from pagedserve.layers.linear import (
    MergedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabEmbedding,
    default_weight_loader,
)
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding

MLPFactory = Callable[[int, str, ModuleType | None], nn.Module | None]
"""(layer index, prefix, kernels) -> that layer's MLP, or None for the dense LlamaMLP: how a
family swaps the MLP (an MoE block) while reusing these layers."""

IntermediateTensors = dict[str, torch.Tensor]
"""What a pipeline stage hands the next: "hidden_states" and "residual", each (T, hidden) in the
compute dtype, contiguous."""


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of pipeline stage pp_rank: contiguous and as even as possible, the
    remainder going one each to the first stages (the last one also runs the norm and the head)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} must be in [1, {num_layers}] "
                         "(the number of layers)")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, local_layer_idx: int,
                 prefix: str, backend: AttentionBackend, kernels: ModuleType | None,
                 sliding_window: int | None = None) -> None:
        """sliding_window: this layer's (Attention); the score scale comes from the config."""
        super().__init__()
        tp_size = get_tp_group().world_size
        for name in ("num_attention_heads", "num_key_value_heads"):
            if getattr(config, name) % tp_size:
                raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's "
                                 f"{name} ({getattr(config, name)})")
        self.num_heads = config.num_attention_heads // tp_size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.head_dim = config.head_dim
        self.qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=config.o_bias,
                                        prefix=f"{prefix}.o_proj")
        # QK-norm (Qwen3): one RMSNorm over head_dim, shared by every query head, one by every key
        self.q_norm, self.k_norm = (
            (RMSNorm(self.head_dim, config.rms_norm_eps, kernels),
             RMSNorm(self.head_dim, config.rms_norm_eps, kernels)) if config.qk_norm
            else (None, None)
        )
        self.rotary_emb = rotary_emb
        scale = (None if config.query_pre_attn_scalar is None
                 else config.query_pre_attn_scalar**-0.5)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, local_layer_idx,
                              backend, scale, sliding_window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        if self.q_norm is not None:
            qkv = self._norm_qk_heads(qkv)
        # q and k are adjacent columns: rotate them as one (T, H + Hkv, D) view, half the ops.
        qk_heads = self.num_heads + self.num_kv_heads
        if self.rotary_emb.rotate_in_place(positions, qkv, qk_heads):
            qk = qkv[:, : self.qk_size].view(num_tokens, qk_heads, -1)
        else:
            qk = self.rotary_emb(positions, qkv[:, : self.qk_size].view(num_tokens, qk_heads, -1))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v)  # q: (T, H, D), k, v: (T, Hkv, D), this rank's heads
        return self.o_proj(out.reshape(num_tokens, -1))

    def _norm_qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """(T, (H + 2 Hkv) D) -> the same with every q and k head RMS-normed over its D values."""
        ops = self.q_norm.kernels
        if ops is not None and cpu_ops.serves(qkv) and qkv.dim() == 2 and qkv.stride(1) == 1:
            # In place on the projection's output, each head as the norm module computes it
            # (csrc rms_norm_heads_inplace), without the split, the copies and the cat below.
            ops.rms_norm_heads_inplace(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                       self.k_norm.weight, self.q_norm.eps,
                                       self.q_norm.unit_offset)
            return qkv
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=1)
        q, _ = self.q_norm(q.reshape(-1, self.head_dim))  # (T H, D)
        k, _ = self.k_norm(k.reshape(-1, self.head_dim))  # (T Hkv, D)
        return torch.cat([q.view(num_tokens, -1), k.view(num_tokens, -1), v], dim=1)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, kernels: ModuleType | None,
                 intermediate_size: int | None = None) -> None:
        """intermediate_size: the width, if not config.intermediate_size (an MoE's shared
        expert)."""
        super().__init__()
        self.kernels = kernels
        self.gpu_kernels = triton_ops.for_new_layer()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {0: intermediate_size, 1: intermediate_size}, bias=config.mlp_bias,
        )
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias, prefix=f"{prefix}.down_proj")

    activation = "silu"
    """The gated activation act(gate) * up (layers/activation.py): "silu" or "gelu_tanh"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = (self.gate_up_proj.gated_activation(x, self.activation)
                     if self.kernels is not None else None)
        if activated is None:
            activated = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(activated)

    def act_fn(self, gate_up: torch.Tensor) -> torch.Tensor:
        gpu = self.gpu_kernels
        if gpu is not None and gate_up.dim() == 2 and gpu.serves(gate_up):
            return gpu.silu_and_mul(gate_up)
        return silu_and_mul(gate_up, self.kernels)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, local_layer_idx: int,
                 prefix: str, kernels: ModuleType | None, backend: AttentionBackend,
                 mlp: nn.Module | None = None, sliding_window: int | None = None) -> None:
        """mlp: the layer's MLP, if not the dense LlamaMLP (see MLPFactory). sliding_window:
        the layer's (ModelConfig.layer_sliding_window)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, local_layer_idx,
                                        f"{prefix}.self_attn", backend, kernels, sliding_window)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, f"{prefix}.mlp", kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LayerOnAnotherStage(nn.Module):
    """Placeholder for a layer another pipeline stage holds: keeps `layers[i]` the HF layer i (so
    checkpoint names need no renumbering) without parameters. Never run."""


class StagedDecoder(nn.Module):
    """The forward pass of a decoder split into pipeline stages: the first stage embeds (or a
    family's fused path takes the whole step), each stage runs its layers, the last one the
    final norm while the others hand their hidden states on. Subclasses hold the attributes
    (is_first_stage, is_last_stage, start_layer, end_layer, embed_tokens, layers, norm)."""

    fused_decoder_layers = False
    """Run steps of at most FUSED_MAX_TOKENS tokens as one compiled DecoderStack call where it
    applies (models/decoder_stack.py; set by init_decoder_stack); the profiler turns it off to
    time the modules."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def init_decoder_stack(self, config: ModelConfig, kernels: ModuleType | None) -> None:
        """For a family whose blocks the compiled DecoderStack implements (decoder_stack.py
        `implements`): small steps then run as one call where it applies."""
        self._kernels = kernels
        self.fused_decoder_layers = (
            kernels is not None and cpu_ops.build_config().fused_decoder_layers
        )
        self._stack: object | None | bool = False
        """The compiled DecoderStack for small steps: False until first asked, None if it does
        not apply (models/decoder_stack.py)."""
        windows = [w for i in range(config.num_hidden_layers)
                   if (w := config.layer_sliding_window(i)) is not None]
        self._smallest_window = min(windows, default=None)
        """The stack's kernels know no windows: it serves only steps whose sequences all fit in
        every layer's window (where a window changes nothing)."""

    def invalidate_decoder_stack(self) -> None:
        """Build the stack again on its next use (it copies what it reads from the layers)."""
        self._stack = False

    def _decoder_stack(self) -> object | None:
        if self._stack is False:  # built on first use: the weights are final by then
            self._stack = build_decoder_stack(self, self._kernels)
        return self._stack

    def run_fused(self, hidden_states: torch.Tensor, positions: torch.Tensor, end_layer: int,
                  num_tokens: int) -> torch.Tensor | None:
        """The compiled decoder stack's output where it serves the step
        (models/decoder_stack.py)."""
        stack = self._decoder_stack() if self.fused_decoder_layers else None
        if stack is None or num_tokens > FUSED_MAX_TOKENS:
            return None
        lora_step = get_lora_step()
        # The stack runs LoRA in its masked form only (lora/worker_manager.py picks it for
        # steps of at most FUSED_MAX_TOKENS tokens, or mixing adapters).
        if lora_step is not None and lora_step.token_slots is None:
            return None
        meta = get_forward_context()
        if self._smallest_window is not None and max(meta.seq_lens) > self._smallest_window:
            return None
        return run_decoder_stack(stack, hidden_states, positions, meta, end_layer, lora_step)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None, num_layers: int | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """See LlamaForCausalLM.forward."""
        end_layer = self.end_layer
        if num_layers is not None:
            assert self.is_first_stage and self.is_last_stage, "a self-draft runs in one stage"
            end_layer = min(num_layers, end_layer)
        if self.is_first_stage:
            assert intermediate_tensors is None, "the first stage embeds; pass num_layers="
            hidden_states, residual = self.embed(input_ids), None
            fused = self.run_fused(hidden_states, positions, end_layer, input_ids.shape[0])
            if fused is not None:
                return fused
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer : end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_stage:
            return {"hidden_states": hidden_states.contiguous(), "residual": residual.contiguous()}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaModel(StagedDecoder):
    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 make_mlp: MLPFactory | None = None) -> None:
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = layer_range(
            config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        # The last stage also needs the table when it is the (tied) head.
        needs_embedding = self.is_first_stage or (self.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, serves_as_head=config.tie_word_embeddings
        ) if needs_embedding else None
        # The compiled paths are decided here, once, from the KernelConfig this model is built
        # under (DeviceConfig via load_model; kernels/cpu_ops.py): the layers hold the result.
        kernels = cpu_ops.for_new_layer()
        attention_backend = create_attention_backend(torch.get_default_device(), dtype, kernels)
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, dtype, kernels
        )
        self.layers = nn.ModuleList(
            # the attention indexes the stage's KV caches: the local layer index
            LlamaDecoderLayer(config, rotary_emb, i - self.start_layer, f"model.layers.{i}",
                              kernels, attention_backend,
                              make_mlp(i, f"model.layers.{i}.mlp", kernels) if make_mlp else None,
                              config.layer_sliding_window(i))
            if self.start_layer <= i < self.end_layer else LayerOnAnotherStage()
            for i in range(config.num_hidden_layers)
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, kernels) if self.is_last_stage
            else None
        )
        self.init_decoder_stack(config, kernels)


class LlamaForCausalLM(nn.Module):
    model_class: type[nn.Module] = LlamaModel
    """The decoder (embedding, layers, final norm); a family with other blocks brings its own,
    with LlamaModel's attributes (start_layer, end_layer, embed_tokens, norm, is_last_stage)."""
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
        self.model = self.model_class(config, dtype, self.make_mlp)
        self.lm_head = (
            ParallelLMHead(config.hidden_size, config.vocab_size)
            if self.model.is_last_stage and not config.tie_word_embeddings else None
        )

    def make_mlp(self, layer_index: int, prefix: str,
                 kernels: ModuleType | None) -> nn.Module | None:
        """A family's own MLP for layer `layer_index` (see MLPFactory); Llama's is dense."""
        return None

    @property
    def start_layer(self) -> int:
        """First layer this pipeline stage holds (0 without PP); its KV cache list starts here."""
        return self.model.start_layer

    @property
    def end_layer(self) -> int:
        """One past the last layer this stage holds: its KV caches are end_layer - start_layer."""
        return self.model.end_layer

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None, num_layers: int | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: (T,). The first stage embeds input_ids; the others start from
        the previous stage's intermediate_tensors. The last stage returns the normed hidden states
        (T, hidden); the others return IntermediateTensors for the next stage.

        num_layers (one stage only): run only the first layers, then the final norm (a
        self-draft's pass)."""
        return self.model(input_ids, positions, intermediate_tensors, num_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) fp32, the whole vocabulary on every TP rank (last stage)."""
        assert self.model.is_last_stage, "only the last pipeline stage holds the head"
        head = self.model.embed_tokens.as_head if self.lm_head is None else self.lm_head
        return head(hidden_states).float()

    def _on_this_stage(self, name: str) -> bool:
        """Whether HF weight `name` belongs to a module this pipeline stage holds."""
        if name.startswith("model.layers."):
            return self.start_layer <= int(name.split(".")[2]) < self.end_layer
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def load_family_weight(self, name: str, tensor: torch.Tensor) -> set[str] | None:
        """A weight with no Llama counterpart (an MoE's experts): load it and return the keys it
        filled (its module's `load_keys`), or None: `name` is a Llama-named weight."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named weights, each parameter its own slice (TP); weights of other pipeline
        stages are skipped. Every parameter of this rank must be filled exactly once."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding serves as the head
            if not self._on_this_stage(name):
                continue
            if (keys := self.load_family_weight(name, tensor)) is not None:
                loaded |= keys
                continue
            for hf_name, (merged_name, shard_id) in self.packed_modules_mapping.items():
                if f".{hf_name}." in name:
                    target = name.replace(hf_name, merged_name)
                    if target not in params:
                        raise ValueError(f"unexpected weight {name!r}")
                    params[target].weight_loader(params[target], tensor, shard_id)
                    loaded.add(f"{target}#{shard_id}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r}")
                weight_loader = getattr(params[name], "weight_loader", default_weight_loader)
                weight_loader(params[name], tensor)
                loaded.add(name)
        expected = set()
        for name in params:
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, MergedLinear):
                expected.update(f"{name}#{shard}" for shard in module.shard_offsets)
            elif hasattr(module, "load_keys"):  # loads its own checkpoint parts (MoE experts)
                expected |= module.load_keys(name.rsplit(".", 1)[0])
            else:
                expected.add(name)
        if missing := sorted(expected - loaded):
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}...")
