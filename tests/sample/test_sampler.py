"""The batch sampler against its one-row reference, hand-computed examples and statistics."""

import math
import random

import pytest
import torch

from pagedserve.sample import reference
from pagedserve.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_logits_processors,
    apply_sampling_transforms,
)
from pagedserve.sampling_params import SamplingParams

VOCAB_SIZE = 40
EOS_TOKEN_IDS = (2,)


def build(params_list, output_ids=None, prompt_ids=None, generators=None, vocab_size=VOCAB_SIZE):
    num_rows = len(params_list)
    return SamplingMetadata.build(
        params_list,
        output_token_ids=output_ids if output_ids is not None else [[] for _ in range(num_rows)],
        prompt_token_ids=prompt_ids if prompt_ids is not None else [[] for _ in range(num_rows)],
        generators=generators or {},
        eos_token_ids=EOS_TOKEN_IDS,
        vocab_size=vocab_size,
        device="cpu",
    )


def random_logits(num_rows, vocab_size=VOCAB_SIZE, seed=0):
    # Continuous random values: no ties, so sort order and masks are unambiguous.
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def random_token_lists(num_rows, max_len, seed):
    rng = random.Random(seed)
    return [
        [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(max_len + 1))]
        for _ in range(num_rows)
    ]


def assert_logits_match(fast_row: torch.Tensor, reference_row: list[float]):
    expected = torch.tensor(reference_row, dtype=torch.float64)
    fast_row = fast_row.double()
    assert torch.equal(torch.isinf(fast_row), torch.isinf(expected)), "masks differ"
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(fast_row[finite], expected[finite], rtol=1e-5, atol=1e-5)


def assert_rows_match_reference(logits, params_list, output_ids, prompt_ids):
    metadata = build(params_list, output_ids=output_ids, prompt_ids=prompt_ids)
    penalized = apply_logits_processors(logits, metadata)
    transformed = apply_sampling_transforms(penalized, metadata)
    for row, params in enumerate(params_list):
        expected = reference.process_row(
            logits[row].tolist(), params, output_ids[row], prompt_ids[row], EOS_TOKEN_IDS
        )
        assert_logits_match(penalized[row], expected.penalized_logits)
        if expected.sampling_logits is not None:
            assert_logits_match(transformed[row], expected.sampling_logits)


# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_equals_argmax():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=1e-6)]
    out = Sampler()(logits, build(params))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.sampled_token_ranks is None


def test_greedy_ties_take_lowest_id():
    logits = torch.zeros(2, 10)
    logits[0, [3, 7]] = 5.0
    logits[1, [9, 1]] = 5.0
    out = Sampler()(logits, build([SamplingParams(temperature=0)] * 2, vocab_size=10))
    assert out.sampled_token_ids.tolist() == [3, 1]


def test_greedy_rows_in_mixed_batch_take_argmax_of_penalized_logits():
    logits = random_logits(8, seed=1)
    output_ids = random_token_lists(8, 6, seed=1)
    params = [
        SamplingParams(temperature=0.0 if row % 2 else 0.8, repetition_penalty=1.3,
                       presence_penalty=0.5, top_k=5, top_p=0.9)
        for row in range(8)
    ]
    metadata = build(params, output_ids=output_ids, prompt_ids=[[] for _ in range(8)])
    out = Sampler()(logits, metadata)
    for row in range(1, 8, 2):
        expected = reference.process_row(
            logits[row].tolist(), params[row], output_ids[row], [], EOS_TOKEN_IDS
        )
        assert out.sampled_token_ids[row].item() == reference.argmax(expected.penalized_logits)


