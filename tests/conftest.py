"""Shared fixtures: the real default model loaded once per session, and engines built over it.

Every engine made through `make_llm` is checked on teardown: all KV blocks free, all queues empty.
"""

from __future__ import annotations

import os

import pytest

from pagedserve.distributed.cpu_binding import bind_to_cpus, cpu_share, usable_cpus
from tests.processes import xdist_worker
from tests.shared_engines import shared_weights_llm

# Engine imports live inside the fixtures: tests/core must run without importing torch.

if not any(os.path.exists(f"/dev/{device}") for device in ("nvidia0", "nvidiactl")):
    # No GPU here: the Triton kernels' tests run them under the interpreter
    # (tests/triton_interpreter.py), which must be on before anything imports triton. A library
    # that imports it first (peft does) leaves triton.language's own @triton.jit helpers
    # compiled, and an interpreted kernel calling them fails ("Cannot call @triton.jit'd outside
    # of the scope of a kernel") in whichever test process ran that library's tests first.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (scripts/test.sh runs a worker per usable CPU) each worker takes its
    own share of the CPUs before torch is imported. Its torch threads, and the servers and ranks
    it starts (they inherit the affinity and size their thread pools by it), then leave the other
    workers' cores alone: OpenMP threads that share a core wait on each other's time slices."""
    worker = xdist_worker()
    if worker is None:
        return
    cpus = cpu_share(usable_cpus(), *worker)
    bind_to_cpus(cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))


_pin_xdist_worker()


@pytest.fixture(scope="session")
def model_path() -> str:
    from pagedserve.models.loader import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_default_model(model_path):
    """transformers' fp32 model of the default GGUF (the same dequantized weights), loaded once
    per session: read-only (a test that changes it, e.g. with PEFT, works on a deep copy)."""
    import os

    import torch

    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from pagedserve.tokenizer import Tokenizer

    return Tokenizer.from_path(model_path)


@pytest.fixture
def make_llm(model_path, tokenizer):
    """Factory: make_llm(**engine_args) -> LLM over the session's shared weights (fp32 default)."""
    engines = []

    def factory(**overrides):
        llm = shared_weights_llm(model_path, tokenizer, **overrides)
        engines.append(llm.engine)
        return llm

    yield factory
    for engine in engines:
        engine.assert_idle()
        engine.shutdown()
