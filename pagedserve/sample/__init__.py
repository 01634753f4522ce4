"""Sampling: the batch sampler and the inputs it reads; reference.py is its slow twin for tests."""

from pagedserve.sample.sampler import Sampler, SamplerOutput, SamplingMetadata

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]
