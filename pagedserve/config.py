"""Small frozen configs, one per consumer, validated once.

The scheduler gets SchedulerConfig and CacheConfig only; models get ModelConfig only. Nothing here
imports torch, so the control plane and its tests stay torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedserve.core.kv_cache_groups import KVCacheLayout


@dataclass(frozen=True)
class ModelConfig:
    """An architecture's shape, normalized once from GGUF metadata or an HF config.json.

    Models read these fields and never the source config.
    """

    architecture: str
    """Our registry key (models/__init__.py): "llama", "qwen2", "qwen3", "phi3", "mixtral", ..."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    """The model's trained context length."""
    tie_word_embeddings: bool
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    o_bias: bool = False
    """Bias on the attention output projection."""
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    """Every token id that ends generation (the GGUF eos plus, when known, the chat end token)."""
    name: str = ""
    """A display name for /v1/models and logs."""
    qk_norm: bool = False
    """An RMSNorm over head_dim on every query and key head, before RoPE (Qwen3, Gemma 3)."""
    sliding_window: int | None = None
    """Tokens a windowed layer attends back to, itself included: a query at position p sees
    positions > p - sliding_window (HF's convention); None: the whole sequence. Which layers are
    windowed: sliding_window_layers."""
    moe: MoEConfig | None = None
    """The mixture-of-experts MLP (Mixtral, Qwen2-MoE); None: every MLP is dense."""
    sliding_window_layers: tuple[bool, ...] = ()
    """Per layer: True where it attends within sliding_window (Gemma 3's local layers); empty:
    every layer does (Phi-3)."""
    rope_local_theta: float | None = None
    """RoPE base of the windowed layers (Gemma 3: 10,000); None: rope_theta."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by its -1/2 power (Gemma); None: head_dim's."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logits / cap); None: left as they are."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window_layers and len(self.sliding_window_layers) != self.num_hidden_layers:
            raise ValueError(f"sliding_window_layers has {len(self.sliding_window_layers)} entries "
                             f"for {self.num_hidden_layers} layers")
        if any(self.sliding_window_layers) and (self.sliding_window or 0) < 1:
            raise ValueError(f"windowed layers need sliding_window >= 1, got {self.sliding_window}")

    def layer_sliding_window(self, layer: int) -> int | None:
        """Layer `layer`'s window (None: it attends to every earlier position)."""
        if self.sliding_window_layers and not self.sliding_window_layers[layer]:
            return None
        return self.sliding_window

    def kv_cache_layout(self, per_layer_group: bool) -> KVCacheLayout:
        """Which layers share a block table (CacheConfig.hybrid_kv_cache: per_layer_group)."""
        return KVCacheLayout.for_layers(
            [self.layer_sliding_window(i) for i in range(self.num_hidden_layers)],
            per_layer_group)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP's shape: each token runs the `num_experts_per_tok` experts its
    router scores highest (softmax over all experts, then top-k), weighted by those scores."""

    num_experts: int
    num_experts_per_tok: int
    """top_k: the experts each token is routed to."""
    expert_intermediate_size: int
    """Each expert's SiLU-gated MLP width."""
    norm_topk_prob: bool = True
    """Renormalize the top-k weights to sum to 1 (Mixtral always; Qwen2-MoE's flag)."""
    shared_expert_intermediate_size: int = 0
    """A shared expert every token runs, scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE);
    0: none."""
    dense_layers: tuple[int, ...] = ()
    """Layers whose MLP is dense, of ModelConfig.intermediate_size (Qwen2-MoE's mlp_only_layers
    and decoder_sparse_step)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.expert_intermediate_size < 1 or self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"need expert_intermediate_size >= 1 and shared_expert_intermediate_size >= 0, got "
                f"{self.expert_intermediate_size} and {self.shared_expert_intermediate_size}")


KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int = 2 << 30
    """Bytes for the whole KV pool (all layers, K and V); the block count derives from it."""
    enable_prefix_caching: bool = True
    """Reuse KV of identical prompt prefixes across requests."""
    num_gpu_blocks_override: int | None = None
    """Fix the block count instead of deriving it from the memory budget (tests use tiny pools)."""
    cache_dtype: str = "auto"
    """KV cache element type: "auto" (the compute dtype), "int8", "fp8" (e4m3) or "fp16", each
    with scales stored beside the KV (attention/kv_cache.py)."""
    gpu_memory_utilization: float | None = None
    """cuda only: the pool is this fraction of device memory less what is allocated once the
    weights are loaded (vLLM's flag); None: kv_cache_memory_bytes."""
    hybrid_kv_cache: bool = True
    """Manage KV per layer group (core/kv_cache_groups.py, vLLM's hybrid KV cache manager): a
    windowed layer's blocks are let go of once its window has passed them. False: one block
    table for every layer, every block kept (windowed layers mask)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be >= 2 (block 0 is reserved)")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Maximum number of requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget per step; longer prompts are prefilled in chunks."""
    max_model_len: int = 8192
    """Longest sequence (prompt + output) a request may reach."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget over several steps."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill tokens per step, so several prompts share a step (0: no cap)."""
    max_num_batches_in_flight: int = 1
    """Steps scheduled before the oldest one's results are back (one per pipeline stage); each
    takes its share of the unfinished requests."""
    async_scheduling: bool = False
    """Schedule (and prepare) step N + 1 while step N runs on the device, and apply N's sampled
    tokens after N + 1 is launched; a request sampled in N may decode in N + 1 through an
    output placeholder (core/scheduler.py). Same tokens as without; vLLM's --async-scheduling.
    Not with pipeline stages (max_num_batches_in_flight > 1)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_num_batches_in_flight < 1:
            raise ValueError("max_num_batches_in_flight must be >= 1")
        if self.async_scheduling and self.max_num_batches_in_flight > 1:
            raise ValueError("async scheduling does not run with pipeline stages "
                             "(max_num_batches_in_flight > 1)")


QUANTIZATION_MODES = ("auto", "none", "int4", "int8")
ACTIVATION_QUANTIZATION_MODES = ("auto", "none", "int16", "int8")
"""How matmuls on GGUF codes (the compiled CPU kernels) take their activations; see
layers/quantized.py `activation_bits_for`."""


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    """"cpu" or "cuda" (or "cuda:N")."""
    dtype: str = "bfloat16"
    """Compute dtype: "float32" or "bfloat16" (float16 on cuda too)."""
    num_threads: int | None = None
    """torch intra-op threads on the CPU; None: the CPUs this process may run on."""
    seed: int = 0
    """Seed for the engine's unseeded sampling stream."""
    quantization: str = "auto"
    """"auto": keep a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0/Q5_0 weights in their codes for the CPU
    kernels, instead of dense weights (on the CPU only; activation_quantization says how they
    meet the activations; see layers/linear.py); MoE experts run on
    their codes alone in both (layers/moe.py); "none": dequantize
    everything and run dense; "int4" / "int8": quantize every linear weight
    (and a tied head) on load, per 32-element group, and run packed only (bf16 on the CPU)."""
    activation_quantization: str = "auto"
    """Matmuls on GGUF codes by the compiled CPU kernels: "auto" activations quantized per
    32-element group to int8 with each layer's outlier channels exact (layers/outliers.py; in
    fp32 the exact mode where this build has no vectorized integer kernel; bf16's MoE experts
    int16); "none" exact (fp32: the dense model's weights and fp32 sums); "int16" / "int8"
    everywhere. See layers/quantized.py."""
    cpu_kernels: bool = True
    """Use the compiled CPU kernels (csrc/cpu_ops.cpp) where they apply; False: the plain torch
    path everywhere (the reference). Decided once per model (kernels/cpu_ops.py KernelConfig)."""
    fused_decoder_layers: bool = True
    """Run steps of a few tokens through all decoder layers in one compiled call
    (models/decoder_stack.py) where it applies; needs cpu_kernels. False: the modules, one by one
    (the same kernels, bitwise the same output)."""
    gpu_kernels: bool = True
    """cuda: the Triton kernels (attention/triton_backend.py) where they apply; False: torch's
    ops everywhere (the reference; CUDA graphs then capture nothing, as torch's paged attention
    reads host data)."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """cuda: the padded step sizes, in tokens, whose forward pass is captured as a CUDA graph
    and replayed (worker/cuda_graph.py); a step runs the smallest size that holds it, eagerly
    if none does. (): every step eager (vLLM's --enforce-eager). EngineArgs fills the default
    ladder (`default_cuda_graph_sizes`); ignored on the CPU."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if any(size < 1 for size in self.cuda_graph_sizes) or list(self.cuda_graph_sizes) != sorted(
                set(self.cuda_graph_sizes)):
            raise ValueError("cuda_graph_sizes must be distinct positive token counts, ascending; "
                             f"got {self.cuda_graph_sizes}")
        if self.activation_quantization not in ACTIVATION_QUANTIZATION_MODES:
            raise ValueError(
                "activation_quantization must be one of "
                f"{', '.join(ACTIVATION_QUANTIZATION_MODES)}, got {self.activation_quantization!r}"
            )
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, "
                f"got {self.quantization!r}"
            )

    @property
    def keeps_weights_packed(self) -> bool:
        """GGUF codes are loaded as they are (auto) and packed (see layers/linear.py)."""
        return (self.quantization == "auto" and self.device == "cpu"
                and self.dtype in ("bfloat16", "float32"))

    @property
    def quantize_on_load(self) -> str | None:
        """"int4" / "int8" when weights are quantized on load, else None."""
        return self.quantization if self.quantization in ("int4", "int8") and self._packs else None

    @property
    def _packs(self) -> bool:
        # torch's int4 kernel runs on the CPU and wants bf16 activations (see quantized.py).
        return self.dtype == "bfloat16" and self.device == "cpu"


