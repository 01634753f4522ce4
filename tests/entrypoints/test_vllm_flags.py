"""vLLM's serve flags at the parser: each one in the table is accepted or refused as the table
says, lands where it should in the configs, and the docs table is the code's. No server runs."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys

import pytest

from pagedserve.engine.arg_utils import EngineArgs, resolve_dtype
from pagedserve.entrypoints import vllm_flags
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.api_server import ServerConfig
from pagedserve.entrypoints.openai.frontend_options import load_chat_template
from pagedserve.entrypoints.vllm_flags import VLLM_SERVE_FLAGS, Support, parse_args_or_exit

REPO = pathlib.Path(__file__).resolve().parents[2]


def parse_serve(*flags: str):
    return parse_args_or_exit(build_parser(), ["serve", *flags])


def test_docs_table_is_the_code_table():
    docs = (REPO / vllm_flags.DOCS_PATH).read_text(encoding="utf-8")
    assert vllm_flags.render_markdown() in docs, (
        "docs/vllm_compatibility.md is stale: run python -m pagedserve.entrypoints.vllm_flags")
    assert "docs/vllm_compatibility.md" in (REPO / "README.md").read_text(encoding="utf-8")


def test_table_names_each_flag_once():
    names = [flag.name for flag in VLLM_SERVE_FLAGS]
    assert len(names) == len(set(names))
    assert all(name.startswith("--") for name in names)


@pytest.mark.parametrize("flag", [f for f in VLLM_SERVE_FLAGS if f.support is not Support.UNSUPPORTED],
                         ids=lambda f: f.name)
def test_accepted_vllm_flag_parses(flag):
    for spelling in filter(None, (flag.name, flag.short)):
        args = parse_serve(spelling, *flag.example)
        assert args.command == "serve"


@pytest.mark.parametrize("flag", [f for f in VLLM_SERVE_FLAGS if f.support is Support.UNSUPPORTED],
                         ids=lambda f: f.name)
def test_unsupported_vllm_flag_is_one_line_exit_2(flag, capsys):
    for spelling in filter(None, (flag.name, flag.short)):
        with pytest.raises(SystemExit) as exit_info:
            parse_serve(spelling, "x")
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err == (f"pagedserve serve: vLLM flag {spelling} is not supported by pagedserve "
                       "(see docs/vllm_compatibility.md)\n")


@pytest.mark.parametrize("argv, message", [
    (["--no-enable-log-outputs"], "vLLM flag --no-enable-log-outputs is not supported"),
    (["--cpu-offload-gb=4"], "vLLM flag --cpu-offload-gb is not supported"),
    (["--foo", "1"], "error: unknown flag --foo (see pagedserve serve --help)"),
    (["--max-model"], "error: unknown flag --max-model"),  # no abbreviations
    (["--dtype", "fp8"], "error: argument --dtype: invalid choice"),
])
def test_bad_flags_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_serve(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "usage:" not in err


def test_cli_process_refuses_a_vllm_flag_before_loading_anything():
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--cpu-offload-gb", "4"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr == ("pagedserve serve: vLLM flag --cpu-offload-gb is not supported by "
                             "pagedserve (see docs/vllm_compatibility.md)\n")


def test_engine_flags_land_in_engine_args():
    args = parse_serve("--model", "some-model", "--max-model-len", "1024",
                       "--kv-cache-memory-bytes", "64MiB", "--gpu-memory-utilization", "0.5",
                       "--dtype", "auto", "--seed", "7", "-tp", "2", "-pp", "1",
                       "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                       "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                       "--block-size", "32", "-q", "gguf", "--tokenizer", "some-model",
                       "--kv-cache-dtype", "fp8_e4m3", "--enable-lora", "--max-loras", "2",
                       "--max-lora-rank", "8",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.model, engine_args.max_model_len, engine_args.kv_cache_memory) == (
        "some-model", 1024, "64MiB")
    assert engine_args.gpu_memory_utilization == 0.5
    assert (engine_args.dtype, engine_args.seed, engine_args.quantization) == ("auto", 7, "gguf")
    assert (engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size) == (2, 1)
    assert (engine_args.max_num_seqs, engine_args.max_num_batched_tokens) == (8, 512)
    assert not engine_args.enable_prefix_caching and not engine_args.enable_chunked_prefill
    assert engine_args.block_size == 32 and engine_args.kv_cache_dtype == "fp8_e4m3"
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_lora_rank) == (
        True, 2, 8)
    assert engine_args.speculative_config.startswith('{"method": "ngram"')


def test_positional_model_wins_over_model_flag():
    from pagedserve.entrypoints.openai.api_server import model_arg

    assert model_arg(parse_serve("--model", "a", "b")) == "b"
    assert model_arg(parse_serve("b", "--model", "a")) == "b"
    assert model_arg(parse_serve("--model", "a")) == "a"


def test_vllm_spellings_map_to_engine_config(model_path, caplog, tmp_path):
    args = EngineArgs(model=model_path, tokenizer=model_path, dtype="float", quantization="gguf",
                      kv_cache_dtype="fp8_e4m3", kv_cache_memory="64MiB",
                      gpu_memory_utilization=0.5)
    with caplog.at_level(logging.WARNING):
        config = args.create_engine_config()
    assert config.device.dtype == "float32" and config.device.quantization == "auto"
    assert config.cache.cache_dtype == "fp8"
    # On the CPU the fraction is ignored, with a warning: the pool keeps its byte size.
    assert config.cache.kv_cache_memory_bytes == 64 << 20
    assert config.cache.gpu_memory_utilization is None
    assert "--gpu-memory-utilization is ignored on the CPU" in caplog.text
    assert EngineArgs(model=model_path).create_engine_config().cache.kv_cache_memory_bytes == 2 << 30
    other = tmp_path / "other-tokenizer"  # any existing path that is not the model
    other.mkdir()
    with pytest.raises(ValueError, match=f"--tokenizer '{other}' is not the model"):
        EngineArgs(model=model_path, tokenizer=str(other)).create_engine_config()


def test_server_flags_land_in_server_config(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{{ messages[0]['content'] }}")
    args = parse_serve(
        "m", "--served-model-name", "first", "second", "--root-path", "/llm",
        "--allowed-origins", '["http://app.example"]', "--allowed-methods", '["POST"]',
        "--allowed-headers", '["Authorization"]', "--allow-credentials",
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-cert-reqs", "1",
        "--uvicorn-log-level", "trace", "--disable-uvicorn-access-log", "--disable-fastapi-docs",
        "--chat-template", str(template_file), "--trust-request-chat-template",
        "--default-chat-template-kwargs", '{"enable_thinking": false}', "--max-logprobs", "3",
        "--return-tokens-as-token-ids", "--enable-log-requests", "--max-log-len", "50",
        "--api-key", "k")
    config = ServerConfig.from_cli_args(args)
    assert config.served_model_name == "first"
    assert config.frontend.served_model_aliases == ("second",)
    assert config.root_path == "/llm"
    assert (config.cors_allowed_origins, config.cors_allowed_methods,
            config.cors_allowed_headers, config.cors_allow_credentials) == (
        ("http://app.example",), ("POST",), ("Authorization",), True)
    assert (config.ssl_keyfile, config.ssl_certfile, config.ssl_cert_reqs) == (
        str(key), str(cert), 1)
    assert (config.uvicorn_log_level, config.disable_uvicorn_access_log,
            config.disable_fastapi_docs) == ("trace", True, True)
    frontend = config.frontend
    assert frontend.chat_template == "{{ messages[0]['content'] }}"
    assert frontend.trust_request_chat_template
    assert frontend.template_kwargs({"x": 1}) == {"enable_thinking": False, "x": 1}
    assert frontend.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}
    assert frontend.max_logprobs == 3 and frontend.return_tokens_as_token_ids
    assert config.enable_log_requests and config.max_log_len == 50
    assert config.api_key == "k"
    # Defaults: CORS off, request logging off (as vLLM), the model's own template.
    default = ServerConfig.from_cli_args(parse_serve())
    assert default.cors_allowed_origins is None and not default.enable_log_requests
    assert default.frontend.chat_template is None and default.frontend.max_logprobs == 20
    assert not ServerConfig.from_cli_args(
        parse_serve("--enable-log-requests", "--disable-log-requests")).enable_log_requests


@pytest.mark.parametrize("argv, message", [
    (["--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", "/nonexistent/c.pem"],
     "--ssl-keyfile '/nonexistent/key.pem': no such file"),
    (["--chat-template", "/nonexistent/template.jinja"], "looks like a file path"),
    (["--max-logprobs", "21"], "--max-logprobs must be in [0, 20]"),
    (["--root-path", "llm/"], "--root-path must start with /"),
])
def test_bad_server_flag_values_fail_before_the_model_loads(argv, message):
    with pytest.raises(ValueError) as error:
        ServerConfig.from_cli_args(parse_serve(*argv))
    assert message in str(error.value)


def test_inline_chat_template_decodes_escapes():
    assert load_chat_template("{{ messages }}\\n") == "{{ messages }}\n"
    assert load_chat_template(None) is None


def test_ignored_flags_warn_once_each(caplog):
    args = parse_serve("--swap-space", "4", "--disable-cascade-attn", "--trust-remote-code",
                       "--tool-call-parser", "hermes")
    with caplog.at_level(logging.WARNING):
        given = vllm_flags.warn_ignored(args)
    assert given == ["--trust-remote-code", "--disable-cascade-attn", "--swap-space",
                     "--tool-call-parser"]
    assert caplog.text.count("is accepted and ignored") == 4
    assert "never runs code shipped with a model" in caplog.text
    assert vllm_flags.warn_ignored(parse_serve()) == []


def test_data_parallel_replicas_get_no_tls_or_cors(tmp_path):
    from pagedserve.entrypoints.data_parallel import replica_flags

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    flags = replica_flags(parse_serve(
        "--model", "m", "-dp", "2", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        "--allowed-origins", '["*"]', "--root-path", "/llm",
        "--default-chat-template-kwargs", '{"enable_thinking": false}'))
    assert flags == ["--model", "m", "--default-chat-template-kwargs",
                     '{"enable_thinking": false}']


def test_gpu_memory_utilization_sizes_the_pool_on_cuda(monkeypatch):
    """The arithmetic on a stand-in for a cuda worker (this machine has no GPU): the pool gets
    the fraction of device memory less what the loaded weights hold."""
    import types

    import torch

    from pagedserve.config import CacheConfig
    from pagedserve.worker.worker import Worker

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gib)

    def blocks(cache: CacheConfig, device: str) -> int:
        worker = types.SimpleNamespace(
            config=types.SimpleNamespace(cache=cache), device=torch.device(device),
            model_runner=types.SimpleNamespace(kv_cache_bytes_per_block=gib))
        return Worker.determine_num_kv_blocks(worker)

    assert blocks(CacheConfig(gpu_memory_utilization=0.5), "cuda") == 40  # 50 GiB - 10 GiB
    assert blocks(CacheConfig(gpu_memory_utilization=0.5, kv_cache_memory_bytes=4 * gib),
                  "cpu") == 4
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        blocks(CacheConfig(gpu_memory_utilization=0.05), "cuda")


@pytest.mark.parametrize("value, tokens", [("4096", 4096), ("32k", 32000), ("32K", 32768),
                                           ("1.5k", 1500), ("1M", 1 << 20)])
def test_max_model_len_takes_vllm_human_readable_forms(value, tokens):
    assert parse_serve("--max-model-len", value).max_model_len == tokens


@pytest.mark.parametrize("dtype, device, flags, resolved", [
    ("auto", "cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AMD EPYC Zen 4
    ("auto", "cpu", {"avx2", "avx512f", "amx_bf16"}, "bfloat16"),  # Intel Xeon with AMX
    ("auto", "cpu", {"avx2", "fma"}, "float32"),  # AMD EPYC Zen 2: bf16 would be emulated
    ("auto", "cpu", set(), "float32"),  # no /proc/cpuinfo flags (not x86)
    ("auto", "cuda", set(), "bfloat16"),
    ("float", "cpu", {"avx512_bf16"}, "float32"),
    ("half", "cuda", set(), "float16"),
    ("bfloat16", "cpu", set(), "bfloat16"),  # asked for by name: served, emulated or not
])
def test_auto_dtype_is_bf16_only_where_the_device_computes_it(dtype, device, flags, resolved):
    assert resolve_dtype(dtype, device, cpu_flags=flags) == resolved


@pytest.mark.parametrize("kv_cache_dtype, dtype, device, resolved", [
    ("auto", "float32", "cpu", "fp16"),  # half the fp32 cache's bytes
    ("auto", "bfloat16", "cpu", "auto"),  # the compute dtype, 16-bit already
    ("auto", "float32", "cuda", "auto"),
    ("fp32", "float32", "cpu", "auto"),  # the fp32 cache, asked for by name
    ("float32", "float32", "cpu", "auto"),
    ("float16", "float32", "cpu", "fp16"),
    ("fp8_e4m3", "bfloat16", "cpu", "fp8"),
    ("int8", "float32", "cpu", "int8"),
])
def test_kv_cache_dtype_resolves_per_compute_dtype(kv_cache_dtype, dtype, device, resolved):
    from pagedserve.engine.arg_utils import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype(kv_cache_dtype, dtype, device) == resolved


def test_auto_kv_is_fp16_only_where_the_matmuls_are_approximate(model_path):
    """GGUF weights with quantized activations: fp16; exact activations or dequantized weights:
    the fp32 cache, the reference computation (dense HF weights: test_quantized_kv.py)."""
    def cache_dtype(**kwargs):
        return EngineArgs(model=model_path, **kwargs).create_engine_config().cache.cache_dtype

    assert cache_dtype(dtype="float32") == "fp16"
    assert cache_dtype(dtype="float32", activation_quantization="none") == "auto"
    assert cache_dtype(dtype="float32", quantization="none") == "auto"
    assert cache_dtype(dtype="bfloat16") == "auto"


def test_fp32_kv_cache_needs_an_fp32_engine(model_path):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp32 keeps the KV in the compute dtype"):
        EngineArgs(model=model_path, dtype="bfloat16", kv_cache_dtype="fp32").create_engine_config()
    args = EngineArgs(model=model_path, dtype="float32", kv_cache_dtype="fp32")
    assert args.create_engine_config().cache.cache_dtype == "auto"


def test_default_dtype_is_auto_resolved_for_this_machine(model_path):
    config = EngineArgs(model=model_path).create_engine_config()
    assert config.device.dtype == resolve_dtype("auto", "cpu")
