"""The compiled CPU kernels (csrc/cpu_ops.cpp), built at install (setup.py), never at serve time.

`load()` returns the extension module, or None where it cannot be used (not built, built from
other sources, built for a CPU with instruction sets this one lacks): callers then keep their
plain-torch path, which is also the reference the kernels are tested against. Either way one log
line says which path serves and why. Rebuild after editing csrc/ with
`python setup.py build_ext --inplace` (or `pip install --no-build-isolation -e .`).

The AMX tiles (csrc/amx_tiles.h: the int8 matmul of 16+ rows and the bf16 flash prefill) are
the one choice made here, once per process, from the CPU: on where it has AMX-INT8 and AMX-BF16,
Linux grants the tile state and each tile kernel's check product agrees with its AVX-512 form;
`PAGEDSERVE_AMX=0` in the environment keeps them off. The start-up's kernels line says which.

Whether to use them is not decided here: DeviceConfig.cpu_kernels (set at the edge, from
--[no-]cpu-kernels or PAGEDSERVE_CPU_KERNELS) is read once by whoever builds the model, as a
KernelConfig in force while the model is built and loaded (`building_with`, as torch.device
scopes the device). Each layer takes its kernels (`for_new_layer()`, the module or None) at
construction and never looks again; the attention backend is chosen then too
(attention/__init__.py). Nothing reads the environment per call.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType

from pagedserve.kernels import extension_build
from pagedserve.observability.startup import startup_phase

logger = logging.getLogger(__name__)

REBUILD_HINT = ("build them with `pip install --no-build-isolation .` once torch is installed (in "
                "a checkout: `python setup.py build_ext --inplace`)")


@dataclass(frozen=True)
class KernelConfig:
    """Which compiled paths a model being built uses (from DeviceConfig; see the module doc)."""

    cpu_kernels: bool = True
    """The compiled CPU kernels where they apply; False: the plain torch path everywhere."""
    fused_decoder_layers: bool = True
    """Small steps through the compiled DecoderStack (models/decoder_stack.py); needs
    cpu_kernels."""
    gpu_kernels: bool = True
    """On cuda, the Triton kernels where they apply (attention); False: torch's ops (the
    reference the kernels are tested against)."""
    activation_quantization: str = "auto"
    """How GGUF-coded matmuls on the compiled kernels meet their activations
    (layers/quantized.py ACTIVATION_QUANTIZATION_MODES): "auto", "none" (exact), "int16", "int8"."""


_building_with: ContextVar[KernelConfig] = ContextVar("kernel_config", default=KernelConfig())


@contextmanager
def building_with(config: KernelConfig) -> Iterator[None]:
    """Build and load models under `config` (default outside any scope: KernelConfig())."""
    token = _building_with.set(config)
    try:
        yield
    finally:
        _building_with.reset(token)


def build_config() -> KernelConfig:
    """The KernelConfig in force for a model being built now."""
    return _building_with.get()


def for_new_layer() -> ModuleType | None:
    """The kernels a layer being built should hold: None when the build's KernelConfig turns
    them off or they cannot be had."""
    return load() if _building_with.get().cpu_kernels else None


def serves(x) -> bool:
    """Whether the kernels take `x`: a CPU tensor in fp32 or bf16."""
    import torch

    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def refusal(module: ModuleType, expected_hash: str, cpu_flags: set[str]) -> str | None:
    """Why `module` must not serve (None: it may): built from sources other than the shipped
    ones, or for instruction sets this CPU lacks (running it would crash the process)."""
    built_hash = getattr(module, "SOURCE_HASH", "unknown")
    if built_hash != expected_hash:
        return (f"the built module ({module.__file__}) was compiled from other sources "
                f"(hash {built_hash}, csrc/ now {expected_hash})")
    missing = set(getattr(module, "BUILD_ISA", "").split()) - cpu_flags
    if missing:
        return f"the built module needs CPU instruction sets this CPU lacks: {sorted(missing)}"
    return None


@functools.cache
def load() -> ModuleType | None:
    """The kernels module, or None; logs once (the start-up's kernels phase) which path serves
    and why."""
    with startup_phase("kernels") as phase:
        importlib.import_module("torch")  # first: the extension links against libtorch
        try:
            module = importlib.import_module(extension_build.EXTENSION_NAME)
        except ImportError as error:
            module, reason = None, f"the C++ CPU kernels are not built ({error})"
        else:
            try:
                expected_hash = extension_build.source_hash()
            except OSError as error:  # a package shipped without csrc/: nothing to check against
                expected_hash = f"unreadable ({error})"
            reason = refusal(module, expected_hash, extension_build.cpu_flags())
            if reason is not None:
                module, reason = None, f"refused: {reason}"
        if module is None:
            phase.level = logging.WARNING
            phase.detail = f"plain torch path: {reason}; {REBUILD_HINT}"
        else:
            phase.detail = (f"C++ CPU kernels ({getattr(module, 'BUILD_ISA', '') or 'no AVX-512'}) "
                            f"from {module.__file__}; {choose_tiles(module)}")
    return module


def choose_tiles(module: ModuleType) -> str:
    """Turns the AMX tiles on where they can run (see the module doc); says which."""
    if os.environ.get("PAGEDSERVE_AMX", "1") == "0":
        module.set_tiles("off")
        return "AMX tiles off (PAGEDSERVE_AMX=0)"
    reason = module.set_tiles("amx")
    return ("AMX tiles for int8 matmuls of 16+ rows and the bf16 flash prefill" if not reason
            else f"no AMX tiles: {reason}")
