"""Reading a PEFT LoRA adapter directory, and checking it against the base model, without torch.

An adapter is `adapter_config.json` plus `adapter_model.safetensors` (a pickled
`adapter_model.bin` is refused: nothing on an input path is unpickled). Everything that can be
wrong is found here, from the config and the safetensors header alone, before a byte of tensor
data is read or any memory is allocated: unsupported options (DoRA, biases, modules_to_save,
per-module ranks), a rank above max_lora_rank, a module the engine cannot adapt, a layer the
model does not have, a shape that does not fit the model, a corrupt or truncated file.

The content digest (sha256 of both files) names the adapter in the prefix cache and the KV
tiers: two adapters never share KV, even under the same name across restarts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

from pagedserve.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (the linear layers of every decoder layer)."""

_SAFETENSORS_DTYPES = ("BF16", "F16", "F32")

_TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGET_MODULES) + r")"
    r"\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)
"""base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name such as
".default" may sit before ".weight")."""


class AdapterError(ValueError):
    """The adapter cannot be served; the message says why (a 400 for a server request)."""


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection: W x + scaling * B (A x)."""

    layer: int
    module: str
    """One of TARGET_MODULES."""
    lora_a: str
    """Tensor name of A, (rank, in_features)."""
    lora_b: str
    """Tensor name of B, (out_features, rank)."""


@dataclass(frozen=True)
class PeftAdapter:
    path: str
    """The adapter directory (resolved)."""
    rank: int
    scaling: float
    """lora_alpha / rank (lora_alpha / sqrt(rank) with use_rslora)."""
    modules: tuple[AdapterModule, ...]
    digest: str
    """sha256 of the config and weights files: the adapter's identity in cache keys."""

    @property
    def weights_path(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m for m in TARGET_MODULES if any(a.module == m for a in self.modules))


def module_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of `model`, unsplit."""
    hidden, inter = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (hidden, model.q_size), "k_proj": (hidden, model.kv_size),
        "v_proj": (hidden, model.kv_size), "o_proj": (model.q_size, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }[module]


def confine_path(root: str, path: str) -> str:
    """`path` (relative to `root`, or absolute) resolved with every symlink followed; raises
    AdapterError unless it lies inside `root` (no `..` and no symlink leads out of it)."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    if os.path.commonpath([real_root, real]) != real_root:
        raise AdapterError(f"adapter path {path!r} is outside the LoRA directory")
    return real


def inspect_adapter(path: str, model: ModelConfig, max_lora_rank: int,
                    root: str | None = None) -> PeftAdapter:
    """Check the adapter at `path` against `model` and the rank limit; raises AdapterError.
    root: every file read must lie inside it (symlinks followed), as --lora-dir requires."""
    directory = os.path.realpath(path) if root is None else confine_path(root, path)
    if not os.path.isdir(directory):
        raise AdapterError(f"no adapter directory at {path!r}")
    config_path, weights_path = (os.path.join(directory, name)
                                 for name in (CONFIG_FILE, WEIGHTS_FILE))
    if root is not None:  # a file inside may itself be a symlink out of the root
        config_path, weights_path = (confine_path(root, p) for p in (config_path, weights_path))
    if not os.path.isfile(config_path):
        raise AdapterError(f"{path!r} has no {CONFIG_FILE}")
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(directory, "adapter_model.bin")):
            raise AdapterError(f"{path!r} holds adapter_model.bin (pickle), which is never "
                               f"loaded: save the adapter as safetensors")
        raise AdapterError(f"{path!r} has no {WEIGHTS_FILE}")
    config = _read_config(config_path)
    rank, scaling = _check_config(config, max_lora_rank)
    shapes = _read_header(weights_path)
    modules = _match_modules(shapes, model, rank)
    try:
        digest = _digest(config_path, weights_path)
    except OSError as error:
        raise AdapterError(f"cannot read the adapter at {path!r}: {error}") from None
    return PeftAdapter(directory, rank, scaling, modules, digest)


def _read_config(config_path: str) -> dict:
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling), or AdapterError for what the engine does not serve."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported (only LORA)")
    unsupported = {
        "use_dora": "DoRA adapters", "modules_to_save": "modules_to_save",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out weights",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterError(f"{what} are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"adapter biases (bias={config['bias']!r}) are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter rank r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise AdapterError(f"adapter rank {rank} exceeds max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _read_header(weights_path: str) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) from the safetensors header; the header and the file size are
    checked by the safetensors library (a truncated file fails here)."""
    from safetensors import safe_open  # the header only: no tensor is read

    try:
        shapes = {}
        with safe_open(weights_path, framework="numpy") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                shapes[name] = (list(tensor.get_shape()), tensor.get_dtype())
    except Exception as e:  # the library raises its own error types for a bad file
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from None
    for name, (_, dtype) in shapes.items():
        if dtype not in _SAFETENSORS_DTYPES:
            raise AdapterError(f"tensor {name!r} has dtype {dtype}; expected one of "
                               f"{list(_SAFETENSORS_DTYPES)}")
    return shapes


def _match_modules(shapes: dict[str, tuple[list[int], str]], model: ModelConfig,
                   rank: int) -> tuple[AdapterModule, ...]:
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in shapes:
        match = _TENSOR_NAME.search(name)
        if match is None:
            raise AdapterError(f"tensor {name!r} is not a LoRA A/B weight of one of "
                               f"{', '.join(TARGET_MODULES)} (embeddings, the head and extra "
                               f"trained modules are not supported)")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= model.num_hidden_layers:
            raise AdapterError(f"tensor {name!r} is for layer {layer}; the model has "
                               f"{model.num_hidden_layers}")
        slot = pairs.setdefault((layer, module), {})
        if which in slot:
            raise AdapterError(f"two lora_{which} tensors for layer {layer} {module}")
        slot[which] = name
    if not pairs:
        raise AdapterError("the adapter holds no LoRA weights")
    modules = []
    for (layer, module), names in sorted(pairs.items()):
        if names.keys() != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module} has lora_A or lora_B but not both")
        in_features, out_features = module_shape(model, module)
        for which, expected in (("A", [rank, in_features]), ("B", [out_features, rank])):
            shape = shapes[names[which]][0]
            if shape != expected:
                raise AdapterError(f"{names[which]} has shape {shape}; the model's {module} with "
                                   f"rank {rank} needs {expected}")
        modules.append(AdapterModule(layer, module, names["A"], names["B"]))
    return tuple(modules)


def _digest(*paths: str) -> str:
    hasher = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                hasher.update(chunk)
    return hasher.hexdigest()
