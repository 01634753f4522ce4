"""The runner's half of async scheduling, without a model: a step's sampled tokens become
placeholders in the request states, the next step's input ids at those positions are filled
from the sampled-token tensor (a tensor op, no host read), and reading the output back writes
the real tokens over the placeholders. (On a GPU the same code copies through pinned memory;
tests/worker/test_cuda_graphs.py compares async and sync tokens there.)"""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.sample.sampler import SamplerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.async_output import PLACEHOLDER_TOKEN_ID, AsyncSampling
from pagedserve.worker.model_runner import CachedRequestState

CPU = torch.device("cpu")


def state(req_id: str, prompt: list[int], **params) -> CachedRequestState:
    return CachedRequestState(req_id, list(prompt), len(prompt), SamplingParams(**params),
                              ([1, 2],), num_computed_tokens=len(prompt))


def sample(sampling: AsyncSampling, states, token_ids: list[int], logprobs=None):
    """One step that samples `token_ids` (one per state); returns its async output."""
    sampling.begin_step()
    output = ModelRunnerOutput()
    sampler_output = SamplerOutput(torch.tensor(token_ids), *(logprobs or (None, None, None)))
    sampling.launch(output, states, sampler_output)
    return sampling.step_output(output)


def test_placeholders_are_filled_on_the_device_and_read_back():
    sampling = AsyncSampling(CPU)
    a, b = state("a", [10, 11, 12]), state("b", [20, 21], logprobs=1)
    logprobs = (torch.tensor([[-0.5, -0.5], [-1.0, -0.2]]), torch.tensor([[7, 7], [8, 9]]),
                torch.tensor([1, 2]))
    first = sample(sampling, [a, b], [7, 8], logprobs)
    assert a.token_ids == [10, 11, 12, PLACEHOLDER_TOKEN_ID] and a.num_placeholders == 1
    assert b.output_token_ids == [PLACEHOLDER_TOKEN_ID]
    assert not first.done and sampling.unread_output is first

    # The next step decodes both placeholders (b after a 2-token chunk of nothing else).
    sampling.begin_step()
    placeholders = sampling.placeholder_inputs([b, a], query_start_loc=[0, 1, 2])
    assert placeholders[:2] == ([0, 1], [1, 0])  # b's input is row 1 of the sampled tokens
    input_ids = torch.tensor([PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID])
    sampling.fill_placeholders(input_ids, placeholders)
    assert input_ids.tolist() == [8, 7]

    output = first.get_output()
    assert output.sampled_token_ids == {"a": [7], "b": [8]}
    assert "a" not in output.logprobs and output.logprobs["b"][0].token_ids == [8, 9]
    assert a.token_ids == [10, 11, 12, 7] and b.token_ids == [20, 21, 8]
    assert a.num_placeholders == b.num_placeholders == 0
    assert first.get_output() is output and sampling.unread_output is None


def test_a_placeholder_not_from_the_step_just_before_is_refused():
    sampling = AsyncSampling(CPU)
    a = state("a", [10, 11])
    sample(sampling, [a], [5])
    sampling.begin_step()  # a step that did not read the first one back nor sample
    sampling.begin_step()
    with pytest.raises(AssertionError, match="did not sample"):
        sampling.placeholder_inputs([a], query_start_loc=[0, 1])


def test_penalties_read_the_previous_step_back_before_sampling():
    sampling = AsyncSampling(CPU)
    plain, penalized = state("plain", [1, 2]), state("pen", [3, 4], repetition_penalty=1.2)
    first = sample(sampling, [plain], [6])
    sampling.before_sampling([plain])  # nothing reads the tokens' values: still in flight
    assert not first.done and sampling.num_early_reads == 0
    # A penalty row counts every row's tokens: the placeholder must be a real token first.
    sampling.before_sampling([plain, penalized])
    assert first.done and plain.output_token_ids == [6] and sampling.num_early_reads == 1
