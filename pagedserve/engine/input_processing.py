"""A request's input checked and made ready for the scheduler: the prompt tokenized and its ids
checked against the vocabulary, the sampling parameters copied, checked and completed. Each
raises ValueError naming what is wrong, before anything is queued."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import Tokenizer

PromptType = str | Sequence[int] | dict[str, Any]
"""A string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}."""


def tokenize_prompt(prompt: PromptType, tokenizer: Tokenizer,
                    vocab_size: int) -> tuple[str | None, list[int]]:
    """(the prompt's text or None for token ids, its token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        text, token_ids = prompt, tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
    if not token_ids:
        raise ValueError("prompt must not be empty")
    for token_id in token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise ValueError(f"prompt token ids must be integers, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return text, token_ids


def checked_sampling_params(params: SamplingParams | None, num_prompt_tokens: int,
                            tokenizer: Tokenizer, vocab_size: int,
                            max_model_len: int) -> SamplingParams:
    """A checked copy of a generation request's params (the defaults for None): bad words
    tokenized, max_tokens filled in with what the context length leaves."""
    params = (params or SamplingParams()).clone()
    if params.bad_words:
        params.tokenize_bad_words(lambda text: tokenizer.encode(text, add_special_tokens=False))
    params.validate_for_vocab(vocab_size)
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens; the context length is "
            f"{max_model_len} (prompt plus at least one new token must fit)"
        )
    if params.max_tokens is None:
        params.max_tokens = max_model_len - num_prompt_tokens
    return params
