"""LoRA on the real default model (SmolLM2-135M, GGUF): the engine against transformers + PEFT
on the same (dequantized) weights in fp32, then the engine in the CPU's compute dtype (bf16 where
the CPU multiplies bf16 natively: the kernels the server runs there) against the fp32 engine, both
with the same random adapter, and base requests beside adapted ones against a batch without
adapters. (Where the compute dtype is fp32 the packed path runs in fp32 too: that is the path such
a CPU serves, and emulated bf16 there took most of a minute.)"""

from __future__ import annotations

import copy

import pytest

from pagedserve.engine.arg_utils import resolve_dtype
from pagedserve.lora import LoRARequest
from pagedserve.sampling_params import SamplingParams
from tests.hf_reference import eos_ids, first_divergence, teacher_forced
from tests.lora.helpers import make_adapter
from tests.prompts import PARITY_PROMPTS

pytestmark = pytest.mark.slow
NUM_NEW_TOKENS = 16
TOP_N = 5
PROMPTS = PARITY_PROMPTS[:3]


@pytest.fixture(scope="module")
def peft_and_adapter(hf_default_model, tmp_path_factory):
    """(transformers + PEFT with a random adapter, the adapter's path): a copy of the session's
    model carries the adapter."""
    peft = pytest.importorskip("peft")
    path = make_adapter(hf_default_model, tmp_path_factory.mktemp("adapter"), 8,
                        ["q_proj", "v_proj", "o_proj", "down_proj"], seed=0, scale=0.5)
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_default_model), path).eval()
    return model, path


def _params():
    return SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS,
                          logprobs=TOP_N)


def _agree(ours, our_top, theirs, their_top) -> bool:
    """Equal, or where they first part, each side's token is in the other's top-N."""
    if ours == theirs:
        return True
    pos = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    assert theirs[pos] in our_top[pos] and ours[pos] in their_top[pos], pos
    return False


def test_real_model_lora_matches_peft_and_packed_path(make_llm, tokenizer, peft_and_adapter):
    peft_model, adapter_path = peft_and_adapter
    lora = LoRARequest("real", 1, adapter_path)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    fp32 = make_llm(enable_lora=True, max_lora_rank=8, activation_quantization="none")  # exact
    ours = fp32.generate(prompts, _params(), lora_request=lora)
    base = fp32.generate(prompts, _params())
    assert [o.outputs[0].token_ids for o in ours] != [o.outputs[0].token_ids for o in base]
    num_equal = 0
    for ids, output in zip(prompt_ids, ours):
        tokens = output.outputs[0].token_ids
        reference = teacher_forced(peft_model, ids, tokens, TOP_N, eos_ids(peft_model))
        our_top = [set(lp) for lp in output.outputs[0].logprobs]
        num_equal += first_divergence(tokens, our_top, reference) is None
    assert num_equal >= len(PROMPTS) - 1, f"only {num_equal} prompts equal transformers + PEFT"

    # No prefix caching: the plain batch below must compute exactly what the mixed one does.
    packed = make_llm(dtype=resolve_dtype("auto", "cpu"), enable_lora=True, max_lora_rank=8,
                      enable_prefix_caching=False)
    packed.add_lora(lora)  # loaded now, not with its first request: the same steps as below
    mixed = packed.generate(prompts * 2, _params(), lora_request=[lora] * 3 + [None] * 3)
    for reference, output in zip(ours, mixed[:3]):
        ref_top = [set(lp) for lp in reference.outputs[0].logprobs]
        out_top = [set(lp) for lp in output.outputs[0].logprobs]
        _agree(output.outputs[0].token_ids, out_top, reference.outputs[0].token_ids, ref_top)
    # The base requests beside adapted ones equal the same batch without any adapter (the same
    # batch shape: bf16 matmuls may round differently for another number of rows).
    plain = packed.generate(prompts * 2, _params())
    assert ([o.outputs[0].token_ids for o in mixed[3:]]
            == [o.outputs[0].token_ids for o in plain[3:]])
