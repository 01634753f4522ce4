"""Benchmark prompts, shared by the offline (throughput.py) and online (serve.py) benchmarks.

random: unique random prompts, so no prefix cache helps. doc-qa: a few long shared documents,
each followed by many short questions, so the prefix cache serves the documents. Prompts are token
ids drawn from a seeded RNG, or words where no tokenizer is at hand. Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

NUM_SPECIAL_MARGIN = 100
"""Random prompt ids avoid the first and last this-many vocab ids, where special tokens sit."""

# Common English words, each one token (with its leading space) in typical BPE vocabularies,
# so a prompt of N words is about N tokens for a server whose tokenizer we do not have.
WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his he it an were are which this be
or has had first one their its new after but who not they have her she two been other when
there all during into school time may years more most only over city some world would where
later up such used many can state about national out known university united then made year
part since back three people world house long high work night water light music river game
""".split()))

T = TypeVar("T")


@dataclass
class Workload:
    prompt_token_ids: list[list[int]]
    output_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=("random", "doc-qa"), default="random",
                       help="random: unique random-token prompts; doc-qa: shared documents "
                            "plus short questions (exercises the prefix cache)")
    group.add_argument("--num-prompts", type=int, default=32,
                       help="random: prompts to send; doc-qa: used only to derive "
                            "--questions-per-doc when that is not given")
    group.add_argument("--input-len", type=int, default=200, help="random: tokens per prompt")
    group.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt")
    group.add_argument("--num-docs", type=int, default=2, help="doc-qa: shared documents")
    group.add_argument("--doc-len", type=int, default=1000, help="doc-qa: tokens per document")
    group.add_argument("--questions-per-doc", type=int, default=None,
                       help="doc-qa: questions per document (default: num-prompts / num-docs)")
    group.add_argument("--question-len", type=int, default=32, help="doc-qa: tokens per question")
    group.add_argument("--quote-len", type=int, default=0,
                       help="doc-qa: end each question with this many tokens quoted from a random "
                            "place of its document, so answers tend to continue the quote (what "
                            "n-gram speculation feeds on); 0: no quote")


def validate_dataset_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len", "num_docs", "doc_len", "question_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.quote_len <= args.doc_len:
        raise ValueError(f"--quote-len must be in [0, --doc-len], got {args.quote_len}")
    if args.questions_per_doc is not None and args.questions_per_doc < 1:
        raise ValueError(f"--questions-per-doc must be >= 1, got {args.questions_per_doc}")


def num_questions_per_doc(args: argparse.Namespace) -> int:
    """doc-qa: --questions-per-doc, else --num-prompts spread over the documents."""
    return args.questions_per_doc or max(1, args.num_prompts // args.num_docs)


def _make_prompts(
    args: argparse.Namespace, sample: Callable[[int], list[T]], rng: random.Random
) -> list[list[T]]:
    """Prompts of `sample(n)` units (token ids or words), shaped by args.dataset."""
    if args.dataset == "random":
        # Unique per prompt with overwhelming probability; the first token alone makes a clash
        # of two 200-token prompts a 1-in-49k event, so nothing hits the prefix cache.
        return [sample(args.input_len) for _ in range(args.num_prompts)]
    questions_per_doc = num_questions_per_doc(args)
    docs = [sample(args.doc_len) for _ in range(args.num_docs)]
    # Interleaved (q0 of d0, q0 of d1, q1 of d0, ...) so each document's prefix is reused
    # across requests that arrive between other documents' requests.
    def question(doc: list[T]) -> list[T]:
        if not args.quote_len:
            return sample(args.question_len)
        start = rng.randrange(len(doc) - args.quote_len + 1)
        return sample(args.question_len) + doc[start : start + args.quote_len]

    return [doc + question(doc) for _ in range(questions_per_doc) for doc in docs]


def split_first_questions(workload: Workload, num_docs: int) -> tuple[Workload, Workload]:
    """doc-qa: (each document's first question, every later question), in workload order.

    The prompts are interleaved by question (q0 of d0, q0 of d1, q1 of d0, ...), so the first
    num_docs prompts are the first questions."""
    first, repeats = workload.prompt_token_ids[:num_docs], workload.prompt_token_ids[num_docs:]
    return Workload(first, workload.output_len), Workload(repeats, workload.output_len)


def make_workload(args: argparse.Namespace, vocab_size: int, seed: int | None = None) -> Workload:
    """Prompt token ids from an RNG seeded with `seed` (default args.seed) over ordinary
    (non-special) vocab ids."""
    validate_dataset_args(args)
    low, high = NUM_SPECIAL_MARGIN, vocab_size - NUM_SPECIAL_MARGIN
    if high <= low:
        raise ValueError(f"vocab_size {vocab_size} is too small for random prompts")
    rng = random.Random(args.seed if seed is None else seed)

    def random_ids(num_tokens: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(num_tokens)]

    return Workload(_make_prompts(args, random_ids, rng), args.output_len)


def make_text_prompts(args: argparse.Namespace, seed: int) -> list[str]:
    """The same shapes as make_workload, in random common words (about one token each): for
    servers whose tokenizer is not available here."""
    validate_dataset_args(args)
    rng = random.Random(seed)

    def random_words(num_words: int) -> list[str]:
        return rng.choices(WORDS, k=num_words)

    return [" ".join(words) for words in _make_prompts(args, random_words, rng)]
