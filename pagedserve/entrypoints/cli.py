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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="pagedserve", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts and print the results")
    EngineArgs.add_cli_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="repeatable")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn")
    _add_sampling_args(generate, max_tokens=64)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat that streams the reply")
    EngineArgs.add_cli_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                allow_abbrev=False)
    from pagedserve.entrypoints.openai import api_server

    api_server.add_cli_args(serve)
    serve.set_defaults(func=api_server.run_server)

    run_batch = commands.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) through the engine, no server")
    from pagedserve.entrypoints import run_batch as run_batch_module

    run_batch_module.add_cli_args(run_batch)
    run_batch.set_defaults(func=run_batch_module.main)

    router = commands.add_parser("router", help="route OpenAI API requests across servers")
    from pagedserve.router import cli as router_cli

    router_cli.add_cli_args(router)
    router.set_defaults(func=router_cli.run_router)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    throughput_parser = bench_commands.add_parser("throughput", help="offline throughput")
    from pagedserve.benchmarks import throughput

    throughput.add_cli_args(throughput_parser)
    throughput_parser.set_defaults(func=cmd_bench_throughput)
    serve_bench_parser = bench_commands.add_parser(
        "serve", help="load any OpenAI-compatible server and measure TTFT, ITL, throughput"
    )
    from pagedserve.benchmarks import serve as serve_bench

    serve_bench.add_cli_args(serve_bench_parser)
    serve_bench_parser.set_defaults(func=cmd_bench_serve)
    lora_parser = bench_commands.add_parser(
        "lora", help="throughput with 0, 1, 4, 8 LoRA adapters against no LoRA; load latency")
    from pagedserve.benchmarks import lora as lora_bench

    lora_bench.add_cli_args(lora_parser)
    lora_parser.set_defaults(func=lambda args: lora_bench.main(args) or 0)
    collectives_parser = bench_commands.add_parser(
        "collectives", help="time torch.distributed all-reduce and send/recv between processes"
    )
    from pagedserve.benchmarks import collectives

    collectives.add_cli_args(collectives_parser)
    collectives_parser.set_defaults(func=collectives.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args_or_exit(build_parser(), argv)
    try:
        return args.func(args)
    except (ValueError, ExecutorError) as error:  # bad input, or workers that did not start
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
