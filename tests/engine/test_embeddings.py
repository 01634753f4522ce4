"""Pooling (embedding) requests in the engine: LLM.embed against a plain transformers forward of
the same tiny random Llama, chunked prefill and prefix-cache hits on vs off, and generation
beside embeddings unchanged. fp32; every engine is checked idle (all KV blocks free) afterwards.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pagedserve.engine.llm import LLM
from pagedserve.executor.serialization import decode, encode
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from tests.engine.tiny_models import checked_llms, write_tiny_llama

transformers = pytest.importorskip("transformers")

HIDDEN_SIZE = 64
PROMPTS = [[5, 17, 300, 42], list(range(100, 190)), [7] * 3, list(range(20, 60, 2))]
LONG_PROMPT = [(i * 37) % 500 + 3 for i in range(150)]
TOLERANCE = 1e-5
"""fp32 on both sides; the engine's attention and matmuls sum in another order than HF's."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-embed"), tokenizer, seed=3,
                            hidden_size=HIDDEN_SIZE)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32).eval()


@pytest.fixture
def make_tiny(tiny_dir):
    """Factory: make_tiny(**engine_args) -> LLM over the tiny model, checked idle on teardown."""
    with checked_llms(tiny_dir) as factory:
        yield factory


def reference_embedding(hf_model, token_ids: list[int], params: PoolingParams) -> torch.Tensor:
    """The slow reference: HF's final (normed) hidden states, pooled, truncated, normalized."""
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0]  # (T, H)
    vector = hidden.mean(dim=0) if params.pooling_type == "mean" else hidden[-1]
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    return torch.nn.functional.normalize(vector, dim=-1)


def embed(llm: LLM, prompts: list[list[int]], params: PoolingParams) -> list[torch.Tensor]:
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], params)
    assert all(o.finished and o.outputs is not None for o in outputs)
    return [torch.tensor(o.outputs.embedding) for o in outputs]


@pytest.mark.parametrize("params", [PoolingParams("last"), PoolingParams("mean"),
                                    PoolingParams("mean", dimensions=16)],
                         ids=["last", "mean", "mean-dims16"])
