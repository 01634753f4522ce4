"""SamplingParams: defaults, normalization, and each validation rule (messages name the field)."""

import math

import pytest

from pagedserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p) == (1, 1.0, 1.0)
    assert (params.top_k, params.min_p) == (0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.seed is None and params.stop == [] and params.stop_token_ids == []
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.logprobs is None and params.prompt_logprobs is None and params.logit_bias is None
    assert params.skip_special_tokens and params.spaces_between_special_tokens and params.detokenize
    assert not params.ignore_eos and not params.include_stop_str_in_output
    assert MAX_LOGPROBS == 20


def test_normalization():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(logit_bias={"50256": -100, 7: 2}).logit_bias == {50256: -100.0, 7: 2.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=0).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_deep_and_mutable():
    params = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={1: 1.0}, max_tokens=None)
    copy = params.clone()
    copy.stop.append("y")
    copy.logit_bias[2] = 2.0
    copy.max_tokens = 100  # the engine fills max_tokens in place
    assert params.stop == ["x"] and params.logit_bias == {1: 1.0} and params.max_tokens is None
    assert copy == SamplingParams(
        stop=["x", "y"], stop_token_ids=[1], logit_bias={1: 1.0, 2: 2.0}, max_tokens=100
    )


def test_all_stop_token_ids():
    assert SamplingParams(stop_token_ids=[5]).all_stop_token_ids((2,)) == {2, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids((2,)) == {5}


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", math.nan),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("min_p", math.nan),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("presence_penalty", math.nan),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -math.inf),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("seed", 2**64),
        ("seed", "7"),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop", 3),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["5"]),
        ("stop_token_ids", 5),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {1: -101}),
        ("logit_bias", {1: math.nan}),
        ("logit_bias", {1: math.inf}),
        ("logit_bias", {1: "5"}),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"-3": 1.0}),
        ("logit_bias", {-3: 1.0}),
        ("logit_bias", {1.5: 1.0}),
        ("logit_bias", {"7": 1.0, 7: 2.0}),
        ("logit_bias", [1, 2]),
    ],
)
def test_rejects_bad_value(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):  # the message starts with the field
        SamplingParams(**{field: value})


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=17, max_tokens=16)
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16
    assert SamplingParams(min_tokens=500, max_tokens=None).min_tokens == 500


def test_accepts_boundary_values():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, top_k=1, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.01, logprobs=MAX_LOGPROBS,
                   prompt_logprobs=0, logit_bias={0: -100, 1: 100}, seed=-(2**63), max_tokens=1)


def test_message_shows_the_bad_value():
    with pytest.raises(ValueError, match=r"temperature must be finite and >= 0, got -0\.5"):
        SamplingParams(temperature=-0.5)


def test_validate_for_vocab():
    SamplingParams(stop_token_ids=[0, 99], logit_bias={99: 1.0}).validate_for_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).validate_for_vocab(100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"100": 1.0}).validate_for_vocab(100)


def test_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, pagedserve.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
