"""Batch sampler: logits (B, V) in, one token id per row out, plus logprobs when asked.

Processing order follows vLLM V1: allowed_token_ids and bad_words (one ban mask) -> logit_bias
and min_tokens -> penalties -> greedy argmax ->
temperature -> min_p -> top-k/top-p -> sample by exponential race. Logprobs come from the raw
logits. Knows nothing of requests or the scheduler: the caller builds SamplingMetadata once per
step from each row's SamplingParams. Its slow one-row-at-a-time twin is sample/reference.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_ops
from pagedserve.sampling_params import SAMPLING_EPS, SamplingParams, SamplingType

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """One row per request sampled this step; tensors live on the logits' device.

    Fields a step does not need are None (or empty), so the common batch (no penalties, no seeds,
    no bias) runs without per-row Python work.
    """

    temperature: torch.Tensor
    """(B,) float32; 0 for greedy rows."""
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    """(B,) int64, 0 = off; None when no random row uses top-k."""
    max_top_k: int
    """Largest top_k over rows (0 when top_k is None): lets top-k run as torch.topk with no sync."""
    top_p: torch.Tensor | None
    """(B,) float32, 1 = off; None when no random row uses top-p."""
    min_p: torch.Tensor | None
    """(B,) float32, 0 = off; None when no random row uses min-p."""
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator, for seeded random rows only."""
    presence_penalties: torch.Tensor | None
    """(B,) float32. The three penalty tensors are all None when no row uses any penalty."""
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    output_token_ids: list[list[int]]
    """Tokens generated so far, per row (read only for penalties)."""
    prompt_token_ids: torch.Tensor | None
    """(B, max_prompt_len) int64 padded with vocab_size; only when some row has a repetition
    penalty, which (like vLLM and HF) counts prompt tokens as well as output tokens."""
    logit_bias: list[dict[int, float] | None]
    min_tokens_stop_ids: list[set[int] | None]
    """Per row: token ids to forbid this step, as the output is still shorter than min_tokens."""
    banned_token_mask: torch.Tensor | None
    """(B, V) bool, True = may not be sampled this step: tokens outside a row's
    allowed_token_ids, and the bad_words tokens that would complete a bad word now. None when
    no row has either."""
    max_num_logprobs: int | None
    """Largest `logprobs` over rows; None when no row wants logprobs."""

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        eos_token_ids: Iterable[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Turn each row's SamplingParams (and its tokens so far) into this step's batch tensors.

        `generators` maps row -> that request's generator (on `device`); entries for rows that are
        not seeded-random are dropped. min_tokens forbids the request's stop_token_ids plus the
        model's eos ids, but not eos when ignore_eos is set: then eos does not end the request, so
        there is nothing to hold back (vLLM does the same).
        """
        num_rows = len(params_list)
        assert len(output_token_ids) == num_rows and len(prompt_token_ids) == num_rows
        device = torch.device(device)
        eos_token_ids = tuple(eos_token_ids)
        sampling_types = [params.sampling_type for params in params_list]
        is_greedy = [t == SamplingType.GREEDY for t in sampling_types]

        # Greedy rows never reach temperature / min_p / top-k / top-p: store them as "off" so
        # that a greedy request carrying a stray top_k does not switch on the top-k pass.
        temperature = [0.0 if greedy else p.temperature
                       for p, greedy in zip(params_list, is_greedy)]
        top_k = [0 if greedy or p.top_k >= vocab_size else p.top_k
                 for p, greedy in zip(params_list, is_greedy)]
        top_p = [1.0 if greedy else p.top_p for p, greedy in zip(params_list, is_greedy)]
        min_p = [0.0 if greedy else p.min_p for p, greedy in zip(params_list, is_greedy)]

        use_penalties = any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            for p in params_list
        )
        use_repetition_penalty = any(p.repetition_penalty != 1.0 for p in params_list)

        min_tokens_stop_ids: list[set[int] | None] = []
        for params, output_ids in zip(params_list, output_token_ids):
            stop_ids = None
            if len(output_ids) < params.min_tokens:
                stop_ids = params.all_stop_token_ids(eos_token_ids) or None
            min_tokens_stop_ids.append(stop_ids)

        requested_logprobs = [p.logprobs for p in params_list if p.logprobs is not None]
        banned_token_mask = None
        if any(p.allowed_token_ids is not None or p.bad_words_token_ids for p in params_list):
            banned_token_mask = _banned_token_mask(params_list, output_token_ids, vocab_size,
                                                   device)
        return cls(
            temperature=_to_device(temperature, torch.float32, device),
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            top_k=_to_device(top_k, torch.int64, device) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=_to_device(top_p, torch.float32, device) if any(p < 1.0 for p in top_p) else None,
            min_p=_to_device(min_p, torch.float32, device) if any(min_p) else None,
            generators={row: generator for row, generator in generators.items()
                        if sampling_types[row] == SamplingType.RANDOM_SEED},
            presence_penalties=(_to_device([p.presence_penalty for p in params_list],
                                           torch.float32, device) if use_penalties else None),
            frequency_penalties=(_to_device([p.frequency_penalty for p in params_list],
                                            torch.float32, device) if use_penalties else None),
            repetition_penalties=(_to_device([p.repetition_penalty for p in params_list],
                                             torch.float32, device) if use_penalties else None),
            output_token_ids=output_token_ids,
            prompt_token_ids=(_pad_token_ids(prompt_token_ids, vocab_size, device)
                              if use_repetition_penalty else None),
            logit_bias=[p.logit_bias for p in params_list],
            min_tokens_stop_ids=min_tokens_stop_ids,
            banned_token_mask=banned_token_mask,
            max_num_logprobs=max(requested_logprobs, default=None),
        )


def reads_output_token_values(params: SamplingParams) -> bool:
    """Whether sampling a row reads the values of its output tokens so far, not only how many
    there are (min_tokens): the penalties, and bad words of more than one token (whose last
    token is banned after the others). Async scheduling waits for a step's tokens on the host
    before it samples such a row in the next step."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
            or any(len(sequence) > 1 for sequence in params.bad_words_token_ids or ()))


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """(B,) int64."""
    logprobs: torch.Tensor | None
    """(B, 1 + max_num_logprobs) float32: the sampled token's raw logprob, then the top ones in
    descending order. A row that asked for fewer reads only its first 1 + logprobs columns.
    None when no row wants logprobs (as are the two fields below)."""
    logprob_token_ids: torch.Tensor | None
    """(B, 1 + max_num_logprobs) int64, the token ids of `logprobs`."""
    sampled_token_ranks: torch.Tensor | None
    """(B,) int64: the sampled token's rank under the raw logits, 1 = most likely (ties share the
    worse rank: the count of tokens at least as likely)."""