SPECULATIVE_METHODS = ("ngram", "draft_model")
SELF_DRAFT = "self"
"""`model` value of a draft made from the target's own first `draft_num_layers` layers."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's key names: propose tokens cheaply, verify them all in one
    target forward pass, keep the ones the rejection sampler accepts (the output distribution is
    unchanged)."""

    method: str | None = None
    """The proposer: "ngram" (prompt lookup) or "draft_model" (a smaller model). Left out, it is
    inferred as vLLM does: "draft_model" when `model` is given, else "ngram"."""
    num_speculative_tokens: int = 4
    """Draft tokens proposed per request per step (capped by max_tokens and max_model_len)."""
    prompt_lookup_max: int = 4
    """n-gram: the longest suffix of the context to look up earlier in the context."""
    prompt_lookup_min: int = 1
    """n-gram: the shortest suffix worth a lookup."""
    model: str | None = None
    """draft_model: a short model name, GGUF file or HF directory sharing the target's tokenizer;
    or "self": the target's own first `draft_num_layers` layers (shared weights, own KV)."""
    draft_num_layers: int | None = None
    """draft_model with model "self": how many of the target's layers the draft runs."""

    def __post_init__(self) -> None:
        if self.method is None:  # frozen: set the inferred method once, here
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "ngram" and (self.model is not None or self.draft_num_layers is not None):
            raise ValueError("method 'ngram' takes no 'model' or 'draft_num_layers'")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("method 'draft_model' needs 'model' (a model name or path, "
                                 f"or {SELF_DRAFT!r} with 'draft_num_layers')")
            if self.is_self_draft != (self.draft_num_layers is not None):
                raise ValueError(f"'draft_num_layers' goes with model {SELF_DRAFT!r}, and only there")
            if self.is_self_draft and self.draft_num_layers < 1:
                raise ValueError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")

    @property
    def is_self_draft(self) -> bool:
        return self.method == "draft_model" and self.model == SELF_DRAFT

    @property
    def draft_model_path(self) -> str | None:
        """The separate draft model to load (None for n-gram and self-drafts)."""
        if self.method != "draft_model" or self.is_self_draft:
            return None
        return self.model

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From vLLM-style keys; unknown keys are a ValueError (a typo must not pass silently)."""
        _check_known_keys(cls, values, "speculative_config")
        return cls(**values)


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Constrained decoding: the compiled-grammar cache and the compile budget."""

    max_cached_grammars: int = 128
    """Compiled grammars kept (LRU); a compiled JSON schema is typically well under 1 MiB."""
    compile_timeout_s: float = 10.0
    """A request whose grammar is not compiled this long after it arrived fails."""
    num_compile_threads: int = 2

    def __post_init__(self) -> None:
        if self.max_cached_grammars < 1:
            raise ValueError(f"max_cached_grammars must be >= 1, got {self.max_cached_grammars}")
        if self.compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if self.num_compile_threads < 1:
            raise ValueError(f"num_compile_threads must be >= 1, got {self.num_compile_threads}")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving, with vLLM's names: adapters apply per token over a shared base model.

    The worker keeps `max_loras` device slots (the adapters one step may use) and up to
    `max_cpu_loras` adapters loaded in host memory; both are LRU over adapters no request holds.
    """

    max_loras: int = 1
    """Distinct adapters in one batch (the requests without an adapter do not count)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; the slots are sized for it."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (default: max_loras); at least max_loras."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:  # frozen: resolve the default once, here
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")


