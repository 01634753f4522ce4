"""Markers for tests whose bounds hold only on some CPUs (the CPU differs between machines)."""

import pytest

from pagedserve.engine.arg_utils import resolve_dtype

NATIVE_BF16 = pytest.mark.skipif(
    resolve_dtype("auto", "cpu") != "bfloat16",
    reason="a bf16 tolerance calibrated where the CPU multiplies bf16 natively (AVX512-BF16 or "
           "AMX); this CPU emulates bf16 (AVX2 only), so greedy tokens part earlier at near-ties")

BF16_IS_THE_DEFAULT = pytest.mark.skipif(
    resolve_dtype("auto", "cpu") != "bfloat16",
    reason="bf16 is not this CPU's compute dtype (no AVX512-BF16 or AMX: --dtype auto is fp32 "
           "here) and its quantized matmuls run their portable loops, minutes per test; the bf16 "
           "model-quality tests run on the CPUs that serve bf16")
