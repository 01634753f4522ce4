"""Flat engine arguments (CLI flags and LLM(...) keywords) turned into the frozen configs once."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, field

from pagedserve.config import (
    ACTIVATION_QUANTIZATION_MODES,
    CPU_BINDING_MODES,
    KV_CACHE_DTYPES,
    QUANTIZATION_MODES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
    async_scheduling_conflicts,
    parse_size,
)
from pagedserve.kernels import extension_build
from pagedserve.models.loader import DEFAULT_MODEL, load_model_config, resolve_model_path

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = "2GiB"

_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp",
                "quantization": "-q"}
"""vLLM's short forms."""
_VLLM_FLAG_ALIASES = {"kv_cache_memory": "--kv-cache-memory-bytes"}
"""vLLM's spelling of a flag we name differently (both are accepted)."""
DTYPE_ALIASES = {"float": "float32", "half": "float16"}
"""vLLM's other --dtype names (and "auto": `resolve_dtype`)."""
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""/proc/cpuinfo flags of x86 CPUs that multiply bf16 in hardware. Without one, bf16 matmuls are
emulated: a 200-token prefill ran 66 tok/s in bf16 against 386 tok/s in fp32 on an AMD EPYC Zen 2
(AVX2 only)."""
QUANTIZATION_ALIASES = {"gguf": "auto"}
"""vLLM's --quantization gguf: the GGUF file's own quantization, which auto keeps."""
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8", "float16": "fp16", "float32": "fp32"}
KV_CACHE_DTYPE_CHOICES = (*KV_CACHE_DTYPES, "fp32")
"""--kv-cache-dtype: CacheConfig's names and fp32 (an fp32 engine's KV as it is computed)."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device: str,
                           approximate_matmuls: bool = True) -> str:
    """CacheConfig.cache_dtype for --kv-cache-dtype on an engine computing in `dtype`.

    auto: the compute dtype where it is 16-bit (vLLM's auto). An fp32 engine on the CPU whose
    matmuls are approximate already (quantized weights, activations not kept exact) keeps fp16
    codes instead, as llama.cpp keeps f16 KV: half the bytes its decode attention streams (the
    batch-32 step's largest part after the matmuls, bound by memory bandwidth), a rounding far
    below its int4 weights' and int8 activations' (perplexity within 0.01% of the fp32 cache
    with exact activations: tests/attention/test_quantized_kv.py). Dense weights or
    --activation-quantization none keep fp32 KV: theirs is the reference computation.
    fp32: the fp32 cache (CacheConfig's "auto"); it needs an fp32 engine."""
    name = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name == "fp32":
        if dtype != "float32":
            raise ValueError(f"--kv-cache-dtype fp32 keeps the KV in the compute dtype, which is "
                             f"{dtype}: pass --dtype float32 too, or choose auto")
        return "auto"
    if name == "auto" and dtype == "float32" and device.startswith("cpu") and approximate_matmuls:
        return "fp16"
    return name


def resolve_dtype(dtype: str, device: str, cpu_flags: set[str] | None = None) -> str:
    """The compute dtype --dtype names. vLLM's "auto" is bfloat16 where the device computes it
    natively (cuda; a CPU with AVX512-BF16 or AMX-BF16) and float32 elsewhere; `cpu_flags`
    defaults to this machine's."""
    if dtype != "auto":
        return DTYPE_ALIASES.get(dtype, dtype)
    if not device.startswith("cpu"):
        return "bfloat16"
    flags = extension_build.cpu_flags() if cpu_flags is None else cpu_flags
    return "bfloat16" if flags & NATIVE_BF16_CPU_FLAGS else "float32"


MAX_CUDA_GRAPH_SIZE = 512
"""The largest step captured by default (vLLM's default too): beyond it a step's kernels run
long enough that launching them one by one costs little."""


