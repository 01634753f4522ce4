"""The compiled CPU kernels (csrc/cpu_ops.cpp), built on first use and cached across processes.

`load()` returns the extension module, or None where it cannot be had (no compiler, a build
error): callers then keep their plain-torch path, which is also the reference the kernels are
tested against. The build takes about 30 s once; torch caches it under $TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions), keyed by the source's content.

Whether to use them is not decided here: DeviceConfig.cpu_kernels (set at the edge, from
--[no-]cpu-kernels or PAGEDSERVE_CPU_KERNELS) is read once by whoever builds the model, as a
KernelConfig in force while the model is built and loaded (`building_with`, as torch.device
scopes the device). Each layer takes its kernels (`for_new_layer()`, the module or None) at
construction and never looks again; the attention backend is chosen then too
(attention/__init__.py). Nothing reads the environment per call.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_ops.cpp"
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-DNDEBUG"]
    cpu = _cpu_flags()
    if all(flag in cpu for flag in _AVX512_FLAGS):
        # Named instruction sets, not -march=native: the cache may be shared by other CPUs.
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        if "avx512_vnni" in cpu:
            flags.append("-mavx512vnni")
        if "avx512_bf16" in cpu:
            flags.append("-mavx512bf16")
    return flags


@dataclass(frozen=True)
class KernelConfig:
    """Which compiled paths a model being built uses (from DeviceConfig; see the module doc)."""

    cpu_kernels: bool = True
    """The compiled CPU kernels where they apply; False: the plain torch path everywhere."""
    fused_decoder_layers: bool = True
    """Small steps through the compiled DecoderStack (models/decoder_stack.py); needs
    cpu_kernels."""


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


STALE_LOCK_S = 600.0
"""A build lock older than this was left by a process killed mid-build (a build takes ~1 min)."""


def _remove_stale_lock(build_directory: Path) -> None:
    """torch serializes loads across processes with a lock file it removes when done; a process
    killed while holding it (SIGKILL, or a worker stopped during start-up) leaves it behind, and
    every later load would wait for it forever."""
    lock = build_directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


@functools.cache
def load() -> ModuleType | None:
    """The kernels module, or None (logged once) when they fail to build."""
    try:
        from torch.utils import cpp_extension

        flags = _compile_flags()
        # The instruction sets are part of the name: a build for another CPU is not reused.
        name = "pagedserve_cpu_ops_" + "_".join(
            flag.removeprefix("-m") for flag in flags if flag.startswith("-mavx512")
        ) if "-mavx512f" in flags else "pagedserve_cpu_ops_generic"
        _remove_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
        return cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("CPU kernels unavailable, using the plain torch path: %s", exc)
        return None