class CountingArgmax:
    """The compiled kernels' argmax_rows, counting its calls."""

    def __init__(self, kernels) -> None:
        self.kernels, self.calls = kernels, 0

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.kernels.argmax_rows(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_argmax_draws_the_tokens_torch_does(dtype):
    """Greedy rows, seeded random rows (their exponential race) and a mixed batch, with ties:
    the kernel took each argmax, and every row's token is the torch path's."""
    from pagedserve.kernels import cpu_ops

    kernels = cpu_ops.load()
    if kernels is None:
        pytest.skip("the compiled CPU kernels are unavailable")
    logits = random_logits(6, seed=3).to(dtype)
    logits[0, [4, 9]] = 50.0  # a tie: the lower id
    batches = {
        "greedy": [SamplingParams(temperature=0.0)] * 6,
        "random": [SamplingParams(temperature=0.9, seed=row) for row in range(6)],
        "mixed": [SamplingParams(temperature=0.0 if row % 2 else 0.7, seed=row, top_k=8)
                  for row in range(6)],
    }
    for name, params in batches.items():
        def metadata(params=params):  # fresh generators: both samplers draw the same numbers
            generators = {row: torch.Generator().manual_seed(p.seed) for row, p in enumerate(params)
                          if p.seed is not None}
            return build(params, generators=generators)

        counting = CountingArgmax(kernels)
        fast = Sampler(counting)(logits, metadata()).sampled_token_ids
        assert counting.calls > 0, name
        assert torch.equal(fast, Sampler()(logits, metadata()).sampled_token_ids), name
        if name == "greedy":
            assert fast[0].item() == 4


def test_empty_batch():
    out = Sampler()(torch.empty(0, VOCAB_SIZE), build([]))
    assert out.sampled_token_ids.shape == (0,)


# ---- penalties -------------------------------------------------------------------------------


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    metadata = build([params], output_ids=[[1, 1, 3]], prompt_ids=[[0]], vocab_size=4)
    penalized = apply_logits_processors(logits, metadata)
    # token 0, prompt only:  2 / 2                        =  1.0
    # token 1, output twice: -1 * 2 - 0.5 * 2 - 0.25     = -3.25
    # token 2, unseen:                                     0.5
    # token 3, output once:  3 / 2 - 0.5 * 1 - 0.25      =  0.75
    assert penalized.tolist() == [[1.0, -3.25, 0.5, 0.75]]
    reference_row = reference.process_row(
        [2.0, -1.0, 0.5, 3.0], params, [1, 1, 3], [0], EOS_TOKEN_IDS
    )
    assert reference_row.penalized_logits == [1.0, -3.25, 0.5, 0.75]
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [0]


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6},
        {"frequency_penalty": 1.2},
        {"frequency_penalty": -0.7},
        {"presence_penalty": 1.5},
        {"presence_penalty": -1.0},
        {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.4},
    ],
)
def test_penalties_match_reference(penalty):
    num_rows = 6
    logits = random_logits(num_rows, seed=2)
    # Row 0 has no penalty: it shares the batch with penalized rows and must come out unchanged.
    params = [SamplingParams(temperature=0.0)]
    params += [SamplingParams(temperature=0.0, **penalty)] * (num_rows - 1)
    output_ids = random_token_lists(num_rows, 12, seed=3)
    prompt_ids = random_token_lists(num_rows, 20, seed=4)
    assert_rows_match_reference(logits, params, output_ids, prompt_ids)
    metadata = build(params, output_ids=output_ids, prompt_ids=prompt_ids)
    assert torch.equal(apply_logits_processors(logits, metadata)[0], logits[0])


def test_no_penalty_tensors_when_unused():
    metadata = build([SamplingParams(), SamplingParams(temperature=0, top_k=3)])
    assert metadata.repetition_penalties is None and metadata.prompt_token_ids is None
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert not metadata.all_greedy and not metadata.all_random


# ---- top-k / top-p / min-p -------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"top_k": 5},
        {"top_k": 1},
        {"top_p": 0.8},
        {"top_p": 0.3},
        {"min_p": 0.1},
        {"top_k": 10, "top_p": 0.7},
        {"top_k": 8, "top_p": 0.9, "min_p": 0.05, "temperature": 0.7},
        {"temperature": 1.8, "top_p": 0.95},
    ],
)
def test_sampling_transforms_match_reference(options):
    num_rows = 6
    logits = random_logits(num_rows, seed=5)
    # Mix in rows without the option, and a greedy row, so "off" values are exercised in-batch.
    params = [
        SamplingParams(**options),
        SamplingParams(),
        SamplingParams(**options),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5),
        SamplingParams(**options),
    ]
    empty = [[] for _ in range(num_rows)]
    assert_rows_match_reference(logits, params, empty, empty)