def default_cuda_graph_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, then every 8 up to the largest step worth a graph: twice max_num_seqs (decodes
    plus a small prefill chunk), within the token budget and MAX_CUDA_GRAPH_SIZE."""
    largest = min(2 * max_num_seqs, max_num_batched_tokens, MAX_CUDA_GRAPH_SIZE)
    sizes = [size for size in (1, 2, 4) if size <= largest]
    sizes += range(8, largest + 1, 8)
    if sizes[-1] != largest:
        sizes.append(largest)
    return tuple(sizes)


def human_readable_int(value: str) -> int:
    """vLLM's --max-model-len forms: 4096, 32k / 1m (powers of 1000), 32K / 1M (of 1024)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {value!r} (e.g. 4096, 32k, 32K)")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    result = float(number) * scale[suffix]
    if result != int(result):
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {value!r}")
    return int(result)

def _env_switch(name: str) -> bool:
    """An on/off environment variable: on unless set to "0". Read here only (the edge): the
    engine below gets the decision as config."""
    return os.environ.get(name, "1") != "0"


PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
"""vLLM's (older) way to turn the profiler on; --profiler-dir wins over it."""


def _profiler_dir_from_env() -> str | None:
    return os.environ.get(PROFILER_DIR_ENV) or None


def _json_object(value: dict | str, name: str) -> dict:
    """A dict, or the same as a JSON string (the CLI form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {value!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or JSON object, got {value!r}")
    return value


def parse_speculative_config(value: dict | str | None) -> SpeculativeConfig | None:
    """None, a dict of vLLM's keys, or the same as a JSON string."""
    if value is None:
        return None
    return SpeculativeConfig.from_dict(_json_object(value, "speculative_config"))


def parse_kv_transfer_config(value: dict | str | None) -> KVTransferConfig | None:
    """None, a dict of vLLM's keys, or the same as a JSON string."""
    if value is None:
        return None
    return KVTransferConfig.from_dict(_json_object(value, "kv_transfer_config"))


