"""Fixtures the model tests share."""

from __future__ import annotations

import pytest

import pagedserve.models.llama as llama_module


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """The number of tokens of every step the compiled decoder stack runs."""
    calls = []
    real_run = llama_module.run_decoder_stack
    monkeypatch.setattr(llama_module, "run_decoder_stack",
                        lambda *args: calls.append(args[1].shape[0]) or real_run(*args))
    return calls