class Sampler(nn.Module):
    """Stateless: everything per request arrives in SamplingMetadata."""

    def __init__(self, kernels: ModuleType | None = None) -> None:
        """kernels: the compiled CPU kernels (kernels/cpu_ops.py), whose argmax_rows takes the
        argmax of CPU logits; None: torch's."""
        super().__init__()
        self.kernels = kernels

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` (B, V). Never writes to `logits`."""
        assert logits.dim() == 2 and logits.shape[0] == metadata.temperature.shape[0]
        logits = logits.float()
        # The model's own distribution, before any request's processing (vLLM's default).
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # (B, V)

        logits = apply_logits_processors(logits, metadata)
        sampled_token_ids = sample(logits, metadata, self.kernels)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids, None, None, None)
        logprobs, logprob_token_ids, ranks = gather_logprobs(
            raw_logprobs, sampled_token_ids, metadata.max_num_logprobs
        )
        return SamplerOutput(sampled_token_ids, logprobs, logprob_token_ids, ranks)


def _banned_token_mask(params_list: Sequence[SamplingParams], output_token_ids: list[list[int]],
                       vocab_size: int, device: torch.device) -> torch.Tensor:
    """(B, V) bool, True where a row may not sample the token this step (see SamplingMetadata).

    Per row the host work is per bad word (a short list comparison) and per allowed-id list (one
    list extend); the mask itself is filled by two index_put_ calls."""
    restricted_rows: list[int] = []
    allowed_rows: list[int] = []
    allowed_ids: list[int] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row, (params, output_ids) in enumerate(zip(params_list, output_token_ids)):
        if params.allowed_token_ids is not None:
            restricted_rows.append(row)
            allowed_rows.extend([row] * len(params.allowed_token_ids))
            allowed_ids.extend(params.allowed_token_ids)
        for sequence in params.bad_words_token_ids or ():
            # Ban the sequence's last token when the output ends with the rest of it:
            #   output: | ... | s[0] ... s[-2] |  -> s[-1] is banned now
            num_prefix = len(sequence) - 1
            if num_prefix == 0 or (len(output_ids) >= num_prefix
                                   and output_ids[-num_prefix:] == sequence[:-1]):
                banned_rows.append(row)
                banned_ids.append(sequence[-1])
    mask = torch.zeros(len(params_list), vocab_size, dtype=torch.bool, device=device)  # (B, V)
    if restricted_rows:
        mask[_to_device(restricted_rows, torch.int64, device)] = True
        index = (_to_device(allowed_rows, torch.int64, device),
                 _to_device(allowed_ids, torch.int64, device))
        mask.index_put_(index, torch.full((), False, device=device))
    if banned_rows:
        index = (_to_device(banned_rows, torch.int64, device),
                 _to_device(banned_ids, torch.int64, device))
        mask.index_put_(index, torch.full((), True, device=device))
    return mask


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Bans (allowed_token_ids, bad_words), logit_bias, min_tokens, then penalties: the steps
    that apply to greedy rows too. A banned token stays at -inf through all of them.

    Returns a new tensor when anything applies (never writes to `logits`), else `logits` itself.
    """
    if metadata.banned_token_mask is not None:
        logits = logits.masked_fill(metadata.banned_token_mask, _NEG_INF)
    has_bias = any(metadata.logit_bias)
    has_min_tokens = any(metadata.min_tokens_stop_ids)
    if has_bias or has_min_tokens:
        logits = logits.clone()
        if has_bias:
            _apply_logit_bias_(logits, metadata.logit_bias)
        if has_min_tokens:
            _apply_min_tokens_(logits, metadata.min_tokens_stop_ids)
    if metadata.repetition_penalties is not None:
        logits = apply_penalties(
            logits,
            metadata.presence_penalties,
            metadata.frequency_penalties,
            metadata.repetition_penalties,
            metadata.output_token_ids,
            metadata.prompt_token_ids,
        )
    return logits


def _apply_logit_bias_(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    rows, token_ids, biases = [], [], []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend([row] * len(bias))
            token_ids.extend(bias.keys())
            biases.extend(bias.values())
    index = (_to_device(rows, torch.int64, logits.device),
             _to_device(token_ids, torch.int64, logits.device))
    logits.index_put_(index, _to_device(biases, logits.dtype, logits.device), accumulate=True)


def _apply_min_tokens_(logits: torch.Tensor, stop_ids_per_row: list[set[int] | None]) -> None:
    rows, token_ids = [], []
    for row, stop_ids in enumerate(stop_ids_per_row):
        if stop_ids:
            rows.extend([row] * len(stop_ids))
            token_ids.extend(stop_ids)
    index = (_to_device(rows, torch.int64, logits.device),
             _to_device(token_ids, torch.int64, logits.device))
    logits.index_put_(index, torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device))


def apply_penalties(
    logits: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
    output_token_ids: list[list[int]],
    prompt_token_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens only).

    Returns a new tensor. A row with penalties 0, 0, 1 comes out unchanged.
    """
    num_rows, vocab_size = logits.shape
    output_ids = _pad_token_ids(output_token_ids, vocab_size, logits.device)  # (B, max_out_len)
    output_counts = _token_counts(output_ids, vocab_size)                     # (B, V) int64
    output_mask = output_counts > 0                                           # (B, V)
    seen_mask = output_mask
    if prompt_token_ids is not None:
        seen_mask = seen_mask | (_token_counts(prompt_token_ids, vocab_size) > 0)

    # HF semantics: dividing a positive logit and multiplying a negative one both push the token
    # down when penalty > 1.
    repetition = torch.where(seen_mask, repetition_penalties.unsqueeze(1), 1.0)  # (B, V)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - frequency_penalties.unsqueeze(1) * output_counts
    return logits - presence_penalties.unsqueeze(1) * output_mask


def argmax_rows(x: torch.Tensor, kernels: ModuleType | None = None) -> torch.Tensor:
    """x.argmax(dim=-1) of (B, V) x: the same indices (a row's first NaN, else its first
    maximum), by the compiled kernel where it serves (`kernels`, CPU fp32 / bf16 rows), about
    12x torch's reduction at 32 x 49,152 (Zen 4)."""
    if (kernels is not None and cpu_ops.serves(x) and x.dim() == 2 and x.shape[1] > 0
            and x.stride(1) == 1):
        return kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, metadata: SamplingMetadata,
           kernels: ModuleType | None = None) -> torch.Tensor:
    """(B, V) processed logits -> (B,) int64 token ids; greedy rows take the exact argmax.
    kernels: as Sampler's."""
    if metadata.all_greedy:
        return argmax_rows(logits, kernels)
    greedy_token_ids = None if metadata.all_random else argmax_rows(logits, kernels)  # (B,)

    logits = apply_sampling_transforms(logits, metadata)
    probs = logits.softmax(dim=-1)  # (B, V)
    random_token_ids = random_sample(probs, metadata.generators, kernels)
    if greedy_token_ids is None:
        return random_token_ids
    return torch.where(metadata.temperature < SAMPLING_EPS, greedy_token_ids, random_token_ids)


def compute_target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """(B, V) float32: the distribution each row of `logits` (B, V) is sampled from after all of
    its request's processing; greedy rows are a point mass on their argmax. Draws the same tokens
    as `Sampler` in distribution; the rejection sampler verifies drafts against it. Never writes
    to `logits`."""
    logits = apply_logits_processors(logits.float(), metadata)
    vocab_size = logits.shape[1]
    greedy_probs = None
    if not metadata.all_random:
        greedy_probs = F.one_hot(logits.argmax(dim=-1), vocab_size).float()  # (B, V)
    if metadata.all_greedy:
        return greedy_probs
    probs = apply_sampling_transforms(logits, metadata).softmax(dim=-1)      # (B, V)
    if greedy_probs is None:
        return probs
    is_greedy = (metadata.temperature < SAMPLING_EPS).unsqueeze(1)           # (B, 1)
    return torch.where(is_greedy, greedy_probs, probs)


def apply_sampling_transforms(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, min_p, then top-k/top-p: the steps that only matter to random rows.

    Returns a new tensor; rows that are greedy come out at temperature 1 and are ignored later.
    """
    logits = apply_temperature(logits, metadata.temperature, metadata.all_random)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
    return logits


def apply_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, all_random: bool
) -> torch.Tensor:
    if not all_random:
        # Greedy rows carry 0; divide them by 1 instead of 0 (their result is not used).
        temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits / temperature.unsqueeze(1)  # (B, V)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)                      # (B, V)
    max_probs = probs.amax(dim=-1, keepdim=True)        # (B, 1)
    return logits.masked_fill(probs < max_probs * min_p.unsqueeze(1), _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask all but the top_k logits, then all but the nucleus of mass top_p of what is left.

    top_k keeps ties with the k-th largest value. top_p keeps a token when the mass of the tokens
    ranked above it is < top_p, so the token that crosses top_p stays and the top token always
    does. Rows with top_k 0 and top_p 1 come out unchanged. Returns a new tensor.
    """
    num_rows, vocab_size = logits.shape
    if top_p is None:
        assert top_k is not None and max_top_k > 0
        return _apply_top_k_only(logits, top_k, max_top_k)

    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending: (B, V)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)   # (B,)
        #  sorted ascending: | dropped (V - k) | kept k |
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))     # (B, 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, _NEG_INF)

    # cumulative[:, i] = mass of token i and every token below it; the tokens above it hold
    # 1 - cumulative[:, i] + p_i, so "mass above < top_p" is "cumulative > 1 - top_p".
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)                 # (B, V)
    outside_nucleus = cumulative <= 1 - top_p.unsqueeze(1)                    # (B, V)
    outside_nucleus[:, -1] = False  # the top token always stays, even if rounding says otherwise
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    # torch.topk of the largest k over rows is much cheaper than a full sort of the vocabulary.
    top_values = logits.topk(max_top_k, dim=-1).values                          # (B, max_k) desc
    kth_index = (top_k.clamp(1, max_top_k) - 1).unsqueeze(1)                    # (B, 1)
    kth_largest = top_values.gather(1, kth_index)                               # (B, 1)
    # Rows with top-k off keep everything: their threshold is -inf.
    kth_largest = kth_largest.masked_fill((top_k <= 0).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth_largest, _NEG_INF)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  kernels: ModuleType | None = None) -> torch.Tensor:
    """One token per row of `probs` (B, V) by exponential race: argmax(p_i / E_i), E_i ~ Exp(1).

    E_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is i with probability
    p_i / sum(p): a categorical draw with no cumsum and no sync. Seeded rows draw their E from
    their own generator, so their tokens do not depend on the rest of the batch. Writes to `probs`.
    """
    race = torch.empty_like(probs)  # (B, V)
    if len(generators) != probs.shape[0]:
        race.exponential_()  # one draw for the whole batch; seeded rows are overwritten below
    for row, generator in generators.items():
        race[row].exponential_(generator=generator)
    # NOTE: exponential_ can return exactly 0, and 0/0 is NaN, which argmax takes as the max: a
    # masked token (p = 0) would win. Clamping keeps p = 0 tokens at 0.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return argmax_rows(probs.div_(race), kernels)  # (B,)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled_token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, 1 + k) logprobs and their token ids (sampled first, then the top k), and (B,) ranks."""
    sampled_ids = sampled_token_ids.unsqueeze(1)                               # (B, 1)
    sampled_logprobs = raw_logprobs.gather(1, sampled_ids)                     # (B, 1)
    ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)                     # (B,) int64
    num_logprobs = min(num_logprobs, raw_logprobs.shape[1])
    if num_logprobs == 0:
        return sampled_logprobs, sampled_ids, ranks
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)            # (B, k) desc
    return (torch.cat([sampled_logprobs, top_logprobs], dim=1),
            torch.cat([sampled_ids, top_ids], dim=1), ranks)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, L) ids padded with vocab_size -> (B, V) int64 occurrence counts (padding dropped)."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device
    )  # (B, V + 1): the last column collects the padding
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def _pad_token_ids(token_ids: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Ragged rows -> (B, max_len) int64, padded with `pad_id` (one past the vocabulary)."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [ids + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return _to_device(padded, torch.int64, device).view(len(token_ids), max_len)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Built on the host (pinned for a GPU) and copied without blocking: no sync in the step.
    # (Scalars are made on the device with torch.full: torch.tensor(x, device=...) copies
    # from pageable memory, which waits for the stream.)
    pin_memory = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin_memory).to(device, non_blocking=True)
