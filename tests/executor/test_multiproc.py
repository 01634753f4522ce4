"""The multi-process executor: tensor and pipeline parallel ranks as worker processes, driven
over sockets, must give exactly the greedy tokens of the single-process engine (fp32).

Tiny random Llama/Qwen2 directories (8 query heads, 4 KV heads: TP 2 and 4 split them) and the
default SmolLM2 (9 and 3 heads: TP 3). Every engine is checked idle on every rank, then shut
down, and its worker processes must be gone.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from pagedserve.engine.llm import LLM
from pagedserve.executor import ExecutorError
from pagedserve.sampling_params import SamplingParams
from tests.cpu import NATIVE_BF16
from tests.shared_engines import SUITE_ACTIVATION_QUANTIZATION

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 300, 42], list(range(100, 190)), [7] * 3, list(range(20, 60, 2)),
           [11, 12, 13], list(range(300, 340)), [400, 3, 99, 250, 17], [1] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def make_tiny_dir(tmp_path_factory, tokenizer):
    """architecture -> a tiny random HF directory of it, written once per module."""
    paths: dict[str, str] = {}

    def make(architecture: str) -> str:
        if architecture not in paths:
            torch.manual_seed(0)
            common = dict(vocab_size=510, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=256,
                          initializer_range=0.3)  # logits far apart: greedy has no near-ties
            config = (
                transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
                if architecture == "llama"
                else transformers.Qwen2Config(**common, tie_word_embeddings=False))
            path = tmp_path_factory.mktemp(architecture)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.save_pretrained(path, safe_serialization=True)
            tokenizer._tokenizer.save(str(path / "tokenizer.json"))
            paths[architecture] = str(path)
        return paths[architecture]

    return make


@pytest.fixture(params=["llama", "qwen2"])
def tiny_dir(request, make_tiny_dir) -> str:
    """Each architecture in turn: what the model computes is under test."""
    return make_tiny_dir(request.param)


@pytest.fixture
def llama_dir(make_tiny_dir) -> str:
    """One architecture: the control path and its errors do not depend on the model."""
    return make_tiny_dir("llama")


def generate(model: str, prompts=PROMPTS, params=GREEDY, **engine_args) -> tuple[list, LLM]:
    engine_args.setdefault("dtype", "float32")
    # TP adds its ranks' partial sums in another order: see SUITE_ACTIVATION_QUANTIZATION
    engine_args.setdefault("activation_quantization", SUITE_ACTIVATION_QUANTIZATION)
    engine_args.setdefault("kv_cache_memory", "32MiB")
    llm = LLM(model=model, max_num_batched_tokens=64, max_num_seqs=8, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.assert_idle()
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outputs], llm


def assert_workers_gone(llm: LLM) -> None:
    for process in getattr(llm.engine.executor, "processes", []):
        assert process.poll() is not None, f"worker pid {process.pid} still running"


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_parallel_greedy_equals_one_process(tiny_dir, tp, pp):
    expected, _ = generate(tiny_dir)
    tokens, llm = generate(tiny_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert tokens == expected
    assert_workers_gone(llm)
    if pp > 1:  # the stages overlapped: a second micro-batch went in before the first came back
        assert llm.engine.max_batches_in_flight > 1


def test_pipeline_keeps_chunked_prefill_and_preemption_exact(tiny_dir):
    """A tight KV pool and budget: prompts are chunked across micro-batches and requests are
    preempted while others are in flight; the tokens are still the single process's."""
    prompts = [list(range(10 + i, 110 + i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    small = dict(num_gpu_blocks_override=24, block_size=16)
    expected, reference = generate(tiny_dir, prompts, params, **small)
    tokens, llm = generate(tiny_dir, prompts, params, pipeline_parallel_size=2, **small)
    assert llm.engine.get_stats().num_preemptions > 0
    assert llm.engine.max_batches_in_flight > 1
    assert tokens == expected


def test_smollm2_tp3_and_pp2_equal_one_process(model_path):
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2100)), [9, 8, 7, 6]]
    expected, _ = generate(model_path, prompts, kv_cache_memory="64MiB")
    for sizes in ({"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}):
        tokens, llm = generate(model_path, prompts, kv_cache_memory="64MiB", **sizes)
        assert tokens == expected, sizes
        assert_workers_gone(llm)


@NATIVE_BF16
def test_packed_gguf_bf16_tp3_equals_its_one_process_run(model_path):
    """bf16 with the GGUF codes kept packed (the default on the CPU): each rank multiplies by its
    shard of the codes. Partial sums are added by the all-reduce in another order than one
    matmul adds them, so tokens may part after a near-tie: compare until the first difference,
    then require each side's token to be within the other's top 5."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2060))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False,
                            logprobs=5)
    common = dict(dtype="bfloat16", kv_cache_memory="64MiB")
    llm_one = LLM(model=model_path, **common)
    llm_tp = LLM(model=model_path, tensor_parallel_size=3, **common)
    try:
        one = llm_one.generate([{"prompt_token_ids": p} for p in prompts], params)
        tp = llm_tp.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm_tp.engine.assert_idle()
    finally:
        llm_tp.engine.shutdown()
    for a, b in zip(one, tp):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids[:4] == b.token_ids[:4]
        for i, (token_a, token_b) in enumerate(zip(a.token_ids, b.token_ids)):
            if token_a != token_b:
                assert token_a in b.logprobs[i] and token_b in a.logprobs[i]
                break


def test_qwen_0_5b_tp2_equals_one_process():
    from pagedserve.models.loader import resolve_model_path

    try:
        path = resolve_model_path("qwen2.5-coder-0.5b")
    except (ValueError, FileNotFoundError) as error:
        pytest.skip(f"the Qwen 0.5B packages are not installed: {error}")
    prompts = [[151644, 8948, 198, 2610, 525], list(range(1000, 1040))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    expected, _ = generate(path, prompts, params, kv_cache_memory="64MiB")
    tokens, _ = generate(path, prompts, params, kv_cache_memory="64MiB", tensor_parallel_size=2)
    assert tokens == expected


WORKER_PICKLE_GUARD = """
import pickle, sys

def _guard(original):
    def guarded(*args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                return original(*args, **kwargs)  # a module's import-time constant
            frame = frame.f_back
        raise AssertionError("pickle used in a worker")
    return guarded

for _name in ("dumps", "loads", "dump", "load"):
    setattr(pickle, _name, _guard(getattr(pickle, _name)))
"""


def test_no_pickle_on_the_control_path(llama_dir, tmp_path, monkeypatch):
    """pickle.dumps / loads raise in the engine process during steps, and in every worker
    process outside imports (a sitecustomize on the workers' PYTHONPATH; jinja2 pickles a
    constant when it is imported)."""
    (tmp_path / "sitecustomize.py").write_text(WORKER_PICKLE_GUARD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    llm = LLM(model=llama_dir, dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=2)
    try:
        def refuse(*args, **kwargs):
            raise AssertionError("pickle used in the engine")

        with monkeypatch.context() as patch:
            for name in ("dumps", "loads", "dump", "load"):
                patch.setattr(pickle, name, refuse)
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], GREEDY)
            llm.engine.assert_idle()
    finally:
        llm.engine.shutdown()
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)


def test_heads_that_do_not_split_are_refused_at_startup(model_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide .*\[1, 3\]"):
        LLM(model=model_path, tensor_parallel_size=2)


def test_a_worker_that_cannot_start_gives_one_clear_error(llama_dir):
    with pytest.raises(ExecutorError, match=r"worker rank \d failed: .*") as failure:
        LLM(model=llama_dir, device="cuda:7", dtype="float32", tensor_parallel_size=2)
    assert "\n" not in str(failure.value)


def test_a_rendezvous_port_in_use_gives_one_clear_error(llama_dir):
    import socket

    def next_port_free(port: int) -> bool:
        try:
            with socket.create_server(("127.0.0.1", port + 1)):
                return True
        except OSError:
            return False

    # A taken port whose next one (the control port) is free, so that only the rendezvous
    # collides: ports the OS hands out may have a busy neighbour (the suite's other servers),
    # so ask until one has none.
    for _ in range(100):
        taken = socket.create_server(("127.0.0.1", 0))
        if next_port_free(taken.getsockname()[1]):
            break
        taken.close()
    with taken:
        port = taken.getsockname()[1]
        with pytest.raises(ExecutorError, match=r"worker rank 0 failed: ") as failure:
            LLM(model=llama_dir, dtype="float32", tensor_parallel_size=2, master_port=port)
    assert "\n" not in str(failure.value)
