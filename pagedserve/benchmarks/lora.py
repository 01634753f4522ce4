"""`pagedserve bench lora`: what serving LoRA adapters costs, against the same model without.

One invocation loads the model once and runs the same batch (default: 32 requests of random
tokens, 128 in and 64 out, greedy, no early stop) on an engine without LoRA and on one with
enable_lora, whose requests spread over 0, 1, 4 and 8 distinct random adapters (request i takes
adapter i mod n). The configurations alternate over --rounds, and each keeps its best round
(these machines are noisy). It also times loading an adapter (check, read, host copy: what
/v1/load_lora_adapter waits for) and prints every figure as a ratio to the engine without LoRA.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.config import ModelConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.lora.peft import TARGET_MODULES, module_shape
from pagedserve.lora.request import LoRARequest
from pagedserve.models.loader import load_model
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import DTYPES


def write_random_adapter(path: Path, model_config: ModelConfig, rank: int, targets: list[str],
                         seed: int, scale: float = 0.05, alpha: float | None = None,
                         config_overrides: dict | None = None) -> str:
    """A PEFT-format adapter for `model_config` with random A and B: adapter_config.json and
    adapter_model.safetensors. Returns its path."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module in targets:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            in_features, out_features = module_shape(model_config, module)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                rank, in_features, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                out_features, rank, generator=generator) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank,
              "target_modules": targets, "bias": "none", "use_dora": False,
              "use_rslora": False, "modules_to_save": None}
    config.update(config_overrides or {})
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--adapter-counts", default="0,1,4,8",
                        help="distinct adapters over the batch, one run each")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-targets", default=",".join(TARGET_MODULES))
    parser.add_argument("--rounds", type=int, default=2)


def main(args: argparse.Namespace) -> None:
    counts = [int(c) for c in args.adapter_counts.split(",")]
    targets = args.lora_targets.split(",")
    base_args = EngineArgs.from_cli_args(args)
    base_args.enable_lora = False
    lora_args = EngineArgs.from_cli_args(args)
    lora_args.enable_lora = True
    lora_args.max_loras = max(1, max(counts))
    lora_args.max_cpu_loras = max(1, max(counts)) + 1
    lora_args.max_lora_rank = args.lora_rank
    base_config = base_args.create_engine_config()
    lora_config = lora_args.create_engine_config()
    device = base_config.device
    model = load_model(base_config.model_path, base_config.model, DTYPES[device.dtype],
                       torch.device(device.device), device.keeps_weights_packed,
                       device.quantize_on_load)
    base = LLM.from_engine(LLMEngine(base_config, model=model))
    lora = LLM.from_engine(LLMEngine(lora_config, tokenizer=base.engine.tokenizer, model=model))
    rng = random.Random(0)
    vocab = base_config.model.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=False)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"bench-{i}", i + 1, write_random_adapter(
            Path(tmp) / f"a{i}", base_config.model, args.lora_rank, targets, seed=i))
            for i in range(max(counts) + 1)]
        for adapter in adapters[:-1]:
            lora.add_lora(adapter)
        runs: dict[str, tuple[LLM, list]] = {"no LoRA engine": (base, [None] * len(prompts))}
        for count in counts:
            per_request = [adapters[i % count] if count else None for i in range(len(prompts))]
            runs[f"LoRA engine, {count} adapters"] = (lora, per_request)
        base.generate(prompts[:2], params)  # warm-up
        lora.generate(prompts[:2], params, lora_request=adapters[0])
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, (llm, loras) in runs.items():
                start = time.perf_counter()
                llm.generate(prompts, params, lora_request=loras)
                elapsed = time.perf_counter() - start
                best[name] = min(best.get(name, float("inf")), elapsed)
        load_seconds = []
        spare = adapters[-1]
        for _ in range(5):
            start = time.perf_counter()
            lora.add_lora(spare)
            load_seconds.append(time.perf_counter() - start)
            lora.remove_lora(spare.lora_int_id)
    base.engine.assert_idle()
    lora.engine.assert_idle()
    slot_bytes = lora.engine.executor.worker.model_runner.lora_manager.slot_bytes
    num_tokens = args.num_prompts * args.output_len
    reference = best["no LoRA engine"]
    print(f"{args.num_prompts} requests x ({args.input_len} in, {args.output_len} out), rank "
          f"{args.lora_rank} adapters on {','.join(targets)}, {base_config.device.dtype}, "
          f"{torch.get_num_threads()} threads; best of {args.rounds} rounds")
    print(f"{'configuration':<32} {'seconds':>8} {'output tok/s':>13} {'vs no LoRA':>11}")
    for name, seconds in best.items():
        print(f"{name:<32} {seconds:8.2f} {num_tokens / seconds:13.1f} "
              f"{reference / seconds:10.2f}x")
    print(f"adapter load (check + read + host copy): median "
          f"{statistics.median(load_seconds) * 1e3:.1f} ms over {len(load_seconds)}; slots: "
          f"{slot_bytes / 2**20:.1f} MiB for max_loras={lora_args.max_loras}")
    base.engine.shutdown()
    lora.engine.shutdown()
