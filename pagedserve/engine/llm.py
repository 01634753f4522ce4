"""The offline API: LLM(model=...).generate(prompts, params), LLM.chat(messages) and
LLM.embed(prompts).

LLM has an engine; it adds every prompt, steps until all finish and returns outputs in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        if model is not None:
            engine_kwargs["model"] = model
        self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; a single string, token-id list or dict is one prompt.
        lora_request: one adapter for every prompt, or one per prompt (None: the base model);
        needs enable_lora.

        A request whose grammar does not compile within the engine's budget comes back with
        `error` set and finish_reason "abort"; the others are unaffected.
        """
        prompts = _prompt_list(prompts)
        params_list = _per_prompt(
            SamplingParams() if sampling_params is None else sampling_params, SamplingParams,
            len(prompts), "sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        lora_requests = _per_prompt(lora_request, LoRARequest, len(prompts), "lora requests")
        # Offline there is no loop to keep serving: check constraints up front, so that a bad
        # one raises here (like any bad parameter) instead of failing its request later.
        for params in {id(p): p for p in params_list if p is not None}.values():
            if params.structured_outputs is not None:
                self.engine.structured_output_manager.validate(params.structured_outputs)
        request_ids = []
        try:
            for prompt, params, prio, lora in zip(prompts, params_list, priorities,
                                                  lora_requests):
                # vLLM's prompt dicts may carry a cache salt: the tenant's prefix-cache namespace.
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                request_ids.append(self.engine.add_request(None, prompt, params, priority=prio,
                                                           cache_salt=salt, lora_request=lora))
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Embed prompts (vLLM's LLM.embed): each output's `outputs.embedding` is its pooled,
        L2-normalized final hidden state (PoolingParams: last-token pooling by default).
        Served by the same engine as generate, as prefill-only requests."""
        prompts = _prompt_list(prompts)
        params_list = _per_prompt(
            PoolingParams() if pooling_params is None else pooling_params, PoolingParams,
            len(prompts), "pooling params")
        lora_requests = _per_prompt(lora_request, LoRARequest, len(prompts), "lora requests")
        request_ids = []
        try:
            for prompt, params, lora in zip(prompts, params_list, lora_requests):
                request_ids.append(self.engine.add_request(None, prompt, params,
                                                           lora_request=lora))
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (else it loads with its first request)."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.engine.tokenizer.encode(
                self.engine.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=add_generation_prompt, tools=tools
                ),
                add_special_tokens=False,
            )}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    # ---- lifecycle (vLLM's names; between generate calls the engine is always idle) ------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) or the KV cache and the weights (level 2) until
        wake_up(); needs LLM(..., enable_sleep_mode=True). generate() raises
        EngineSleepingError meanwhile."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def update_weights(self, model_path: str) -> None:
        """Serve the weights of another model file of the same architecture and shape."""
        self.engine.update_weights(model_path)

    def start_profile(self) -> None:
        """Profile the next generate calls with torch.profiler (vLLM's name); needs
        LLM(..., profiler_dir=DIR) or VLLM_TORCH_PROFILER_DIR. ValueError if off or running."""
        self.engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop and write one Chrome trace (.pt.trace.json) per rank; returns their paths."""
        return self.engine.stop_profile()

    def _run_engine(self, request_ids: list[str]) -> list:
        """The requests' final outputs, in order (RequestOutput or PoolingRequestOutput)."""
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """A single string, token-id list or dict is one prompt."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


def _per_prompt(value: Any, single_type: type, num_prompts: int, name: str) -> list:
    """`value` for every prompt (None or one `single_type`), or its list, one per prompt."""
    if value is None or isinstance(value, single_type):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"{num_prompts} prompts but {len(values)} {name}")
    return values
