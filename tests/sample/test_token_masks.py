"""allowed_token_ids and bad_words as logits masks: batched against the one-row reference, in
mixed batches, with the other processors, greedy and random, and under draft verification."""

import pytest
import torch

from pagedserve.sample import reference
from pagedserve.sample.rejection_sampler import RejectionSampler
from pagedserve.sample.sampler import Sampler, apply_logits_processors
from pagedserve.sampling_params import SamplingParams
from tests.sample.test_sampler import (
    EOS_TOKEN_IDS,
    VOCAB_SIZE,
    assert_rows_match_reference,
    build,
    random_logits,
)

NEG_INF = float("-inf")


def with_bad_words(sequences, **kwargs) -> SamplingParams:
    params = SamplingParams(bad_words=["x"] * len(sequences), **kwargs)
    params.bad_words_token_ids = sequences  # what tokenize_bad_words would fill in
    return params


def test_no_mask_without_either_field():
    assert build([SamplingParams(), SamplingParams(temperature=0)]).banned_token_mask is None


def test_allowed_token_ids_restrict_only_their_row():
    logits = random_logits(3)
    params = [SamplingParams(temperature=0, allowed_token_ids=[5, 7, 9]), SamplingParams(),
              SamplingParams(allowed_token_ids=[1])]
    processed = apply_logits_processors(logits, build(params))
    assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == [5, 7, 9]
    assert torch.equal(processed[1], logits[1])  # an unrestricted row is untouched
    assert torch.isfinite(processed[2]).nonzero().flatten().tolist() == [1]
    assert_rows_match_reference(logits, params, [[]] * 3, [[]] * 3)


def test_every_sampled_token_is_allowed_greedy_and_random():
    allowed = [3, 11, 17, 29]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=1),
              SamplingParams(temperature=1.0)]
    sampler = Sampler()
    seen_unrestricted = set()
    for seed in range(30):
        out = sampler(random_logits(3, seed=seed), build(params)).sampled_token_ids.tolist()
        assert out[0] in allowed and out[1] in allowed
        seen_unrestricted.add(out[2])
    assert seen_unrestricted - set(allowed), "the unrestricted row was restricted too"


def test_single_token_bad_word_is_always_banned():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 4] = 10.0  # greedy would pick 4
    params = [with_bad_words([[4]], temperature=0)]
    out = Sampler()(logits, build(params)).sampled_token_ids.tolist()
    assert out != [4]


def test_multi_token_bad_word_bans_last_token_only_after_its_prefix():
    logits = random_logits(4, seed=3)
    sequences = [[6, 8, 10], [12]]
    params = [with_bad_words(sequences) for _ in range(3)] + [SamplingParams()]
    output_ids = [[1, 6, 8],   # prefix matches: 10 banned (and 12)
                  [6, 8, 1],   # no match: only 12 banned
                  [8],         # shorter than the prefix: only 12 banned
                  [6, 8]]      # no bad words at all
    metadata = build(params, output_ids=output_ids)
    banned = metadata.banned_token_mask
    assert banned[0].nonzero().flatten().tolist() == [10, 12]
    assert banned[1].nonzero().flatten().tolist() == [12]
    assert banned[2].nonzero().flatten().tolist() == [12]
    assert not banned[3].any()
    assert_rows_match_reference(logits, params, output_ids, [[]] * 4)


@pytest.mark.parametrize("seed", range(3))
def test_masks_compose_with_bias_penalties_and_min_tokens(seed):
    logits = random_logits(4, seed=seed)
    allowed = list(range(0, VOCAB_SIZE, 3))
    params = [
        SamplingParams(allowed_token_ids=allowed, logit_bias={1: 100.0, 3: 5.0},
                       repetition_penalty=1.3, frequency_penalty=0.5, temperature=0),
        with_bad_words([[3], [6, 9]], min_tokens=4, presence_penalty=1.0, top_k=5),
        SamplingParams(allowed_token_ids=[2, 9], bad_words=["x"], min_tokens=3),
        SamplingParams(top_p=0.8),
    ]
    params[2].bad_words_token_ids = [[9]]
    output_ids = [[3, 3, 6], [6], [], [1, 2]]
    prompt_ids = [[0, 9], [], [4], []]
    assert_rows_match_reference(logits, params, output_ids, prompt_ids)
    processed = apply_logits_processors(logits, build(params, output_ids, prompt_ids))
    assert processed[0, 1] == NEG_INF, "a bias must not lift a token out of the allowed set"
    # row 2: 9 is a bad word and 2 is eos under min_tokens: nothing is left but -inf
    assert not torch.isfinite(processed[2]).any()


def test_tokenize_bad_words_tries_with_and_without_leading_space():
    vocab = {"hello": [1], " hello": [2], "big cat": [3, 4], " big cat": [5, 4]}
    params = SamplingParams(bad_words=[" hello", "big cat"])
    params.tokenize_bad_words(lambda text: vocab[text])
    assert params.bad_words_token_ids == [[1], [2], [3, 4], [5, 4]]


@pytest.mark.parametrize("bad", [[], [1, -1], ["1"], [True]])
def test_allowed_token_ids_are_validated(bad):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=bad)


def test_allowed_token_ids_outside_vocab_are_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(allowed_token_ids=[VOCAB_SIZE]).validate_for_vocab(VOCAB_SIZE)


@pytest.mark.parametrize("bad", [[""], ["  "], [1], "word"])
def test_bad_words_are_validated(bad):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_verification_never_emits_a_banned_token(temperature):
    """Spec decode: each position's row sees the drafts before it as output, so a bad word
    completed inside the drafts is rejected there."""
    vocab_size = VOCAB_SIZE
    drafts = [[6, 8, 10]]            # draft completes the bad word 6 8 10
    logits = torch.full((4, vocab_size), -5.0)
    for row, token_id in enumerate([6, 8, 10, 11]):
        logits[row, token_id] = 20.0  # the target agrees with every draft
    params = with_bad_words([[6, 8, 10]], temperature=temperature, seed=0)
    metadata = build([params] * 4, output_ids=[[], [6], [6, 8], [6, 8, 10]])
    generators = {0: torch.Generator().manual_seed(0)}
    emitted = RejectionSampler()(logits, metadata, drafts, generators)[0]
    assert emitted[:2] == [6, 8] and emitted[2] != 10
    row = reference.process_row(logits[2].tolist(), params, [6, 8], [], EOS_TOKEN_IDS)
    assert row.penalized_logits[10] == NEG_INF