CPU_BINDING_MODES = ("auto", "none")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks (processes): tensor x pipeline parallel, on one or
    several nodes. world_size 1 runs in the engine's own process (the uni-process executor)."""

    tensor_parallel_size: int = 1
    """Ranks that split every layer: heads for attention, columns/rows for the MLP, vocabulary
    for the embedding and head; one all-reduce after attention and one after the MLP."""
    pipeline_parallel_size: int = 1
    """Stages that each hold a contiguous range of layers; hidden states go stage to stage."""
    nnodes: int = 1
    """Machines the ranks are spread over; each runs world_size / nnodes of them."""
    node_rank: int = 0
    """This machine's index; node 0 runs the engine (API server), others run `--headless`."""
    master_addr: str = "127.0.0.1"
    """Where node 0 listens: the torch.distributed rendezvous and the workers' control channel."""
    master_port: int = 0
    """Rendezvous port on master_addr (the control channel takes the next one); 0: a free port,
    single node only."""
    cpu_binding: str = "auto"
    """"auto": on the CPU, pin each local rank to its own share of this process's CPUs, with a
    thread count to match; "none": leave placement to the OS."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % self.nnodes:
            raise ValueError(f"world size {self.world_size} (tensor x pipeline parallel) must be "
                             f"a multiple of nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a multi-node run needs --master-port (and --master-addr)")
        if not 0 <= self.master_port < 65535:
            raise ValueError(f"master_port must be in [0, 65535), got {self.master_port}")
        if self.cpu_binding not in CPU_BINDING_MODES:
            raise ValueError(f"cpu_binding must be one of {CPU_BINDING_MODES}, "
                             f"got {self.cpu_binding!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        """Ranks on each node."""
        return self.world_size // self.nnodes

    def verify_with_model(self, model: ModelConfig) -> None:
        """Raise ValueError (at startup, naming the sizes that work) if the model cannot split."""
        tp = self.tensor_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(model, name)
            if count % tp:
                valid = [n for n in range(1, count + 1)
                         if model.num_attention_heads % n == 0 and model.num_key_value_heads % n == 0]
                raise ValueError(
                    f"tensor_parallel_size {tp} does not divide the model's {name} ({count}); "
                    f"sizes that split its heads evenly: {valid}"
                )
        widths = {"intermediate_size": model.intermediate_size}
        if model.moe is not None:  # the experts split their intermediate dimension too
            widths["expert_intermediate_size"] = model.moe.expert_intermediate_size
            widths["shared_expert_intermediate_size"] = model.moe.shared_expert_intermediate_size
        for name, width in widths.items():
            if width % tp:
                raise ValueError(f"tensor_parallel_size {tp} does not divide the model's "
                                 f"{name} ({width})")
        if self.pipeline_parallel_size > model.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size} exceeds the "
                             f"model's {model.num_hidden_layers} layers")


KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """KV tiers and transfers beyond the device pool (kv_transfer/), with vLLM's key names."""

    kv_connector: str
    """DiskConnector, RedisConnector, HostOffloadConnector, or MultiConnector (its
    kv_connector_extra_config["connectors"] lists the others' configs, searched in order)."""
    kv_role: str = "kv_both"
    """kv_both: save and load; kv_producer: save only; kv_consumer: load only."""
    kv_connector_extra_config: dict = field(default_factory=dict)
    """The connector's own settings (DiskConnector: path, max_bytes; RedisConnector: url;
    HostOffloadConnector: max_bytes)."""

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @classmethod
    def from_dict(cls, values: dict) -> KVTransferConfig:
        """From vLLM's keys; unknown keys are a ValueError (a typo must not pass silently)."""
        _check_known_keys(cls, values, "kv_transfer_config")
        if "kv_connector" not in values:
            raise ValueError("kv_transfer_config needs 'kv_connector'")
        return cls(**values)


