"""`pagedserve bench perplexity`: the quality side of a speed setting. A model's perplexity on a
text, teacher-forced, and how far each token's logprob sits from a reference engine's, so that a
weight form, an activation quantization or a KV dtype is judged by one command (llama.cpp's
`llama-perplexity` measures the same quantity).

The text (`--text`, one or more files; default: the calibration text shipped in the package,
which also chooses the int8 layers' outlier channels) is tokenized whole and cut into windows of
`--window` tokens, at most `--max-tokens` in all. Each window is one request with
`prompt_logprobs`; every token of it but the first is scored given those before it in the
window. `--reference exact` (the default) loads the same model a second time as the exact
engine, fp32 with the activations unquantized (`--activation-quantization none`: the GGUF's
dequantized values, up to summation order) and fp32 KV, and reports it beside the engine under
test:

    pagedserve bench perplexity --model gemma3-270m --text tests/data/*.txt

The engine under test takes every engine flag (`--dtype`, `--activation-quantization`,
`--kv-cache-dtype`, ...), as `pagedserve serve` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
from collections.abc import Callable
from typing import Any

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.layers.outliers import calibration_text
from pagedserve.sampling_params import SamplingParams

REFERENCES = ("exact", "none")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="text files, read in order as one text (default: the package's "
                             "calibration text)")
    parser.add_argument("--window", type=int, default=256,
                        help="tokens per scored sequence (default: 256)")
    parser.add_argument("--max-tokens", type=int, default=2048,
                        help="tokens of the text used at most (default: 2048)")
    parser.add_argument("--reference", choices=REFERENCES, default="exact",
                        help="exact: also score the text on the exact fp32 engine and compare "
                             "(default); none: the engine under test alone")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    EngineArgs.add_cli_args(parser)


def teacher_forced_logprobs(llm, sequences: list[list[int]], start: list[int]
                            ) -> list[list[float]]:
    """Per sequence: the logprob of each of its tokens from index start[i] on, given all the
    tokens before it (one request per sequence, with prompt_logprobs)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in sequences], params)
    return [[out.prompt_logprobs[i][ids[i]].logprob for i in range(first, len(ids))]
            for ids, first, out in zip(sequences, start, outputs)]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def read_text(paths: list[str] | None) -> str:
    if not paths:
        return calibration_text()
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    return "\n".join(texts)


def windows(token_ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """The text's first max_tokens tokens in windows of `window` (the last may be shorter; one of
    a single token, which scores nothing, is dropped)."""
    if window < 2 or max_tokens < 2:
        raise ValueError(f"--window and --max-tokens must be at least 2, got {window} and "
                         f"{max_tokens}")
    ids = token_ids[:max_tokens]
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def _score(engine_args: EngineArgs, sequences_for: Callable[[Any], list[list[int]]]
           ) -> tuple[list[list[int]], list[float]]:
    """(the sequences, every scored token's logprob) on one engine, built and released here;
    sequences_for(the engine's tokenizer) gives the sequences."""
    llm = LLM(**vars(engine_args))
    sequences = sequences_for(llm.engine.tokenizer)
    if not sequences:
        raise ValueError("the text has fewer than 2 tokens")
    window_logprobs = teacher_forced_logprobs(llm, sequences, [1] * len(sequences))
    llm.engine.assert_idle()
    del llm
    gc.collect()
    return sequences, [logprob for scored in window_logprobs for logprob in scored]


def exact_engine_args(engine_args: EngineArgs) -> EngineArgs:
    """The reference: the same model and engine flags, fp32, activations unquantized, the KV
    cache in fp32 (auto would keep fp16 codes on an fp32 engine)."""
    return dataclasses.replace(engine_args, dtype="float32", activation_quantization="none",
                               kv_cache_dtype="fp32")


def main(args: argparse.Namespace) -> dict:
    engine_args = EngineArgs.from_cli_args(args)
    text = read_text(args.text)
    sequences, logprobs = _score(
        engine_args, lambda tokenizer: windows(tokenizer.encode(text), args.window,
                                               args.max_tokens))
    result = {"model": engine_args.model, "tokens_scored": len(logprobs),
              "windows": len(sequences), "window": args.window,
              "perplexity": perplexity(logprobs)}
    if args.reference == "exact":
        _, exact = _score(exact_engine_args(engine_args), lambda _: sequences)
        result.update({
            "exact_perplexity": perplexity(exact),
            "perplexity_vs_exact": perplexity(logprobs) / perplexity(exact) - 1,
            "mean_abs_logprob_drift": sum(abs(a - b) for a, b in zip(logprobs, exact))
            / len(logprobs),
        })
    print(format_result(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_result(result: dict) -> str:
    lines = [(f"model {result['model']}: {result['tokens_scored']} tokens scored in "
              f"{result['windows']} windows of up to {result['window']}"),
             f"perplexity                     {result['perplexity']:.4f}"]
    if "exact_perplexity" in result:
        lines += [f"exact fp32 engine's perplexity {result['exact_perplexity']:.4f}",
                  f"perplexity against exact      {100 * result['perplexity_vs_exact']:+.2f}%",
                  f"mean |logprob drift| (nats)    {result['mean_abs_logprob_drift']:.4f}"]
    return "\n".join(lines)