def _resolve_speculative_config(
    config: SpeculativeConfig | None, target: ModelConfig
) -> SpeculativeConfig | None:
    """Turn a draft model's short name into its path, and check a self-draft fits the target."""
    if config is None:
        return None
    if config.draft_model_path is not None:
        return dataclasses.replace(config, model=resolve_model_path(config.draft_model_path))
    if config.is_self_draft and config.draft_num_layers > target.num_hidden_layers:
        raise ValueError(
            f"draft_num_layers {config.draft_num_layers} exceeds the target model's "
            f"{target.num_hidden_layers} layers"
        )
    return config


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    """A short model name, a GGUF file or an HF model directory."""
    dtype: str = "auto"
    """Compute dtype: float32 or bfloat16 (float16 on cuda); vLLM's float and half too. auto:
    bfloat16 where the device multiplies it natively, else float32 (`resolve_dtype`)."""
    device: str = "cpu"
    tokenizer: str | None = None
    """vLLM's --tokenizer: must name the model itself (the tokenizer comes from its files)."""
    max_model_len: int | None = None
    """Context length; default: the model's."""
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    """Memory for the KV block pool (e.g. 512MiB, 4GiB; vLLM's --kv-cache-memory-bytes).
    Default: 2GiB, or on cuda with gpu_memory_utilization, that fraction of the device."""
    gpu_memory_utilization: float | None = None
    """vLLM's: on cuda, the fraction of device memory the weights and the KV pool may take
    (the pool gets the rest after the weights); on the CPU, ignored with a warning."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    async_scheduling: bool | None = None
    """Schedule step N + 1 while step N runs on the device (vLLM's flag). None (auto): on for
    cuda, off on the CPU (whose steps compute synchronously: nothing to overlap) and where it
    does not run yet (speculative decoding, -tp/-pp > 1, KV tiers), which an explicit
    --async-scheduling refuses."""
    num_gpu_blocks_override: int | None = None
    """Fix the number of KV blocks instead of sizing the pool from memory."""
    kv_cache_dtype: str = "auto"
    """auto: the compute dtype, fp16 codes on an fp32 CPU engine (`resolve_kv_cache_dtype`);
    fp32: an fp32 engine's KV as computed; int8 / fp8 (e4m3) / fp16: codes with scales."""
    disable_hybrid_kv_cache_manager: bool = False
    """One block table for every layer: windowed layers keep every block and mask (vLLM's
    flag). Also the case, whatever this says, with KV tiers or pipeline stages."""
    kv_transfer_config: dict | str | None = None
    """KV tiers, vLLM's keys, as a dict or JSON: e.g. {"kv_connector": "DiskConnector",
    "kv_connector_extra_config": {"path": "/var/cache/pagedserve", "max_bytes": "20GiB"}}."""
    num_threads: int | None = None
    """torch threads on the CPU (default: the CPUs this process may run on, see os.sched_getaffinity)."""
    seed: int = 0
    """Seed of the engine's random stream (requests with their own seed use theirs)."""
    quantization: str = "auto"
    """auto: also keep GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q5_0 weights packed, for the int4 kernel on matmuls
    of few rows (bf16 on the CPU only); none: dequantize every weight to the compute dtype;
    int4 / int8: quantize every linear weight on load and run packed only (bf16 on the CPU)."""
    activation_quantization: str = "auto"
    """Matmuls on GGUF codes (CPU kernels): auto: activations quantized per 32-element group,
    int8, each layer's outlier channels exact (bf16's MoE experts: int16); none: exact (fp32:
    the dense model's weights, fp32 sums); int16 / int8: everywhere."""
    speculative_config: dict | str | None = None
    """Speculative decoding, vLLM's keys, as a dict or JSON: e.g. {"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1};
    {"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4} (method draft_model inferred);
    {"method": "draft_model", "model": "self", "draft_num_layers": 8}: the target's first layers."""
    max_cached_grammars: int = 128
    """Compiled structured output grammars kept (LRU)."""
    grammar_compile_timeout: float = 10.0
    """Seconds a request's grammar may take to compile before the request fails."""
    tensor_parallel_size: int = 1
    """Ranks (processes) that split every layer (-tp)."""
    pipeline_parallel_size: int = 1
    """Ranks (processes) that each hold a contiguous range of the layers (-pp)."""
    nnodes: int = 1
    """Machines the ranks are spread over (the others run `pagedserve serve --headless`)."""
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the engine runs."""
    master_port: int = 0
    """torch.distributed rendezvous port on node 0; the workers' control port is the next one
    (0: free ports, single node only)."""
    cpu_binding: str = "auto"
    """auto: pin each rank to its own share of the CPUs, threads to match; none: no pinning."""
    cpu_kernels: bool = field(default_factory=lambda: _env_switch("PAGEDSERVE_CPU_KERNELS"))
    """The compiled CPU kernels where they apply; --no-cpu-kernels: plain torch everywhere (the
    reference). Default: on unless PAGEDSERVE_CPU_KERNELS=0."""
    fused_decoder_layers: bool = field(
        default_factory=lambda: _env_switch("PAGEDSERVE_FUSED_LAYERS"))
    """Steps of a few tokens through all decoder layers in one compiled call; --no-...: the
    modules one by one. Default: on unless PAGEDSERVE_FUSED_LAYERS=0."""
    gpu_kernels: bool = True
    """cuda: the Triton kernels where they apply; --no-gpu-kernels: torch's ops (the reference;
    no CUDA graphs then)."""
    enforce_eager: bool = False
    """cuda: capture no CUDA graphs, run every step eagerly (vLLM's flag; the CPU has none)."""
    cuda_graph_sizes: list[int] | None = None
    """cuda: the step sizes (tokens) captured as CUDA graphs; default 1, 2, 4, then every 8 up
    to min(2 * max_num_seqs, max_num_batched_tokens, 512) (`default_cuda_graph_sizes`)."""

    enable_lora: bool = False
    """Serve LoRA adapters (LoRARequest offline, --lora-modules and `model` on the server)."""
    max_loras: int = 1
    """Distinct adapters in one batch."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted (the adapter slots are sized for it)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (default: max_loras)."""
    enable_sleep_mode: bool = False
    """Allow LLM.sleep(level) / wake_up() (the server: POST /sleep, /wake_up, GET /is_sleeping)."""
    profiler_dir: str | None = field(default_factory=_profiler_dir_from_env)
    """Allow LLM.start_profile() / stop_profile() (the server: POST /start_profile,
    /stop_profile): torch.profiler traces, one per rank, go to this directory. Default:
    $VLLM_TORCH_PROFILER_DIR, else off."""
    profiler_with_stack: bool = False
    """Record Python stacks in the profiler's traces (larger, slower)."""

    def create_profiler_config(self) -> ProfilerConfig | None:
        if not self.profiler_dir:
            return None
        trace_dir = os.path.abspath(os.path.expanduser(self.profiler_dir))
        return ProfilerConfig(trace_dir=trace_dir, with_stack=self.profiler_with_stack)

    def create_lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)

    def _approximate_matmuls(self, model_path: str) -> bool:
        """Whether the matmuls run on quantized weights with quantized activations (auto KV)."""
        quantized_weights = (self.quantization in ("int4", "int8")
                             or (self.quantization != "none" and model_path.endswith(".gguf")))
        return quantized_weights and self.activation_quantization != "none"

    def create_engine_config(self) -> EngineConfig:
        model_path = resolve_model_path(self.model)
        if self.tokenizer is not None and resolve_model_path(self.tokenizer) != model_path:
            raise ValueError(f"--tokenizer {self.tokenizer!r} is not the model: pagedserve reads "
                             "the tokenizer from the model's own files")
        model_config = load_model_config(model_path)
        dtype = resolve_dtype(self.dtype, self.device)  # the compute dtype (and the KV's, auto)
        if self.enable_lora and model_config.moe is not None:
            raise ValueError(f"LoRA adapters are not supported on a mixture-of-experts model "
                             f"({model_config.architecture})")
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context "
                f"{model_config.max_position_embeddings}"
            )
        max_num_batched_tokens = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        speculative = _resolve_speculative_config(
            parse_speculative_config(self.speculative_config), model_config)
        parallel = self.create_parallel_config()
        kv_transfer = parse_kv_transfer_config(self.kv_transfer_config)
        return EngineConfig(
            model_path=model_path,
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=parse_size(self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY),
                gpu_memory_utilization=self._gpu_memory_utilization(),
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cache_dtype=resolve_kv_cache_dtype(
                    self.kv_cache_dtype, dtype, self.device,
                    approximate_matmuls=self._approximate_matmuls(model_path)),
                # KV tiers move whole blocks of every layer; a pipeline stage holds some layers
                # and schedules ahead (blocks are let go of at scheduling)
                hybrid_kv_cache=(not self.disable_hybrid_kv_cache_manager
                                 and self.kv_transfer_config is None
                                 and self.pipeline_parallel_size == 1),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                max_num_batches_in_flight=self.pipeline_parallel_size,
                async_scheduling=self._async_scheduling(speculative, parallel, kv_transfer),
            ),
            device=DeviceConfig(
                device=self.device, dtype=dtype,
                num_threads=self.num_threads, seed=self.seed,
                quantization=QUANTIZATION_ALIASES.get(self.quantization, self.quantization),
                activation_quantization=self.activation_quantization,
                cpu_kernels=self.cpu_kernels,
                fused_decoder_layers=self.fused_decoder_layers,
                gpu_kernels=self.gpu_kernels,
                cuda_graph_sizes=self._cuda_graph_sizes(max_num_batched_tokens),
            ),
            speculative=speculative,
            structured_output=StructuredOutputConfig(
                max_cached_grammars=self.max_cached_grammars,
                compile_timeout_s=self.grammar_compile_timeout,
            ),
            parallel=parallel,
            kv_transfer=kv_transfer,
            lora=self.create_lora_config(),
            enable_sleep_mode=self.enable_sleep_mode,
            profiler=self.create_profiler_config(),
        )

    def _cuda_graph_sizes(self, max_num_batched_tokens: int) -> tuple[int, ...]:
        if self.enforce_eager or not self.gpu_kernels or not self.device.startswith("cuda"):
            return ()
        if self.cuda_graph_sizes is None:
            return default_cuda_graph_sizes(self.max_num_seqs, max_num_batched_tokens)
        return tuple(sorted(set(self.cuda_graph_sizes)))

    def _async_scheduling(self, speculative: SpeculativeConfig | None, parallel: ParallelConfig,
                          kv_transfer: KVTransferConfig | None) -> bool:
        conflicts = async_scheduling_conflicts(speculative, parallel, kv_transfer)
        if self.async_scheduling is None:  # auto
            return self.device.startswith("cuda") and not conflicts
        if self.async_scheduling and conflicts:
            raise ValueError(f"--async-scheduling does not run with {' or '.join(conflicts)} "
                             "yet: leave it off (auto turns it off there)")
        return self.async_scheduling

    def _gpu_memory_utilization(self) -> float | None:
        """The fraction that sizes the pool: only on cuda, and only without an explicit size."""
        if self.gpu_memory_utilization is None:
            return None
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if not self.device.startswith("cuda"):
            logger.warning("--gpu-memory-utilization is ignored on the CPU: size the KV pool with "
                           "--kv-cache-memory-bytes (now %s)",
                           self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
            return None
        if self.kv_cache_memory is not None:
            return None  # as in vLLM, an explicit size wins
        return self.gpu_memory_utilization

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr,
            master_port=self.master_port, cpu_binding=self.cpu_binding,
        )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.name == "quantization":
                parser.add_argument(flag, "-q", default=f.default,
                                    choices=QUANTIZATION_MODES + tuple(QUANTIZATION_ALIASES))
            elif f.name == "activation_quantization":
                parser.add_argument(flag, default=f.default, choices=ACTIVATION_QUANTIZATION_MODES)
            elif f.name in _SHORT_FLAGS:
                parser.add_argument(flag, _SHORT_FLAGS[f.name], type=int, default=f.default)
            elif f.name == "cpu_binding":
                parser.add_argument(flag, choices=CPU_BINDING_MODES, default=f.default)
            elif f.type in ("bool", bool):
                default = (f.default if f.default_factory is dataclasses.MISSING
                           else f.default_factory())  # the env-backed switches
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            elif f.name == "async_scheduling":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                    help="schedule step N + 1 while step N runs (default: on "
                                         "for cuda, off on the CPU)")
            elif f.name == "max_model_len":
                parser.add_argument(flag, type=human_readable_int, default=f.default,
                                    help="tokens, e.g. 4096, 32k, 32K (default: the model's)")
            elif f.name == "cuda_graph_sizes":
                parser.add_argument(flag, type=int, nargs="+", default=None,
                                    help="cuda: step sizes (tokens) captured as CUDA graphs "
                                         "(default 1 2 4 8 16 ... up to 512)")
            elif f.name in ("num_gpu_blocks_override", "num_threads", "max_cpu_loras"):
                parser.add_argument(flag, type=int, default=f.default)
            elif f.name == "gpu_memory_utilization":
                parser.add_argument(flag, type=float, default=None,
                                    help="cuda: fraction of device memory for weights and KV; "
                                         "ignored on the CPU")
            elif f.name == "dtype":
                parser.add_argument(flag, default=f.default,
                                    choices=("auto", "bfloat16", "float32", "float16", *DTYPE_ALIASES))
            elif f.name == "tokenizer":
                parser.add_argument(flag, default=None, help="the model itself (vLLM's flag)")
            elif f.name == "speculative_config":
                parser.add_argument(flag, type=str, default=None,
                                    help='JSON, e.g. {"method": "ngram", '
                                         '"num_speculative_tokens": 4}')
            elif f.name == "kv_transfer_config":
                parser.add_argument(flag, type=str, default=None,
                                    help='JSON, e.g. {"kv_connector": "DiskConnector", '
                                         '"kv_connector_extra_config": {"path": "/tmp/kv"}}')
            elif f.name == "kv_cache_dtype":
                parser.add_argument(flag,
                                    choices=KV_CACHE_DTYPE_CHOICES + tuple(KV_CACHE_DTYPE_ALIASES),
                                    default=f.default)
            elif f.name == "profiler_dir":
                parser.add_argument(flag, type=str, default=f.default_factory(),
                                    help="write torch.profiler traces here between "
                                         "/start_profile and /stop_profile (default: "
                                         f"${PROFILER_DIR_ENV}, else profiling is off)")
            elif f.name == "kv_cache_memory":
                parser.add_argument(flag, _VLLM_FLAG_ALIASES[f.name], type=str, default=None,
                                    help=f"e.g. 512MiB, 4GiB (default {DEFAULT_KV_CACHE_MEMORY})")
            else:
                parser.add_argument(flag, type=type(f.default), default=f.default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})
