"""LoRA on the real default model (SmolLM2-135M, GGUF): the engine against transformers + PEFT
on the same (dequantized) weights in fp32, then the bf16 engine on its packed int4 weights (the
kernels the server runs) against the fp32 engine, both with the same random adapter."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.lora import LoRARequest
from pagedserve.sampling_params import SamplingParams
from tests.lora.helpers import make_adapter
from tests.prompts import PARITY_PROMPTS

pytestmark = pytest.mark.slow
NUM_NEW_TOKENS = 16
TOP_N = 5
PROMPTS = PARITY_PROMPTS[:3]


@pytest.fixture(scope="module")
def hf_and_adapter(model_path, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
        dtype=torch.float32).eval()
    path = make_adapter(hf_model, tmp_path_factory.mktemp("adapter"), 8,
                        ["q_proj", "v_proj", "o_proj", "down_proj"], seed=0, scale=0.5)
    return hf_model, path


def _peft_greedy(hf_model, adapter_path, prompt_ids):
    import copy

    import peft

    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), adapter_path).eval()
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
                             max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [set(step[0].topk(TOP_N).indices.tolist()) for step in out.logits]


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


def test_real_model_lora_matches_peft_and_packed_path(make_llm, tokenizer, hf_and_adapter):
    hf_model, adapter_path = hf_and_adapter
    lora = LoRARequest("real", 1, adapter_path)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    fp32 = make_llm(enable_lora=True, max_lora_rank=8)
    ours = fp32.generate(prompts, _params(), lora_request=lora)
    base = fp32.generate(prompts, _params())
    assert [o.outputs[0].token_ids for o in ours] != [o.outputs[0].token_ids for o in base]
    num_equal = 0
    for ids, output in zip(prompt_ids, ours):
        theirs, their_top = _peft_greedy(hf_model, adapter_path, ids)
        our_top = [set(lp) for lp in output.outputs[0].logprobs]
        num_equal += _agree(output.outputs[0].token_ids, our_top, theirs, their_top)
    assert num_equal >= len(PROMPTS) - 1, f"only {num_equal} prompts equal transformers + PEFT"

    # No prefix caching: the plain batch below must compute exactly what the mixed one does.
    packed = make_llm(dtype="bfloat16", enable_lora=True, max_lora_rank=8,
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
