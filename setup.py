"""Builds the C++ CPU kernels (pagedserve/csrc) at install, against the torch already installed.

    pip install --no-build-isolation -e .      # what scripts/bootstrap.sh runs (torch first)
    python setup.py build_ext --inplace        # rebuild after editing csrc/ (developers)

Serving never compiles: pagedserve/kernels/cpu_ops.py loads the module built here and refuses one
whose sources' hash or instruction sets do not match. The kernels are optional: with no compiler,
or no torch in the build environment (pip's default build isolation), the install still succeeds
and serving uses the plain torch path, saying so once at start-up.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _load_extension_build():
    # By path: importing the pagedserve package would need its dependencies at build time.
    path = ROOT / "pagedserve" / "kernels" / "extension_build.py"
    spec = importlib.util.spec_from_file_location("_pagedserve_extension_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warn(message: str) -> None:
    print(f"\n*** pagedserve: {message}\n", file=sys.stderr)


def _kernel_build_options() -> dict:
    """ext_modules and cmdclass for the kernels, or none when torch is not importable here."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _warn("torch is not importable in this build environment, so the C++ CPU kernels are "
              "not built (serving uses the slower torch path). Install torch==2.13.0 first, "
              "then: pip install --no-build-isolation .")
        return {}
    build = _load_extension_build()
    compile_flags = build.compile_flags(build.cpu_flags())
    extension = CppExtension(
        build.EXTENSION_NAME,
        [str(path.relative_to(ROOT)) for path in build.source_files(ROOT / "pagedserve" / "csrc")],
        # -g0: Python's own CFLAGS ask for debug info, which slows the build and bloats the module.
        extra_compile_args=compile_flags + ["-g0", "-DPAGEDSERVE_SOURCE_HASH="
                                            + build.source_hash(ROOT / "pagedserve" / "csrc")],
        extra_link_args=["-fopenmp"],
    )

    class OptionalBuildExtension(BuildExtension):
        """A failed kernel build (no compiler, a compile error) leaves the install working."""

        def build_extensions(self) -> None:
            try:
                super().build_extensions()
            except Exception as error:  # torch raises RuntimeError, setuptools its own errors
                _warn(f"the C++ CPU kernels failed to build ({type(error).__name__}: {error}); "
                      "serving uses the slower torch path. Rebuild them with: "
                      "pip install --no-build-isolation . (in a checkout: "
                      "python setup.py build_ext --inplace)")

    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_kernel_build_options())