@dataclass(frozen=True)
class ProfilerConfig:
    """torch.profiler around the engine's steps, started and stopped at run time (vLLM's
    /start_profile and /stop_profile): every rank writes one Chrome trace per start/stop."""

    trace_dir: str
    """Absolute directory the traces go to (created at the first start)."""
    with_stack: bool = False
    """Record Python stacks too: much larger traces and slower steps while profiling."""
    record_shapes: bool = True
    """Record the input shapes of every op."""

    def __post_init__(self) -> None:
        if not self.trace_dir:
            raise ValueError("the profiler's trace directory must not be empty")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; each component receives only its own part."""

    model_path: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None
    """None: no speculative decoding."""
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None
    """None: KV lives only in the device pool (no tiers)."""
    lora: LoRAConfig | None = None
    """None: no LoRA adapters (enable_lora off)."""
    enable_sleep_mode: bool = False
    """Allow sleep(level) / wake_up() while idle: free the KV pool (level 1), or the KV pool and
    the weights (level 2), e.g. to lend the memory to another process (vLLM's name)."""
    profiler: ProfilerConfig | None = None
    """None: start_profile / stop_profile are refused (no profiler_dir given)."""


def async_scheduling_conflicts(speculative: SpeculativeConfig | None, parallel: ParallelConfig,
                               kv_transfer: KVTransferConfig | None) -> list[str]:
    """What async scheduling does not run with yet (empty: nothing here stops it)."""
    conflicts = []
    if speculative is not None:
        conflicts.append("speculative decoding")  # drafts are proposed from the tokens on the host
    if parallel.world_size > 1:
        conflicts.append("tensor or pipeline parallelism")  # the workers' outputs come whole
    if kv_transfer is not None:
        conflicts.append("KV tiers (kv_transfer_config)")
    return conflicts


_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
               "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(value: int | str) -> int:
    """Bytes from 123, "512MiB", "2GiB" or "1.5GB"."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read a size from {value!r} (examples: 512MiB, 2GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _check_known_keys(cls: type, values: dict, name: str) -> None:
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {name} keys {unknown}; known: {sorted(known)}")
