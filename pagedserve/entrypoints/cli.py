"""The `pagedserve` command: serve, run-batch, generate, chat, router, bench.

Environment variables and flags are read here and nowhere deeper: the engine gets configs.
"""

from __future__ import annotations

import argparse
import sys

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.vllm_flags import OneLineErrorParser, parse_args_or_exit
from pagedserve.executor import ExecutorError


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine.from_engine_args(EngineArgs.from_cli_args(args)))
    params = _sampling_params(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        if len(args.prompt) > 1:
            print(f"### {prompt!r}")
        print(completion.text if args.chat else prompt + completion.text)
        ttft = output.metrics.time_to_first_token or 0.0
        print(
            f"[{len(completion.token_ids)} tokens, finish={completion.finish_reason}, "
            f"cached={output.num_cached_tokens}, ttft={ttft * 1000:.0f} ms]",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.outputs import OutputKind

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    params = _sampling_params(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("pagedserve chat: empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> " if interactive else "")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        try:
            engine.add_request(
                None,
                {"prompt_token_ids": engine.tokenizer.encode(prompt, add_special_tokens=False)},
                params,
                output_kind=OutputKind.DELTA,
            )
        except ValueError as error:  # e.g. the conversation outgrew the context
            print(f"error: {error}", file=sys.stderr)
            messages.pop()
            continue
        reply = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                delta = output.outputs[0].text
                reply.append(delta)
                print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from pagedserve.benchmarks import throughput

    throughput.main(args)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pagedserve.benchmarks import serve

    serve.main(args)
    return 0


def _add_generate(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--prompt", action="append", required=True, help="repeatable")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn")
    _add_sampling_args(parser, max_tokens=64)
    parser.set_defaults(func=cmd_generate)


def _add_chat(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(parser, max_tokens=512)
    parser.set_defaults(func=cmd_chat)


def _add_serve(parser: argparse.ArgumentParser) -> None:
    from pagedserve.entrypoints.openai import api_server

    api_server.add_cli_args(parser)
    parser.set_defaults(func=api_server.run_server)


def _add_run_batch(parser: argparse.ArgumentParser) -> None:
    from pagedserve.entrypoints import run_batch

    run_batch.add_cli_args(parser)
    parser.set_defaults(func=run_batch.main)


def _add_router(parser: argparse.ArgumentParser) -> None:
    from pagedserve.router import cli as router_cli

    router_cli.add_cli_args(parser)
    parser.set_defaults(func=router_cli.run_router)


def _add_bench(parser: argparse.ArgumentParser) -> None:
    from pagedserve.benchmarks import (
        attention,
        collectives,
        decode_attention,
        matmul,
        peak,
        perplexity,
        throughput,
    )
    from pagedserve.benchmarks import lora as lora_bench
    from pagedserve.benchmarks import serve as serve_bench

    bench_commands = parser.add_subparsers(dest="bench_command", required=True)
    throughput_parser = bench_commands.add_parser("throughput", help="offline throughput")
    throughput.add_cli_args(throughput_parser)
    throughput_parser.set_defaults(func=cmd_bench_throughput)
    serve_bench_parser = bench_commands.add_parser(
        "serve", help="load any OpenAI-compatible server and measure TTFT, ITL, throughput"
    )
    serve_bench.add_cli_args(serve_bench_parser)
    serve_bench_parser.set_defaults(func=cmd_bench_serve)
    lora_parser = bench_commands.add_parser(
        "lora", help="throughput with 0, 1, 4, 8 LoRA adapters against no LoRA; load latency")
    lora_bench.add_cli_args(lora_parser)
    lora_parser.set_defaults(func=lambda args: lora_bench.main(args) or 0)
    collectives_parser = bench_commands.add_parser(
        "collectives", help="time torch.distributed all-reduce and send/recv between processes"
    )
    collectives.add_cli_args(collectives_parser)
    collectives_parser.set_defaults(func=collectives.main)
    matmul_parser = bench_commands.add_parser(
        "matmul", help="one layer on its GGUF codes by activation mode against the dense matmul")
    matmul.add_cli_args(matmul_parser)
    matmul_parser.set_defaults(func=matmul.main)
    peak_parser = bench_commands.add_parser(
        "peak", help="the machine's limits: dot-product and FMA throughput, read bandwidth")
    peak.add_cli_args(peak_parser)
    peak_parser.set_defaults(func=peak.main)
    attention_parser = bench_commands.add_parser(
        "attention", help="one request's prefill attention: the compiled kernel against torch's")
    attention.add_cli_args(attention_parser)
    attention_parser.set_defaults(func=attention.main)
    decode_attention_parser = bench_commands.add_parser(
        "decode-attention", help="a decode step's attention over a model's layers: the "
                                 "compiled kernel against torch's")
    decode_attention.add_cli_args(decode_attention_parser)
    decode_attention_parser.set_defaults(func=decode_attention.main)
    perplexity_parser = bench_commands.add_parser(
        "perplexity", help="a model's perplexity on a text, and its drift from the exact engine")
    perplexity.add_cli_args(perplexity_parser)
    perplexity_parser.set_defaults(func=lambda args: 0 if perplexity.main(args) else 1)


COMMANDS = {
    "generate": ("complete prompts and print the results", _add_generate),
    "chat": ("interactive chat that streams the reply", _add_chat),
    "serve": ("serve the OpenAI-compatible HTTP API", _add_serve),
    "run-batch": ("run an OpenAI batch file (JSONL) through the engine, no server",
                  _add_run_batch),
    "router": ("route OpenAI API requests across servers", _add_router),
    "bench": ("benchmarks", _add_bench),
}
"""command -> (help, the function that adds its arguments)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (command given) only that command's arguments: the others'
    modules (the router, the benchmarks) are then not imported, which `serve` would otherwise
    pay for at every start."""
    parser = OneLineErrorParser(prog="pagedserve", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments) in COMMANDS.items():
        subparser = commands.add_parser(name, help=help_text, allow_abbrev=False)
        if command is None or command == name:
            add_arguments(subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = parse_args_or_exit(build_parser(command), argv)
    try:
        return args.func(args)
    except (ValueError, ExecutorError) as error:  # bad input, or workers that did not start
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
