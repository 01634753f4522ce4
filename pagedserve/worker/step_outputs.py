"""What a step's logits and hidden states give besides each request's sampled token (ModelRunner
calls these): grammar masks on the logits, speculative drafts verified by rejection sampling, and
the prompt chunks' outputs (pooled vectors, prompt logprobs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedserve.config import ModelConfig
from pagedserve.core.outputs import GrammarOutput, ModelRunnerOutput, TokenLogprobs
from pagedserve.sample.bitmask import apply_token_bitmask_
from pagedserve.sample.rejection_sampler import RejectionSampler
from pagedserve.sample.sampler import SamplingMetadata, gather_logprobs
from pagedserve.sampling_params import SamplingType
from pagedserve.worker.pooler import pool_chunk

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import CachedRequestState


def apply_grammar_bitmask(
    logits: torch.Tensor,
    states: list[CachedRequestState],
    spec_tokens: dict[str, list[int]],
    grammar_output: GrammarOutput,
) -> None:
    """Mask the constrained requests' logits rows, in place. `states` are in logits order;
    each has 1 + len(drafts) rows, as in grammar_output's bitmask."""
    logits_rows, mask_rows = [], []
    row = 0
    for state in states:
        num_rows = 1 + len(spec_tokens.get(state.req_id, ()))
        first_mask_row = grammar_output.first_row.get(state.req_id)
        if first_mask_row is not None:
            logits_rows.extend(range(row, row + num_rows))
            mask_rows.extend(range(first_mask_row, first_mask_row + num_rows))
        row += num_rows
    if logits_rows:
        bitmask = torch.from_numpy(grammar_output.bitmask[mask_rows])
        apply_token_bitmask_(logits, logits_rows, bitmask)


def verify_drafts(
    rejection_sampler: RejectionSampler,
    model_config: ModelConfig,
    device: torch.device,
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts_list: list[list[int]],
    output: ModelRunnerOutput,
) -> dict[str, int]:
    """Rejection-sample each request's drafts from logits (sum(k + 1), V); append the emitted
    tokens to its state. Returns req_id -> number of rejected drafts."""
    # One sampling row per position. Row j of a request sees drafts[:j] as output tokens:
    # it is only used if they were all accepted, so penalties and min_tokens count them.
    params_list, output_ids, prompt_ids = [], [], []
    for state, drafts in zip(states, drafts_list):
        prompt = state.token_ids[: state.num_prompt_tokens]
        for j in range(len(drafts) + 1):
            params_list.append(state.sampling_params)
            output_ids.append(state.output_token_ids + drafts[:j])
            prompt_ids.append(prompt)
    metadata = SamplingMetadata.build(
        params_list, output_ids, prompt_ids, {}, model_config.eos_token_ids,
        model_config.vocab_size, device,
    )
    generators = {
        i: s.generator for i, s in enumerate(states)
        if s.generator is not None
        and s.sampling_params.sampling_type == SamplingType.RANDOM_SEED
    }
    emitted = rejection_sampler(logits, metadata, drafts_list, generators)

    logprobs_per_req = _emitted_logprobs(logits, states, drafts_list, emitted)
    num_rejected = {}
    for state, drafts, token_ids in zip(states, drafts_list, emitted):
        state.token_ids.extend(token_ids)
        state.output_token_ids.extend(token_ids)
        output.sampled_token_ids[state.req_id] = token_ids
        num_rejected[state.req_id] = len(drafts) + 1 - len(token_ids)
        if state.req_id in logprobs_per_req:
            output.logprobs[state.req_id] = logprobs_per_req[state.req_id]
    return num_rejected


def _emitted_logprobs(
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts_list: list[list[int]],
    emitted: list[list[int]],
) -> dict[str, list[TokenLogprobs]]:
    """Raw-logit logprobs of each emitted token at its own position (as `_sample` gives)."""
    wanted = [s.sampling_params.logprobs for s in states
              if s.sampling_params.logprobs is not None]
    if not wanted:
        return {}
    rows, token_ids, start = [], [], 0
    for drafts, tokens in zip(drafts_list, emitted):
        rows.extend(range(start, start + len(tokens)))
        token_ids.extend(tokens)
        start += len(drafts) + 1
    raw_logprobs = logits[torch.tensor(rows, device=logits.device)].float().log_softmax(dim=-1)
    values, ids, ranks = gather_logprobs(
        raw_logprobs, torch.tensor(token_ids, device=logits.device), max(wanted)
    )
    values, ids, ranks = values.tolist(), ids.tolist(), ranks.tolist()
    result, offset = {}, 0
    for state, tokens in zip(states, emitted):
        num_top = state.sampling_params.logprobs
        if num_top is not None:
            result[state.req_id] = [
                TokenLogprobs(ids[r][: 1 + num_top], values[r][: 1 + num_top], ranks[r])
                for r in range(offset, offset + len(tokens))
            ]
        offset += len(tokens)
    return result


def record_prompt_outputs(
    model: torch.nn.Module,
    states: list[CachedRequestState],
    num_scheduled: list[int],
    query_start_loc: list[int],
    hidden_states: torch.Tensor,
    output: ModelRunnerOutput,
) -> None:
    """What the prompt chunks computed now give into `output`: a pooling request's vector once
    its prompt is complete (worker/pooler.py), and the prompt logprobs a generation request asked
    for."""
    for i, (state, num_tokens) in enumerate(zip(states, num_scheduled)):
        rows = hidden_states[query_start_loc[i] : query_start_loc[i] + num_tokens]
        if state.pooling is not None:
            vector = pool_chunk(state.pooling, rows, state.num_computed_tokens,
                                state.num_computed_tokens + num_tokens >= len(state.token_ids))
            if vector is not None:
                output.pooled_outputs[state.req_id] = vector
        elif state.sampling_params.prompt_logprobs is not None:
            _record_prompt_logprobs(model, state, rows, output)


def _record_prompt_logprobs(model: torch.nn.Module, state: CachedRequestState,
                            rows: torch.Tensor, output: ModelRunnerOutput) -> None:
    """Logprob of each prompt token given the ones before it, for the chunk whose hidden states
    are `rows`."""
    num_top = state.sampling_params.prompt_logprobs
    start = state.num_computed_tokens
    # position p predicts prompt token p + 1; the last prompt position predicts output
    end = min(start + rows.shape[0], state.num_prompt_tokens - 1)
    if end <= start:
        return
    logprobs = torch.log_softmax(model.compute_logits(rows[: end - start]), dim=-1)  # (N, V)
    targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=logprobs.device)
    target_logprobs = logprobs.gather(1, targets[:, None])  # (N, 1)
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    chunk = []
    for j, target in enumerate(targets.tolist()):
        ids, values = [target], [target_logprobs[j, 0].item()]
        if top_ids is not None:
            ids += top_ids[j].tolist()
            values += top_logprobs[j].tolist()
        chunk.append(TokenLogprobs(ids, values, int(ranks[j])))
    output.prompt_logprobs[state.req_id] = (start + 1, chunk)
