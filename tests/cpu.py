"""Markers for tests whose bounds hold only on some CPUs (the CPU differs between machines)."""

import pytest

from pagedserve.engine.arg_utils import resolve_dtype

NATIVE_BF16 = pytest.mark.skipif(
    resolve_dtype("auto", "cpu") != "bfloat16",
    reason="a bf16 tolerance calibrated where the CPU multiplies bf16 natively (AVX512-BF16 or "
           "AMX); this CPU emulates bf16 (AVX2 only), so greedy tokens part earlier at near-ties")


def _integer_kernels_vectorized() -> bool:
    from pagedserve.kernels import cpu_ops

    ops = cpu_ops.load()
    return ops is not None and ops.integer_linear_vectorized()


# bf16 on the GGUF codes runs wherever the build has a vectorized integer matmul (AVX2 or
# AVX-512 VNNI), whatever the CPU's default dtype: on a Zen 3 (AVX2, fp32 by default) the bf16
# model-quality tests took 8-69 s each and held their bounds.
VECTORIZED_INTEGER_MATMUL = pytest.mark.skipif(
    not _integer_kernels_vectorized(),
    reason="the compiled kernels are missing or have no vectorized integer matmul in this build "
           "(no AVX2): the quantized matmuls would run their portable loops, minutes per test")
