"""The compiled CPU kernels (csrc/cpu_ops.cpp), built on first use and cached across processes.

`load()` returns the extension module, or None where it cannot be had (no compiler, a build
error, PAGEDSERVE_CPU_KERNELS=0): callers then keep their plain-torch path, which is also the
reference the kernels are tested against. The build takes about 30 s once; torch caches it
under $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), keyed by the source's content.
"""

from __future__ import annotations

import functools
import logging
import os
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


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0"


def for_tensor(x) -> ModuleType | None:
    """The kernels if they serve `x` (a CPU tensor in fp32 or bf16), else None."""
    import torch

    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return load()


@functools.cache
def load() -> ModuleType | None:
    """The kernels module, or None (logged once) when they are off or fail to build."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        flags = _compile_flags()
        # The instruction sets are part of the name: a build for another CPU is not reused.
        name = "pagedserve_cpu_ops_" + "_".join(
            flag.removeprefix("-m") for flag in flags if flag.startswith("-mavx512")
        ) if "-mavx512f" in flags else "pagedserve_cpu_ops_generic"
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
