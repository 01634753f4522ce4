"""Markers for tests whose bounds hold only on some CPUs (the CPU differs between machines)."""

import pytest

from pagedserve.engine.arg_utils import resolve_dtype

NATIVE_BF16 = pytest.mark.skipif(
    resolve_dtype("auto", "cpu") != "bfloat16",
    reason="a bf16 tolerance calibrated where the CPU multiplies bf16 natively (AVX512-BF16 or "
           "AMX); this CPU emulates bf16 (AVX2 only), so greedy tokens part earlier at near-ties")
