"""Slow reference sampler: one request at a time, in plain Python floats, for tests only.

Follows sample/sampler.py step for step (same order, same semantics) but reads SamplingParams
directly and uses none of its batching tricks, so a test can compare the two row by row.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.sampling_params import SamplingParams, SamplingType

NEG_INF = float("-inf")


@dataclass
class ReferenceRow:
    penalized_logits: list[float]
    """After allowed_token_ids, bad_words, logit_bias, min_tokens and penalties: what a greedy row takes the argmax of."""
    sampling_logits: list[float] | None
    """After temperature, min_p, top-k and top-p: what a random row samples from (None: greedy)."""


def process_row(
    logits: Iterable[float],
    params: SamplingParams,
    output_token_ids: list[int],
    prompt_token_ids: list[int],
    eos_token_ids: Iterable[int],
) -> ReferenceRow:
    logits = [float(x) for x in logits]
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        logits = forbid_tokens(logits, (i for i in range(len(logits)) if i not in allowed))
    logits = forbid_tokens(logits, bad_word_bans(params.bad_words_token_ids or [],
                                                 output_token_ids))
    logits = apply_logit_bias(logits, params.logit_bias)
    if len(output_token_ids) < params.min_tokens:
        logits = forbid_tokens(logits, params.all_stop_token_ids(eos_token_ids))
    logits = apply_penalties(logits, params, output_token_ids, prompt_token_ids)
    if params.sampling_type == SamplingType.GREEDY:
        return ReferenceRow(logits, None)
    sampling_logits = [x / params.temperature for x in logits]
    if params.min_p > 0:
        sampling_logits = apply_min_p(sampling_logits, params.min_p)
    if 0 < params.top_k < len(logits):
        sampling_logits = apply_top_k(sampling_logits, params.top_k)
    if params.top_p < 1:
        sampling_logits = apply_top_p(sampling_logits, params.top_p)
    return ReferenceRow(logits, sampling_logits)


def sample_row(row: ReferenceRow, rng: random.Random) -> int:
    """Greedy: first index of the max. Random: inverse-CDF draw from softmax(sampling_logits)."""
    if row.sampling_logits is None:
        return argmax(row.penalized_logits)
    probs = softmax(row.sampling_logits)
    threshold = rng.random()
    cumulative = 0.0
    for token_id, prob in enumerate(probs):
        cumulative += prob
        if threshold < cumulative:
            return token_id
    return max(i for i, p in enumerate(probs) if p > 0)  # rounding left threshold above the sum


def apply_logit_bias(logits: list[float], logit_bias: dict[int, float] | None) -> list[float]:
    logits = list(logits)
    for token_id, bias in (logit_bias or {}).items():
        logits[token_id] += bias
    return logits


def bad_word_bans(sequences: list[list[int]], output_token_ids: list[int]) -> set[int]:
    """The last token of each bad-word sequence whose other tokens end the output so far."""
    bans = set()
    for sequence in sequences:
        *prefix, last = sequence
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            bans.add(last)
    return bans


def forbid_tokens(logits: list[float], token_ids: Iterable[int]) -> list[float]:
    logits = list(logits)
    for token_id in token_ids:
        logits[token_id] = NEG_INF
    return logits


def apply_penalties(
    logits: list[float],
    params: SamplingParams,
    output_token_ids: list[int],
    prompt_token_ids: list[int],
) -> list[float]:
    logits = list(logits)
    for token_id in set(prompt_token_ids) | set(output_token_ids):
        if logits[token_id] > 0:
            logits[token_id] /= params.repetition_penalty
        else:
            logits[token_id] *= params.repetition_penalty
    for token_id, count in Counter(output_token_ids).items():
        logits[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def apply_min_p(logits: list[float], min_p: float) -> list[float]:
    probs = softmax(logits)
    threshold = min_p * max(probs)
    return [x if p >= threshold else NEG_INF for x, p in zip(logits, probs)]


def apply_top_k(logits: list[float], top_k: int) -> list[float]:
    kth_largest = sorted(logits, reverse=True)[top_k - 1]
    return [x if x >= kth_largest else NEG_INF for x in logits]


def apply_top_p(logits: list[float], top_p: float) -> list[float]:
    """Keep a token when the tokens ranked above it hold less than top_p of the mass."""
    probs = softmax(logits)
    kept = list(logits)
    mass_above = 0.0
    for token_id in sorted(range(len(logits)), key=lambda i: -probs[i]):
        if mass_above >= top_p:
            kept[token_id] = NEG_INF
        mass_above += probs[token_id]
    return kept


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    log_total = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_total for x in logits]


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def sampled_logprob_and_rank(raw_logits: list[float], token_id: int) -> tuple[float, int]:
    """The token's logprob under the raw logits, and its rank (tokens at least as likely)."""
    logprobs = log_softmax(raw_logits)
    return logprobs[token_id], sum(1 for lp in logprobs if lp >= logprobs[token_id])