def test_embed_equals_pooled_transformers_hidden_states(make_tiny, hf_model, params):
    vectors = embed(make_tiny(), PROMPTS, params)
    for prompt, vector in zip(PROMPTS, vectors):
        assert vector.shape == (params.dimensions or HIDDEN_SIZE,)
        assert vector.norm().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(vector, reference_embedding(hf_model, prompt, params),
                                   atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_chunked_prefill_gives_the_unchunked_embedding(make_tiny, pooling_type):
    params = PoolingParams(pooling_type)
    whole = make_tiny(max_num_batched_tokens=256, enable_prefix_caching=False)
    chunked = make_tiny(max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    [expected] = embed(whole, [LONG_PROMPT], params)
    num_steps_before = chunked.engine.scheduler.step_index
    [vector] = embed(chunked, [LONG_PROMPT], params)
    # The feature acted: 150 tokens at 16 a step take 10 steps (the unchunked engine took 1).
    assert chunked.engine.scheduler.step_index - num_steps_before >= math.ceil(150 / 16)
    torch.testing.assert_close(vector, expected, atol=TOLERANCE, rtol=0)


def test_prefix_cache_hits_serve_last_pooling_and_never_mean_pooling(make_tiny):
    """Last pooling reuses a cached prefix (the last token is always computed); mean pooling
    needs every position's hidden state, so it computes the whole prompt every time. Both give
    the embedding of a cold cache."""
    llm = make_tiny(max_num_batched_tokens=256)
    prompt = {"prompt_token_ids": LONG_PROMPT}
    for pooling_type in ("last", "mean"):
        params = PoolingParams(pooling_type)
        cold = llm.embed(prompt, params)[0]
        warm = llm.embed(prompt, params)[0]
        if pooling_type == "last":
            assert warm.num_cached_tokens >= 128  # the full blocks of the first run
        else:
            assert warm.num_cached_tokens == 0
        torch.testing.assert_close(torch.tensor(warm.outputs.embedding),
                                   torch.tensor(cold.outputs.embedding), atol=TOLERANCE, rtol=0)
        llm.reset_prefix_cache()


def test_generation_beside_embeddings_is_unchanged(make_tiny):
    """Greedy tokens of a request batched with chunked embeddings equal its tokens alone, and the
    embeddings equal theirs alone."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    llm = make_tiny(max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=False)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy)[0]
    embeddings_alone = embed(llm, [LONG_PROMPT, PROMPTS[1]], PoolingParams("mean"))

    engine = llm.engine
    engine.add_request("gen", {"prompt_token_ids": PROMPTS[0]}, greedy)
    for index, prompt in enumerate([LONG_PROMPT, PROMPTS[1]]):
        engine.add_request(f"embed-{index}", {"prompt_token_ids": prompt}, PoolingParams("mean"))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_integrity()
    assert finished["gen"].outputs[0].token_ids == alone.outputs[0].token_ids
    for index, expected in enumerate(embeddings_alone):
        torch.testing.assert_close(torch.tensor(finished[f"embed-{index}"].outputs.embedding),
                                   expected, atol=TOLERANCE, rtol=0)


def test_pipeline_stages_give_the_one_process_embedding(make_tiny):
    """Two stages in worker processes (PoolingParams and vectors cross as msgpack; the last
    stage pools), with chunks of one prompt in flight in both stages at once."""
    single = make_tiny(max_num_batched_tokens=16, max_num_seqs=4)
    staged = make_tiny(max_num_batched_tokens=16, max_num_seqs=4, pipeline_parallel_size=2)
    prompts = [LONG_PROMPT, PROMPTS[0]]
    for pooling_type in ("last", "mean"):
        expected = embed(single, prompts, PoolingParams(pooling_type))
        vectors = embed(staged, prompts, PoolingParams(pooling_type, dimensions=48))
        for vector, full in zip(vectors, expected):
            torch.testing.assert_close(
                vector, torch.nn.functional.normalize(full[:48], dim=-1), atol=TOLERANCE, rtol=0)
    assert staged.engine.max_batches_in_flight == 2  # the feature acted: both stages were busy


def test_a_prompt_may_fill_the_context_and_bad_requests_are_refused(make_tiny):
    llm = make_tiny(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8)
    # Nothing is generated, so a pooling prompt may be as long as the context.
    assert len(llm.embed({"prompt_token_ids": list(range(3, 67))})[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="context length is 64"):
        llm.embed({"prompt_token_ids": list(range(3, 68))})
    with pytest.raises(ValueError, match="embedding size 64"):
        llm.embed({"prompt_token_ids": [5, 6]}, PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="must not be empty"):
        llm.embed({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("cls")
    with pytest.raises(ValueError, match="dimensions must be >= 1"):
        PoolingParams(dimensions=0)


def test_a_lora_adapter_applies_to_embeddings(make_tiny, hf_model, tmp_path):
    """An adapter named by the request changes the vector, to PEFT's pooled hidden states."""
    peft = pytest.importorskip("peft")
    from pagedserve.lora import LoRARequest
    from tests.lora.helpers import make_adapter

    adapter_path = make_adapter(hf_model, tmp_path / "adapter", 8,
                                ["q_proj", "v_proj", "down_proj"], seed=1)
    llm = make_tiny(enable_lora=True, max_loras=1, max_lora_rank=8)
    params = PoolingParams("mean")
    base = embed(llm, PROMPTS[:2], params)
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS[:2]], params,
                        lora_request=LoRARequest("a", 1, adapter_path))
    # A copy: PEFT wraps and merges into the model it is given (the fixture is shared).
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model),
                                                adapter_path).merge_and_unload()
    for prompt, output, base_vector in zip(PROMPTS, outputs, base):
        vector = torch.tensor(output.outputs.embedding)
        assert not torch.allclose(vector, base_vector, atol=1e-3)  # the adapter acted
        torch.testing.assert_close(vector, reference_embedding(peft_model, prompt, params),
                                   atol=TOLERANCE, rtol=0)


def test_pooling_params_cross_the_wire():
    params = PoolingParams("mean", dimensions=32, normalize=False)
    assert decode(encode(params)) == params
