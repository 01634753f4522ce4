"""allowed_token_ids and bad_words under n-gram speculative decoding on the real default model:
drafts were accepted, the masks held, and the output is the plain engine's token for token."""

from __future__ import annotations

from pagedserve.sampling_params import SamplingParams
from tests.e2e.test_spec_decode import SPEC, spec_stats

# Text that repeats, so n-gram drafts (copied from the prompt) are proposed and accepted.
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown",
           "one two three four five six seven, " * 3 + "one two three"]
BAD_WORDS = ["lazy", "five"]  # each in the text its prompt's greedy output repeats


def test_masks_with_ngram_equal_masks_without(make_llm, tokenizer):
    prompt_ids = [tokenizer.encode(text) for text in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=8, bad_words=[word],
                             allowed_token_ids=sorted(set(ids)))
              for word, ids in zip(BAD_WORDS, prompt_ids)]
    plain_llm = make_llm()
    free = plain_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    plain = plain_llm.generate(PROMPTS, params)
    spec_llm = make_llm(speculative_config=SPEC)
    spec = spec_llm.generate(PROMPTS, params)
    assert spec_stats(spec_llm).num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    for output, free_output, word, ids in zip(spec, free, BAD_WORDS, prompt_ids):
        assert word in free_output.outputs[0].text  # without the ban the word comes
        token_ids = output.outputs[0].token_ids
        assert set(token_ids) <= set(ids)
        for variant in (word, " " + word):
            banned = tokenizer.encode(variant, add_special_tokens=False)
            assert not any(token_ids[i:i + len(banned)] == banned
                           for i in range(len(token_ids)))