def test_top_k_only_and_top_k_with_top_p_paths_agree():
    logits = random_logits(4, seed=6)
    params = [SamplingParams(top_k=k) for k in (3, 0, 7, 1)]
    top_k_only = apply_sampling_transforms(logits, build(params))
    # The same rows plus one top-p row send every row down the sort-based path.
    sorted_path = apply_sampling_transforms(
        torch.cat([logits, logits[:1]]), build(params + [SamplingParams(top_p=0.5)])
    )
    assert torch.equal(top_k_only, sorted_path[:4])


def test_top_p_never_samples_outside_nucleus():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    probs = logits.softmax(dim=-1).tolist()  # ~ [.44 .27 .16 .06 .04 .02 .01 .00]
    top_p = 0.9  # the top three hold .87: the fourth crosses 0.9 and stays, the rest go
    order = sorted(range(8), key=lambda i: -probs[i])
    nucleus, mass = set(), 0.0
    for token_id in order:
        if mass >= top_p:
            break
        nucleus.add(token_id)
        mass += probs[token_id]
    assert nucleus == {0, 1, 2, 3}
    num_draws = 5000
    torch.manual_seed(0)
    metadata = build([SamplingParams(top_p=top_p)] * num_draws, vocab_size=8)
    out = Sampler()(logits.expand(num_draws, 8), metadata)
    assert set(out.sampled_token_ids.tolist()) == nucleus


# ---- logit bias and min_tokens ---------------------------------------------------------------


def test_logit_bias_adds_to_logits_and_steers_greedy():
    logits = random_logits(3, seed=7)
    biased = SamplingParams(temperature=0, logit_bias={"5": 100, 9: -3.5})
    params = [biased, SamplingParams(temperature=0), biased]
    metadata = build(params)
    penalized = apply_logits_processors(logits, metadata)
    expected = logits.clone()
    expected[[0, 2], 5] += 100
    expected[[0, 2], 9] -= 3.5
    torch.testing.assert_close(penalized, expected)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist()[::2] == [5, 5]
    assert_rows_match_reference(logits, params, [[]] * 3, [[]] * 3)


def test_min_tokens_forbids_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, VOCAB_SIZE)
    logits[:, EOS_TOKEN_IDS[0]] = 10.0  # eos is the greedy choice unless forbidden
    logits[:, 7] = 9.0
    logits[:, 11] = 8.0
    params = [
        SamplingParams(temperature=0, min_tokens=3),  # 2 < 3: no eos
        SamplingParams(temperature=0, min_tokens=3),  # 3 >= 3: eos is fine
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]),  # eos and 7 barred
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7], ignore_eos=True),  # 7 only
    ]
    output_ids = [[1, 1], [1, 1, 1], [1], [1]]
    metadata = build(params, output_ids=output_ids)
    assert metadata.min_tokens_stop_ids == [{2}, None, {2, 7}, {7}]
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == [7, 2, 11, 2]
    assert_rows_match_reference(logits, params, output_ids, [[]] * 4)


def test_processors_do_not_write_to_input_logits():
    logits = random_logits(2, seed=8)
    original = logits.clone()
    params = SamplingParams(
        logit_bias={1: 2.0}, min_tokens=2, repetition_penalty=1.5, top_k=3, top_p=0.5, min_p=0.1
    )
    Sampler()(logits, build([params] * 2, output_ids=[[1], [3]], prompt_ids=[[4], [5]]))
    assert torch.equal(logits, original)


# ---- seeded sampling -------------------------------------------------------------------------


def generate_with_seeded_row(batch_size, seeded_row, num_steps=50):
    """Sample num_steps tokens for a seeded request (with a presence penalty, so its own tokens feed
    back) sharing each step with batch_size - 1 other requests."""
    seeded_params = SamplingParams(temperature=0.9, top_k=20, seed=1234, presence_penalty=0.5)
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.6),
        SamplingParams(seed=99, top_k=4),
        SamplingParams(min_p=0.2, logit_bias={3: 1.0}),
        SamplingParams(temperature=1.5, repetition_penalty=1.3),
        SamplingParams(logprobs=3),
    ][: batch_size - 1]
    params = others[:seeded_row] + [seeded_params] + others[seeded_row:]
    generators = {
        row: torch.Generator().manual_seed(p.seed)
        for row, p in enumerate(params) if p.seed is not None
    }
    output_ids = [[] for _ in params]
    torch.manual_seed(batch_size)  # the unseeded stream differs between the two runs
    sampler = Sampler()
    for step in range(num_steps):
        logits = torch.randn(batch_size, VOCAB_SIZE)
        # The seeded request sees the same logits at each step in both runs.
        logits[seeded_row] = random_logits(1, seed=1000 + step)[0]
        metadata = build(params, output_ids=output_ids, generators=generators)
        for row, token_id in enumerate(sampler(logits, metadata).sampled_token_ids.tolist()):
            output_ids[row].append(token_id)
    return output_ids[seeded_row]


