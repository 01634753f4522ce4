"""Multi-LoRA against transformers + PEFT (fp32, greedy), alone and mixed in one batch.

Three random adapters (ranks 8 and 16, different target modules) on a tiny Llama: each alone
must give PEFT's tokens, must change the base model's output, and a batch mixing all three with
the base must give every request what it gets alone (the base unchanged by its neighbours). A
second engine with max_loras=2 must hold the third adapter's requests back (the scheduler caps
the adapters per step) and still give the same tokens.
"""

from __future__ import annotations

import pytest

from pagedserve.lora import LoRARequest
from pagedserve.sampling_params import SamplingParams
from tests.lora.helpers import SEED_PROMPTS, make_adapter, peft_greedy, tiny_llama_dir

pytest.importorskip("peft")

NUM_NEW_TOKENS = 10
ADAPTERS = {  # name: (rank, targets)
    "qv8": (8, ["q_proj", "v_proj"]),
    "all16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp8": (8, ["o_proj", "gate_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lora")
    model_dir, hf_model = tiny_llama_dir(root / "base", tokenizer)
    adapters = {}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        adapters[name] = LoRARequest(name, seed + 1, make_adapter(hf_model, root / name, rank,
                                                                  targets, seed=seed))
    return model_dir, hf_model, adapters


def _llm(model_dir, **overrides):
    from pagedserve.engine.llm import LLM

    args = dict(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64,
                max_num_seqs=16, enable_lora=True, max_loras=4, max_lora_rank=16)
    args.update(overrides)
    return LLM(model=model_dir, **args)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS,
                          detokenize=False)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_matches_peft_and_changes_the_output(setup):
    model_dir, hf_model, adapters = setup
    llm = _llm(model_dir)
    prompts = [{"prompt_token_ids": p} for p in SEED_PROMPTS]
    base = _tokens(llm.generate(prompts, _params()))
    assert base == peft_greedy(hf_model, None, SEED_PROMPTS, NUM_NEW_TOKENS)
    for name, lora in adapters.items():
        ours = _tokens(llm.generate(prompts, _params(), lora_request=lora))
        expected = peft_greedy(hf_model, lora.lora_path, SEED_PROMPTS, NUM_NEW_TOKENS)
        assert ours == expected, name
        assert ours != base, f"adapter {name} did not change the output"
    llm.engine.assert_idle()
    llm.engine.shutdown()


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_equals_each_alone(setup, max_loras):
    model_dir, _, adapters = setup
    llm = _llm(model_dir, max_loras=max_loras)
    choices = [None, *adapters.values()]
    alone = {}
    for lora in choices:
        alone[lora] = _tokens(llm.generate([{"prompt_token_ids": p} for p in SEED_PROMPTS],
                                           _params(), lora_request=lora))
    # every prompt under every choice, interleaved, in one generate call (one batch)
    prompts, loras = [], []
    for i, prompt in enumerate(SEED_PROMPTS):
        for j in range(len(choices)):
            prompts.append({"prompt_token_ids": prompt})
            loras.append(choices[(i + j) % len(choices)])
    manager = llm.engine.executor.worker.model_runner.lora_manager
    slot_loads_before = manager.num_slot_loads
    mixed = _tokens(llm.generate(prompts, _params(), lora_request=loras))
    if max_loras < len(adapters):  # the scheduler held some adapters back: slots were swapped
        assert manager.num_slot_loads - slot_loads_before > 0
    for k, (lora, tokens) in enumerate(zip(loras, mixed)):
        assert tokens == alone[lora][k // len(choices)], (lora, k)
    llm.engine.assert_idle()
    llm.engine.shutdown()


def test_prefix_cache_is_per_adapter(setup):
    """One document under two adapters: no KV shared between them or with the base; under one
    adapter the second request hits."""
    model_dir, _, adapters = setup
    llm = _llm(model_dir, block_size=4)
    first, second = adapters["qv8"], adapters["all16"]
    document = {"prompt_token_ids": list(range(30, 130))}

    def cached(lora) -> int:
        return llm.generate([document], _params(), lora_request=lora)[0].num_cached_tokens

    assert cached(first) == 0
    assert cached(first) >= 96  # the same adapter: every full block of the prompt hits
    assert cached(second) == 0
    assert cached(None) == 0
    assert cached(second) >= 96
    llm.engine.assert_idle()
    llm.engine.shutdown()


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}])
def test_parallel_equals_one_process(setup, parallel):
    """Each TP rank adds its split of the factors (B rows of its columns, A columns of its
    rows); each pipeline stage adapts its own layers."""
    model_dir, _, adapters = setup
    prompts = [{"prompt_token_ids": p} for p in SEED_PROMPTS] * 2
    loras = [None, adapters["qv8"], adapters["all16"], adapters["mlp8"]] * 2
    expected = _tokens(_llm(model_dir).generate(prompts, _params(), lora_request=loras))
    llm = _llm(model_dir, cpu_binding="none", **parallel)
    try:
        assert _tokens(llm.generate(prompts, _params(), lora_request=loras)) == expected
        llm.engine.assert_idle()
    finally:
        llm.engine.shutdown()


def test_adapters_survive_sleep_level_2(setup):
    """Level 2 drops the weights and the adapter slots; after wake_up the adapters apply to the
    reloaded model and give the same tokens."""
    model_dir, _, adapters = setup
    llm = _llm(model_dir, enable_sleep_mode=True)
    prompts = [{"prompt_token_ids": p} for p in SEED_PROMPTS]
    loras = [adapters["qv8"], None, adapters["all16"], adapters["mlp8"]]
    before = _tokens(llm.generate(prompts, _params(), lora_request=loras))
    llm.engine.sleep(2)
    llm.engine.wake_up()
    assert _tokens(llm.generate(prompts, _params(), lora_request=loras)) == before
    llm.engine.assert_idle()
    llm.engine.shutdown()


def test_speculative_decoding_with_adapters_is_exact(setup):
    """n-gram drafts are verified under each request's adapter: greedy output equals the run
    without speculation, and some drafts are accepted."""
    model_dir, _, adapters = setup
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [9, 10, 11] * 8},
               {"prompt_token_ids": list(range(40, 60)) * 2}]
    loras = [adapters["qv8"], None, adapters["all16"]]
    # long enough for the tiny random model to fall into loops, which n-gram drafts then hit
    params = SamplingParams(temperature=0, max_tokens=80, min_tokens=80, detokenize=False)
    expected = _tokens(_llm(model_dir).generate(prompts, params, lora_request=loras))
    llm = _llm(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert _tokens(llm.generate(prompts, params, lora_request=loras)) == expected
    assert llm.engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    llm.engine.assert_idle()
    llm.engine.shutdown()
