"""llguidance as the structured output backend: a constraint (kind, text) -> a compiled matcher.

llguidance builds its token trie from the tokenizer's `tokenizer.json` text once per engine, turns
JSON schemas, regexes, choices and Lark grammars into one grammar format, and gives each request
a matcher that fills a token bitmask (1 bit per token id, int32 words) and consumes tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import llguidance

from pagedserve.tokenizer import Tokenizer

JSON_WHITESPACE = r"[\x20\x0A\x09]{0,16}"
"""Whitespace allowed between JSON tokens. Bounded: unbounded whitespace lets a small model
emit newlines until max_tokens (a known failure of JSON-constrained decoding)."""
MAX_ERROR_CHARS = 600
"""llguidance quotes the grammar in its messages; keep what reaches a client readable."""

_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
               "grammar": "grammar"}


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits, which bound compile and per-token mask time (fuel is
    ~50k units/ms at compile, ~14k/ms per step). Defaults except the grammar size: a request
    carries at most 256 KiB of spec text anyway."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, verbose_errors=False)


class GrammarError(ValueError):
    """A constraint that does not compile; the message says what is wrong."""


class LLGuidanceBackend:
    """Thread-safe: the tokenizer is immutable and compiling builds fresh objects."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """vocab_size: the model's logits width, which may exceed the tokenizer's id space; the
        bitmask covers it and ids past the tokenizer are never allowed."""
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError("structured outputs need the model's end-of-sequence token id")
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), eos_token=eos)
        self.vocab_size = vocab_size
        self.num_bitmask_words = (vocab_size + 31) // 32
        self.num_tokenizer_words = (self.ll_tokenizer.vocab_size + 31) // 32
        assert self.num_tokenizer_words <= self.num_bitmask_words, (
            f"tokenizer has {self.ll_tokenizer.vocab_size} ids, model logits only {vocab_size}")
        self._limits = parser_limits()

    def grammar_text(self, kind: str, text: str) -> str:
        """The llguidance grammar for a constraint; GrammarError if its syntax is wrong."""
        try:
            if kind == "json":
                json.loads(text)  # a clearer message than llguidance's for broken JSON
                return llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_pattern": JSON_WHITESPACE})
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(text)
            if kind == "choice":
                # Each choice is a Lark string literal: JSON string syntax is Lark's.
                choices = json.loads(text)
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(choice) for choice in choices))
            if kind == "grammar":
                return llguidance.grammar_from("grammar", text)
        except ValueError as error:
            raise GrammarError(self._message(kind, str(error))) from None
        raise ValueError(f"unknown constraint kind {kind!r}")

    def validate(self, kind: str, text: str) -> None:
        """Raise GrammarError unless the constraint compiles (what a 400 reports)."""
        grammar = self.grammar_text(kind, text)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer,
                                                      limits=self._limits)
        if error:
            raise GrammarError(self._message(kind, error))

    def compile(self, kind: str, text: str) -> llguidance.LLMatcher:
        """A matcher in its initial state: the cached template each request deep-copies."""
        grammar = self.grammar_text(kind, text)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0,
                                       limits=self._limits)
        if matcher.is_error():
            raise GrammarError(self._message(kind, matcher.get_error()))
        return matcher

    @staticmethod
    def _message(kind: str, error: str) -> str:
        error = " ".join(error.split())  # llguidance's messages span lines with ascii art
        if len(error) > MAX_ERROR_CHARS:
            error = error[:MAX_ERROR_CHARS] + "..."
        return f"invalid {_KIND_NAMES.get(kind, kind)}: {error}"
