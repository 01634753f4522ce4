"""What one request asks of the sampler, validated once where the request enters the engine.

Names and defaults follow vLLM's SamplingParams so OpenAI-style requests map field for field.
Pure Python, no torch: the scheduler and the API server import it. The sampler turns a batch of
these into tensors (sample/sampler.py, SamplingMetadata.build).
"""

from __future__ import annotations

import copy
import json as _json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy: the limit of softmax(logits / t) as t -> 0 is the argmax."""
MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for, per generated or prompt token (OpenAI's cap)."""
MAX_ABS_LOGIT_BIAS = 100.0
"""OpenAI's range for logit_bias values: [-100, 100]."""
_SEED_RANGE = (-(2**63), 2**64 - 1)
"""What torch.Generator.manual_seed accepts."""


MAX_STRUCTURED_SPEC_CHARS = 256 * 1024
"""Largest schema, regex or grammar text a request may carry (its JSON text for a schema)."""
MAX_CHOICES = 1024
"""Most strings a `choice` constraint may list."""
MAX_BAD_WORDS = 128
"""Most strings a request's `bad_words` may list."""


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one field is set.

    Pure data, checked for shape here; whether a schema, regex or grammar compiles is checked by
    the structured output backend (structured_output/backend.py), which needs the tokenizer.
    """

    json: dict | str | None = None
    """A JSON schema (a dict or its JSON text): the output is one JSON value that validates."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    regex: str | None = None
    """The whole output matches this regular expression (Rust `regex` syntax)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect) or a GBNF/EBNF one; the output is a sentence of it."""

    def __post_init__(self) -> None:
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, "
                             f"choice and grammar, got {given or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, (dict, str)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object or its "
                                 f"text, got {type(self.json).__name__}")
            if isinstance(self.json, str) and not self.json.strip():
                raise ValueError("structured_outputs.json must not be empty")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"structured_outputs.{name} must be a string")
                if not value.strip():
                    raise ValueError(f"structured_outputs.{name} must not be empty")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                                 "strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(self.choice)} strings; at "
                                 f"most {MAX_CHOICES} are allowed")
            self.choice = list(self.choice)
        _, text = self.spec()
        if len(text) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(f"structured_outputs is {len(text)} characters; at most "
                             f"{MAX_STRUCTURED_SPEC_CHARS} are allowed")

    def spec(self) -> tuple[str, str]:
        """(kind, text): the constraint as a hashable key, also what the backend compiles.

        kind is "json", "regex", "choice" or "grammar"; a schema dict becomes its canonical JSON
        text (sorted keys) so equal schemas share one compiled grammar."""
        if self.json is not None:
            if isinstance(self.json, str):
                return "json", self.json
            try:
                return "json", _json.dumps(self.json, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError) as error:
                raise ValueError(f"structured_outputs.json is not JSON-serializable: {error}"
                                 ) from None
        if self.json_object:
            return "json", '{"type":"object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        assert self.grammar is not None
        return "grammar", self.grammar


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    """Random, from the request's own generator: independent of the rest of the batch."""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, for one request.

    A plain mutable dataclass: the engine fills max_tokens when it is None. Validated in
    __post_init__; token ids against a vocabulary only in validate_for_vocab (the vocabulary is
    not known here).
    """

    n: int = 1
    """Completions to generate for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; below SAMPLING_EPS (e.g. 0) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens until their mass reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep only the top_k most likely tokens (0 = off; -1 is accepted and stored as 0)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely token (0 = off)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI)."""
    repetition_penalty: float = 1.0
    """Divides positive and multiplies negative logits of tokens in the prompt or output (HF;
    1 = off)."""
    seed: int | None = None
    """Seed for this request's own random stream; None uses the engine's shared stream."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation. A single string or None is accepted and stored as a list."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation, besides eos. None is accepted and stored as []."""
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the context limit (the engine fills it in)."""
    min_tokens: int = 0
    """Forbid eos and stop_token_ids until this many tokens have been generated."""
    logprobs: int | None = None
    """Top logprobs to return per generated token besides the sampled one's (0: sampled only)."""
    prompt_logprobs: int | None = None
    """Top logprobs to return per prompt token besides the actual token's (0: actual only)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling. String keys of digits (as OpenAI
    JSON sends them) are accepted and stored as ints; an empty dict is stored as None."""
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (None: free text). A dict
    is accepted and stored as StructuredOutputsParams."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (None: all). An empty list is refused."""
    bad_words: list[str] = field(default_factory=list)
    """Words never to generate, as vLLM defines them: each is tokenized with and without a
    leading space, and the last token of such a sequence is banned whenever the tokens generated
    just before it equal the rest of the sequence (tokenize_bad_words fills the ids)."""
    bad_words_token_ids: list[list[int]] | None = None
    """The token sequences of bad_words; set by tokenize_bad_words (the engine calls it on
    entry, since only it has the tokenizer)."""

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _require_number(name, getattr(self, name))

        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        # Written as "not (in range)" so that NaN, which fails every comparison, is rejected too.
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalize_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _normalize_bad_words(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs has unknown keys {sorted(unknown)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def all_stop_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """Token ids that end this request: stop_token_ids, plus the model's eos unless ignore_eos.
        """
        stop_ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            stop_ids.update(eos_token_ids)
        return stop_ids

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id this request names lies outside [0, vocab_size)."""
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"stop_token_ids has {token_id}, outside the vocabulary [0, {vocab_size})"
                )
        for token_id in self.logit_bias or ():
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"logit_bias has token id {token_id}, outside the vocabulary [0, {vocab_size})"
                )
        for token_id in self.allowed_token_ids or ():
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"allowed_token_ids has {token_id}, outside the vocabulary "
                                 f"[0, {vocab_size})")
        for sequence in self.bad_words_token_ids or ():
            if not all(0 <= token_id < vocab_size for token_id in sequence):
                raise ValueError(f"bad_words tokenize to {sequence}, outside the model's "
                                 f"vocabulary [0, {vocab_size})")

    def tokenize_bad_words(self, encode: Callable[[str], list[int]]) -> None:
        """Fill bad_words_token_ids from bad_words with `encode` (text -> ids, no special tokens).

        As vLLM does: each word is tried bare and with one leading space (a word mid-sentence is
        usually its space-prefixed token), keeping each distinct non-empty sequence."""
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                token_ids = encode(variant)
                if token_ids and token_ids not in sequences:
                    sequences.append(token_ids)
        self.bad_words_token_ids = sequences or None

    def clone(self) -> SamplingParams:
        """A deep copy: each of a request's n completions may get its own (e.g. a derived seed)."""
        return copy.deepcopy(self)


def _require_int(name: str, value: object) -> None:
    # bool is an int subclass; `max_tokens=True` is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _require_number(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for text in stop:
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop must contain only non-empty strings, got {text!r}")
    return list(stop)


def _normalize_stop_token_ids(stop_token_ids: object) -> list[int]:
    if stop_token_ids is None:
        return []
    if not isinstance(stop_token_ids, (list, tuple, set)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {stop_token_ids!r}")
    for token_id in stop_token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"stop_token_ids must contain only ints >= 0, got {token_id!r}")
    return list(stop_token_ids)


def _normalize_logit_bias(logit_bias: object) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}")
    normalized: dict[int, float] = {}
    for key, bias in logit_bias.items():
        # OpenAI JSON objects can only have string keys: {"50256": -100}.
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token_id = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token_id = key
        else:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if token_id in normalized:
            raise ValueError(f"logit_bias has token id {token_id} twice")
        if (not isinstance(bias, (int, float)) or isinstance(bias, bool)
                or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
            raise ValueError(
                f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                f"for token {token_id}"
            )
        normalized[token_id] = float(bias)
    return normalized or None


def _normalize_allowed_token_ids(allowed_token_ids: object) -> list[int] | None:
    if allowed_token_ids is None:
        return None
    if not isinstance(allowed_token_ids, (list, tuple, set)) or not allowed_token_ids:
        raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                         f"{allowed_token_ids!r}")
    for token_id in allowed_token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"allowed_token_ids must contain only ints >= 0, got {token_id!r}")
    return sorted(set(allowed_token_ids))


def _normalize_bad_words(bad_words: object) -> list[str]:
    if bad_words is None:
        return []
    if not isinstance(bad_words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {bad_words!r}")
    if len(bad_words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words has {len(bad_words)} strings; at most {MAX_BAD_WORDS} are "
                         "allowed")
    for word in bad_words:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words must contain only non-blank strings, got {word!r}")
    return list(bad_words)
