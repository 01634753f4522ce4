"""Runs one scheduled step on the model: SchedulerOutput in, sampled tokens out.

The runner keeps its own copy of each live request (token ids, block ids, sampling params), fed by
the scheduler's diffs, so a step sends only what changed. It owns the model, the KV cache tensors
and the sampler; it knows nothing about queues, priorities or text.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedserve.attention import AttentionMetadata, forward_context
from pagedserve.attention.paged import kv_cache_shape
from pagedserve.config import CacheConfig, DeviceConfig, ModelConfig, SpeculativeConfig
from pagedserve.core.outputs import (
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from pagedserve.kernels import cpu_ops
from pagedserve.models.loader import load_model
from pagedserve.sample.bitmask import apply_token_bitmask_
from pagedserve.sample.rejection_sampler import RejectionSampler
from pagedserve.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from pagedserve.sampling_params import SamplingParams, SamplingType
from pagedserve.spec_decode import TargetInfo, create_proposer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    """Prompt + outputs so far; the runner appends what it samples."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)


def usable_cpu_count() -> int:
    """CPUs this process may run on (taskset / cgroup cpusets narrow it). torch's default counts
    every core of the machine, and more threads than usable cores stall each other badly."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def kv_cache_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.kv_size * element_size


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        model: torch.nn.Module | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        """model: an already loaded model to share (it holds no per-engine state).
        speculative_config: propose draft tokens after each step (None: no speculation)."""
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = torch.device(device_config.device)
        self.dtype = _DTYPES[device_config.dtype]
        if self.device.type == "cpu":
            torch.set_num_threads(device_config.num_threads or usable_cpu_count())
            cpu_ops.load()  # build (once per machine) now, not inside the first request
        # Unseeded requests draw from the global generator: seed it so a run is repeatable.
        torch.manual_seed(device_config.seed)

        self.model = model or load_model(
            model_path, model_config, self.dtype, self.device,
            device_config.keeps_weights_packed, device_config.quantize_on_load,
        )

        bytes_per_block = kv_cache_bytes_per_block(model_config, self.block_size, self.dtype)
        self.num_kv_blocks = cache_config.num_gpu_blocks_override or max(
            2, cache_config.kv_cache_memory_bytes // bytes_per_block
        )
        # Zeroed, not empty: masked positions still pass through softmax @ V, and a NaN there
        # would poison the row (0 * NaN = NaN).
        shape = kv_cache_shape(self.num_kv_blocks, self.block_size,
                               model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(model_config.num_hidden_layers)
        ]

        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.proposer = None
        if speculative_config is not None:
            self.proposer = create_proposer(speculative_config, TargetInfo(
                self.model, model_config, self.num_kv_blocks, self.block_size, self.dtype,
                self.device, device_config.keeps_weights_packed, device_config.quantize_on_load,
            ))
        self.requests: dict[str, CachedRequestState] = {}

    # ---- state sync -------------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.release_requests(scheduler_output.finished_req_ids)
        for data in scheduler_output.scheduled_new_reqs:
            params = data.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[data.req_id] = CachedRequestState(
                req_id=data.req_id,
                token_ids=list(data.token_ids),
                num_prompt_tokens=data.num_prompt_tokens,
                sampling_params=params,
                block_ids=list(data.block_ids),
                num_computed_tokens=data.num_computed_tokens,
                generator=generator,
                output_token_ids=list(data.token_ids[data.num_prompt_tokens :]),
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed

    def release_requests(self, req_ids: Iterable[str]) -> None:
        """Drop finished, aborted or preempted requests' state (and their draft KV)."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.remove_requests(list(req_ids))

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        grammar_output = scheduler_output.grammar
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        # Decodes first: the attention backend batches the one-token queries together.
        req_ids = sorted(
            scheduler_output.num_scheduled_tokens,
            key=lambda r: scheduler_output.num_scheduled_tokens[r] != 1,
        )
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        bs = self.block_size
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for state, num_tokens in zip(states, num_scheduled):
            start = state.num_computed_tokens
            # The query is [known tokens not computed yet, *drafts]; drafts are not in token_ids.
            drafts = spec_tokens.get(state.req_id, [])
            input_ids.extend(state.token_ids[start : start + num_tokens - len(drafts)])
            input_ids.extend(drafts)
            span = range(start, start + num_tokens)
            positions.extend(span)
            block_ids = state.block_ids
            slot_mapping.extend(block_ids[p // bs] * bs + p % bs for p in span)
            query_start_loc.append(query_start_loc[-1] + num_tokens)
        context_lens = [s.num_computed_tokens for s in states]
        seq_lens = [c + n for c, n in zip(context_lens, num_scheduled)]
        num_decodes = sum(1 for n in num_scheduled if n == 1)
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in states]

        device = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            seq_lens=seq_lens,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_table=torch.tensor(block_table, dtype=torch.int64, device=device),
            decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int64, device=device),
            kv_caches=self.kv_caches,
        )
        input_ids_t = torch.tensor(input_ids, dtype=torch.int64, device=device)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
        with forward_context(meta):
            hidden_states = self.model(input_ids_t, positions_t)

        output = ModelRunnerOutput()
        self._compute_prompt_logprobs(states, num_scheduled, query_start_loc, hidden_states, output)

        # Rows that sample: requests whose every known token now has KV (mid-prompt chunks don't).
        sample_rows = [
            i for i, (s, n) in enumerate(zip(states, num_scheduled))
            if s.num_computed_tokens + n >= len(s.token_ids)
        ]
        plain_rows = [i for i in sample_rows if states[i].req_id not in spec_tokens]
        spec_rows = [i for i in sample_rows if states[i].req_id in spec_tokens]
        # Logits at each plain row's last position, then at each spec row's last k + 1 positions:
        #   query of a spec row: | known tokens | d0 ... d(k-1) |
        #   logits rows:                    |last| d0 ... d(k-1)|  (k + 1 rows: p at d0 .. bonus)
        logits_indices = [query_start_loc[i + 1] - 1 for i in plain_rows]
        for i in spec_rows:
            end = query_start_loc[i + 1]
            logits_indices.extend(range(end - len(spec_tokens[states[i].req_id]) - 1, end))
        num_rejected: dict[str, int] = {}
        if logits_indices:
            logits = self.model.compute_logits(
                hidden_states[torch.tensor(logits_indices, device=device)]
            )
            if grammar_output is not None:
                self._apply_grammar_bitmask(
                    logits, [states[i] for i in plain_rows + spec_rows], spec_tokens,
                    grammar_output,
                )
            if plain_rows:
                self._sample(logits[: len(plain_rows)], [states[i] for i in plain_rows], output)
            if spec_rows:
                num_rejected = self._verify_drafts(
                    logits[len(plain_rows) :],
                    [states[i] for i in spec_rows],
                    [spec_tokens[states[i].req_id] for i in spec_rows],
                    output,
                )
        for state, num_tokens in zip(states, num_scheduled):
            state.num_computed_tokens += num_tokens - num_rejected.get(state.req_id, 0)
        if self.proposer is not None:
            output.spec_token_ids = self.proposer.propose_batch(
                {req_id: self.requests[req_id].token_ids for req_id in output.sampled_token_ids}
            )
        return output

    def _apply_grammar_bitmask(
        self,
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

    def _verify_drafts(
        self,
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
            params_list, output_ids, prompt_ids, {}, self.model_config.eos_token_ids,
            self.model_config.vocab_size, self.device,
        )
        generators = {
            i: s.generator for i, s in enumerate(states)
            if s.generator is not None
            and s.sampling_params.sampling_type == SamplingType.RANDOM_SEED
        }
        emitted = self.rejection_sampler(logits, metadata, drafts_list, generators)

        logprobs_per_req = self._emitted_logprobs(logits, states, drafts_list, emitted)
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
        self,
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

    def _sample(
        self, logits: torch.Tensor, states: list[CachedRequestState], output: ModelRunnerOutput
    ) -> None:
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        metadata = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.output_token_ids for s in states],
            [s.token_ids[: s.num_prompt_tokens] for s in states],
            generators,
            self.model_config.eos_token_ids,
            self.model_config.vocab_size,
            self.device,
        )
        sampler_output = self.sampler(logits, metadata)
        sampled = sampler_output.sampled_token_ids.tolist()  # the step's device->host sync
        logprobs_rows = logprob_ids_rows = ranks = None
        if sampler_output.logprobs is not None:
            logprobs_rows = sampler_output.logprobs.tolist()
            logprob_ids_rows = sampler_output.logprob_token_ids.tolist()
            ranks = sampler_output.sampled_token_ranks.tolist()
        for i, (state, token_id) in enumerate(zip(states, sampled)):
            state.token_ids.append(token_id)
            state.output_token_ids.append(token_id)
            output.sampled_token_ids[state.req_id] = [token_id]
            num_logprobs = state.sampling_params.logprobs
            if num_logprobs is not None and logprobs_rows is not None:
                output.logprobs[state.req_id] = [
                    TokenLogprobs(
                        token_ids=logprob_ids_rows[i][: 1 + num_logprobs],
                        logprobs=logprobs_rows[i][: 1 + num_logprobs],
                        chosen_rank=ranks[i],
                    )
                ]

    def _compute_prompt_logprobs(
        self,
        states: list[CachedRequestState],
        num_scheduled: list[int],
        query_start_loc: list[int],
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Logprob of each prompt token given the ones before it, for the chunk computed now."""
        for i, (state, num_tokens) in enumerate(zip(states, num_scheduled)):
            num_top = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            # position p predicts prompt token p + 1; the last prompt position predicts output
            end = min(start + num_tokens, state.num_prompt_tokens - 1)
            if num_top is None or end <= start:
                continue
            offset = query_start_loc[i]
            logprobs = torch.log_softmax(
                self.model.compute_logits(hidden_states[offset : offset + end - start]), dim=-1
            )  # (N, V)
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
