"""A tiny random Llama-family model and the two steps every distributed test runs on it.

Used by the reference (in the pytest process, one rank) and by each rank (rank_main.py), so both
build, load and run the model the same way; only the process groups differ.
8 query heads and 4 KV heads split over 2 and 4 TP ranks; a vocabulary of 203 (prime to 2 and 4)
exercises the vocabulary padding; 3 layers split 2 + 1 over 2 pipeline stages. qwen2_moe has 4
experts of width 64 (split over the TP ranks like the dense MLP) and a shared expert.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.attention import AttentionMetadata, forward_context
from pagedserve.attention.kv_cache import kv_cache_shape
from pagedserve.config import ModelConfig, MoEConfig
from pagedserve.distributed.parallel_state import get_pp_group, get_tp_group
from pagedserve.layers.linear import Linear, VocabEmbedding
from pagedserve.layers.moe import FusedExperts
from pagedserve.models import get_model_class

BLOCK_SIZE = 4
NUM_BLOCKS = 8
PROMPTS = [[5, 17, 200, 42, 7], [1, 2, 3, 150, 99, 31, 64]]
DECODE_TOKENS = [11, 202]
BLOCK_IDS = [[1, 2], [3, 4, 5]]
"""Per request; block 0 is the null block. Enough for each prompt plus one decode token."""


def tiny_config(architecture: str) -> ModelConfig:
    """llama: tied head, biases everywhere (o_proj's is added once under TP); qwen2: q/k/v
    biases, untied head; phi3: fused qkv and gate-up weights (each rank takes its q/k/v heads and
    gate/up columns of them on load), no biases; qwen2_moe: qwen2's, top-2 of 4 experts and a
    shared expert, the middle layer dense."""
    llama = architecture == "llama"
    moe = MoEConfig(
        num_experts=4, num_experts_per_tok=2, expert_intermediate_size=64, norm_topk_prob=False,
        shared_expert_intermediate_size=96, dense_layers=(1,),
    ) if architecture == "qwen2_moe" else None
    return ModelConfig(
        architecture=architecture, vocab_size=203, hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
        tie_word_embeddings=llama, qkv_bias=architecture in ("llama", "qwen2", "qwen2_moe"),
        o_bias=llama, mlp_bias=llama, moe=moe,
    )


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights; spread wide enough that the greedy tokens have no near-ties."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    weights = {"model.embed_tokens.weight": randn(config.vocab_size, h, scale=1.0)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        weights[f"{prefix}.input_layernorm.weight"] = 1 + randn(h, scale=0.1)
        weights[f"{prefix}.post_attention_layernorm.weight"] = 1 + randn(h, scale=0.1)
        for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            weights[f"{prefix}.self_attn.{name}.weight"] = randn(size, h)
            if config.qkv_bias:
                weights[f"{prefix}.self_attn.{name}.bias"] = randn(size)
        weights[f"{prefix}.self_attn.o_proj.weight"] = randn(h, q)
        if config.o_bias:
            weights[f"{prefix}.self_attn.o_proj.bias"] = randn(h)
        if config.moe is not None and layer not in config.moe.dense_layers:
            weights.update(_random_moe(config, prefix, randn))
            continue
        weights[f"{prefix}.mlp.gate_proj.weight"] = randn(i, h)
        weights[f"{prefix}.mlp.up_proj.weight"] = randn(i, h)
        weights[f"{prefix}.mlp.down_proj.weight"] = randn(h, i)
        if config.mlp_bias:
            for name, size in (("gate_proj", i), ("up_proj", i), ("down_proj", h)):
                weights[f"{prefix}.mlp.{name}.bias"] = randn(size)
    weights["model.norm.weight"] = 1 + randn(h, scale=0.1)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = randn(config.vocab_size, h)
    if config.architecture == "phi3":  # its checkpoints hold q/k/v and gate/up fused
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            weights[f"{prefix}.self_attn.qkv_proj.weight"] = torch.cat([
                weights.pop(f"{prefix}.self_attn.{name}.weight")
                for name in ("q_proj", "k_proj", "v_proj")])
            weights[f"{prefix}.mlp.gate_up_proj.weight"] = torch.cat([
                weights.pop(f"{prefix}.mlp.{name}.weight") for name in ("gate_proj", "up_proj")])
    return weights


def _random_moe(config: ModelConfig, prefix: str, randn) -> dict[str, torch.Tensor]:
    """One Qwen2-MoE block's checkpoint weights, one matrix per expert."""
    moe, h, block = config.moe, config.hidden_size, f"{prefix}.mlp"

    def mlp(name: str, width: int) -> dict[str, torch.Tensor]:
        return {f"{name}.gate_proj.weight": randn(width, h),
                f"{name}.up_proj.weight": randn(width, h),
                f"{name}.down_proj.weight": randn(h, width)}

    weights = {f"{block}.gate.weight": randn(moe.num_experts, h, scale=1.0),
               f"{block}.shared_expert_gate.weight": randn(1, h)}
    for expert in range(moe.num_experts):
        weights |= mlp(f"{block}.experts.{expert}", moe.expert_intermediate_size)
    return weights | mlp(f"{block}.shared_expert", moe.shared_expert_intermediate_size)


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """This rank's part of the model (read from the process groups), loaded from full weights."""
    model = get_model_class(config.architecture)(config, torch.float32)
    model.load_weights(weights.items())
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(torch.float32)
    return model.eval()


def sharded_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers of the TP-split layers (linear layers, embedding,
    experts)."""
    return sum(
        t.numel() * t.element_size()
        for module in model.modules()
        if isinstance(module, (Linear, VocabEmbedding, FusedExperts))
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
    )


def _metadata(
    context_lens: list[int], query_lens: list[int], kv_caches: list
) -> AttentionMetadata:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slots = [
        blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for blocks, c, s in zip(BLOCK_IDS, context_lens, seq_lens) for p in range(c, s)
    ]
    num_decodes = sum(1 for q in query_lens if q == 1)
    max_blocks = max(len(b) for b in BLOCK_IDS)
    return AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).tolist(),
        context_lens=context_lens,
        seq_lens=seq_lens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=torch.tensor([b + [0] * (max_blocks - len(b)) for b in BLOCK_IDS]),
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int64),
        kv_caches=kv_caches,
    )


def _stage_forward(model, input_ids: list[int], positions: list[int], meta: AttentionMetadata):
    """One step of this pipeline stage: receive from the previous stage, run, send on. Returns
    the final hidden states on the last stage, else None."""
    pp = get_pp_group()
    hidden_size = model.config.hidden_size
    intermediate = None
    if not pp.is_first_rank:
        intermediate = {
            "hidden_states": torch.empty(len(input_ids), hidden_size),
            "residual": torch.empty(len(input_ids), hidden_size),
        }
        pp.recv([intermediate["hidden_states"], intermediate["residual"]], pp.prev_rank)
    with forward_context(meta):
        out = model(torch.tensor(input_ids), torch.tensor(positions), intermediate)
    if pp.is_last_rank:
        return out
    for handle in pp.send([out["hidden_states"], out["residual"]], pp.next_rank):
        handle.wait()
    return None


@torch.inference_mode()
def run_steps(model) -> np.ndarray | None:
    """A prefill of both PROMPTS (fresh, context 0) then one decode step each that reads their
    cache. Returns the fp32 logits of every token of both steps, (12 + 2, vocab), on the last
    stage; None elsewhere. The KV caches hold only this rank's KV heads and this stage's layers."""
    config = model.config
    num_kv_heads = config.num_key_value_heads // get_tp_group().world_size
    shape = kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape))
                 for _ in range(model.start_layer, model.end_layer)]
    prompt_lens = [len(p) for p in PROMPTS]
    steps = [
        (sum(PROMPTS, []), [p for n in prompt_lens for p in range(n)],
         _metadata([0, 0], prompt_lens, kv_caches)),
        (DECODE_TOKENS, prompt_lens, _metadata(prompt_lens, [1, 1], kv_caches)),
    ]
    hidden = [_stage_forward(model, ids, positions, meta) for ids, positions, meta in steps]
    if not get_pp_group().is_last_rank:
        return None
    return torch.cat([model.compute_logits(h) for h in hidden]).numpy()