def test_seeded_row_does_not_depend_on_batch():
    alone = generate_with_seeded_row(batch_size=1, seeded_row=0)
    in_batch = generate_with_seeded_row(batch_size=8, seeded_row=3)
    assert alone == in_batch
    assert len(set(alone)) > 5  # it really sampled


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    generators = {row: torch.Generator().manual_seed(p.seed) for row, p in enumerate(params)}
    metadata = build(params, generators=generators, vocab_size=1000)
    sampled = [Sampler()(logits, metadata).sampled_token_ids for _ in range(5)]
    assert not all(s[0] == s[1] for s in sampled)


def test_build_keeps_generators_of_seeded_random_rows_only():
    params = [SamplingParams(seed=1), SamplingParams(temperature=0, seed=2), SamplingParams()]
    generators = {0: torch.Generator(), 1: torch.Generator()}
    assert list(build(params, generators=generators).generators) == [0]


# ---- sampling statistics ---------------------------------------------------------------------


def test_sampling_frequencies_match_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    expected_probs = logits.softmax(dim=-1)
    num_draws = 20_000
    torch.manual_seed(0)
    metadata = build([SamplingParams()] * num_draws, vocab_size=5)
    out = Sampler()(logits.expand(num_draws, 5), metadata)
    counts = torch.bincount(out.sampled_token_ids, minlength=5).double()
    expected = expected_probs.double() * num_draws
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001 for a correct sampler.
    assert chi_square < 18.47, (chi_square, counts.tolist(), expected.tolist())


def test_random_rows_sample_only_tokens_the_reference_allows():
    logits = random_logits(1, seed=9)[0]
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8, min_p=0.05, repetition_penalty=1.4)
    reference_row = reference.process_row(logits.tolist(), params, [0, 1], [2, 3], EOS_TOKEN_IDS)
    allowed = {i for i, x in enumerate(reference_row.sampling_logits) if x != float("-inf")}
    num_draws = 2000
    metadata = build(
        [params] * num_draws, output_ids=[[0, 1]] * num_draws, prompt_ids=[[2, 3]] * num_draws
    )
    out = Sampler()(logits.expand(num_draws, VOCAB_SIZE), metadata)
    assert set(out.sampled_token_ids.tolist()) == allowed


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    num_rows = 5
    logits = random_logits(num_rows, seed=10)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5, logit_bias={4: 5.0}),
        SamplingParams(logprobs=0, top_k=3),
        SamplingParams(),  # wants no logprobs but gets the batch's columns; the caller ignores them
        SamplingParams(logprobs=2, temperature=0),
        SamplingParams(logprobs=1, top_p=0.5, seed=3),
    ]
    metadata = build(params, output_ids=[[4, 5]] * num_rows, prompt_ids=[[6]] * num_rows,
                     generators={4: torch.Generator().manual_seed(3)})
    assert metadata.max_num_logprobs == 3
    out = Sampler()(logits, metadata)
    assert out.logprobs.shape == (num_rows, 4) and out.logprob_token_ids.shape == (num_rows, 4)
    raw_logprobs = logits.log_softmax(dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw_logprobs.gather(1, sampled[:, None])[:, 0])
    top_logprobs, top_ids = raw_logprobs.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_logprobs)
    for row in range(num_rows):
        logprob, rank = reference.sampled_logprob_and_rank(
            logits[row].tolist(), sampled[row].item()
        )
        assert math.isclose(out.logprobs[row, 0].item(), logprob, abs_tol=1e-5)
        assert out.sampled_token_ranks[row].item() == rank


def test_greedy_sampled_token_has_rank_one():
    logits = random_logits(3, seed=11)
    out = Sampler()(logits, build([SamplingParams(temperature=0, logprobs=0)] * 3))
    assert out.sampled_token_ranks.tolist() == [1, 1, 1]
    assert out.logprobs.shape == (3, 1)
