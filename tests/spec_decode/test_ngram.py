"""The n-gram (prompt lookup) proposer and the speculative config. No model, milliseconds."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import SpeculativeConfig
from pagedserve.engine.arg_utils import parse_speculative_config
from pagedserve.spec_decode import create_proposer
from pagedserve.spec_decode.ngram import NgramProposer


def slow_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Reference: longest n first, then the latest earlier occurrence of the last n tokens."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_suffix():
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=4)
    assert proposer.propose([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6]


def test_fewer_drafts_when_the_match_is_near_the_end():
    proposer = NgramProposer(num_speculative_tokens=5, min_n=1, max_n=2)
    assert proposer.propose([7, 8, 9, 7, 8]) == [9, 7, 8]
    assert proposer.propose([5, 5]) == [5]


def test_longest_ngram_wins_over_a_later_shorter_one():
    proposer = NgramProposer(num_speculative_tokens=2, min_n=1, max_n=3)
    # "1 2 3" matched at the start (-> 10 11); "3" alone recurs later (-> 20 21).
    assert proposer.propose([1, 2, 3, 10, 11, 3, 20, 21, 1, 2, 3]) == [10, 11]


def test_most_recent_match_wins_among_equal_lengths():
    proposer = NgramProposer(num_speculative_tokens=2, min_n=2, max_n=2)
    assert proposer.propose([4, 5, 1, 1, 4, 5, 2, 2, 4, 5]) == [2, 2]


def test_nothing_when_no_ngram_recurs_or_too_short():
    proposer = NgramProposer(num_speculative_tokens=4, min_n=2, max_n=4)
    assert proposer.propose([1, 2, 3, 4, 5]) == []
    assert proposer.propose([1, 2, 1]) == []  # only a 1-gram recurs, min_n is 2
    assert proposer.propose([]) == [] and proposer.propose([3]) == []


@pytest.mark.parametrize("seed", range(20))
def test_matches_slow_reference(seed):
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    k = rng.randint(1, 6)
    proposer = NgramProposer(k, min_n, max_n)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 40))]
        assert proposer.propose(tokens) == slow_propose(tokens, k, min_n, max_n), tokens


def test_create_proposer_from_vllm_style_config():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2}'
    )
    assert config == SpeculativeConfig("ngram", 3, 5, 2)
    proposer = create_proposer(config)
    assert (proposer.num_speculative_tokens, proposer.min_n, proposer.max_n) == (3, 2, 5)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config({"method": "ngram"}) == SpeculativeConfig()


@pytest.mark.parametrize("bad, message", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_token": 4}, "unknown"),
    ("{not json", "JSON"),
    ("[1, 2]", "dict"),
])
def test_bad_config_is_a_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(bad)
