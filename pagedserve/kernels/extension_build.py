"""What the compiled CPU kernels are built from and for: their sources' hash and the instruction
sets of the building CPU. Shared by setup.py (which builds them at install) and cpu_ops.py (which
refuses a build that does not match); standard library only, so setup.py can load it by path
before pagedserve or torch is importable.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

EXTENSION_NAME = "pagedserve.kernels._cpu_ops"
CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"

# (/proc/cpuinfo flag, compiler flag) of the instruction sets the kernels use where the building
# CPU has them: AVX2 with FMA and F16C (every x86-64 server CPU since 2013) turns the AVX2 paths
# on, and the four AVX-512 sets together the AVX-512 ones, with VNNI and BF16 where present.
_AVX2_BASE = (("avx2", "-mavx2"), ("fma", "-mfma"), ("f16c", "-mf16c"))
_AVX512_BASE = (("avx512f", "-mavx512f"), ("avx512bw", "-mavx512bw"), ("avx512vl", "-mavx512vl"),
                ("avx512dq", "-mavx512dq"))
_AVX512_EXTRAS = (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16"))


def source_files(csrc_dir: Path = CSRC_DIR) -> list[Path]:
    """The C++ sources the extension compiles (headers come in through them)."""
    return sorted(csrc_dir.glob("*.cpp"))


def source_hash(csrc_dir: Path = CSRC_DIR) -> str:
    """A digest of every file in csrc/ (sources and headers), by name and content."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc_dir.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags(flags: set[str]) -> list[str]:
    """Compiler flags for a CPU with `flags`: named instruction sets, never -march=native, so the
    module says exactly what it needs (the loader checks the running CPU has each)."""
    compile = ["-O3", "-fopenmp", "-DNDEBUG"]
    if not all(cpu in flags for cpu, _ in _AVX2_BASE):
        return compile
    compile += [flag for cpu, flag in _AVX2_BASE]
    if all(cpu in flags for cpu, _ in _AVX512_BASE):
        compile += [flag for cpu, flag in _AVX512_BASE]
        compile += [flag for cpu, flag in _AVX512_EXTRAS if cpu in flags]
    return compile


def required_cpu_flags(compile: list[str]) -> set[str]:
    """The /proc/cpuinfo flags a build made with `compile` needs to run."""
    return {cpu for cpu, flag in _AVX2_BASE + _AVX512_BASE + _AVX512_EXTRAS if flag in compile}
