"""OpenAI requests in, engine calls out, and engine outputs back as OpenAI responses or SSE chunks.

Completions and chat share one path: build prompts (tokenized off the event loop), check them
against the model's limits, build SamplingParams, start one `AsyncLLM.generate` stream per prompt
(`Generation`), then either collect the outputs or turn them into chunks. They differ only in
prompt building and in a small format object (response_formats.py). Knows nothing
of HTTP: api_server.py owns sockets, disconnects and headers; this module raises `APIError`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence

from pydantic import BaseModel

from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineDrainingError
from pagedserve.engine.llm_engine import EngineSleepingError
from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.errors import APIError, bad_request
from pagedserve.entrypoints.openai.frontend_options import FrontendOptions
from pagedserve.entrypoints.openai.generation import EventStream, Generation
from pagedserve.entrypoints.openai.request_fields import GenerationDefaults, UnknownFieldPolicy
from pagedserve.entrypoints.openai.response_formats import (
    ChatFormat,
    Choice,
    CompletionFormat,
    PromptInput,
    ResponseFormat,
    Usage,
    clamp_logprob,
    sse,
)
from pagedserve.entrypoints.openai.serving_lora import LoRAServing
from pagedserve.entrypoints.openai.tool_prompts import ToolPlan, plan_tools, template_messages
from pagedserve.lora.request import LoRARequest
from pagedserve.observability.timeline import TimelineStore
from pagedserve.outputs import PositionLogprobs, RequestOutput
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
"""vLLM's older request fields -> the StructuredOutputsParams field each one sets."""

GRAMMAR_VALIDATION_TIMEOUT_S = 10.0
"""A constraint that takes longer than this to check is refused (400)."""

def engine_error(error: ValueError | EngineDrainingError | EngineDeadError | EngineSleepingError
                 ) -> APIError:
    """The APIError for an exception out of AsyncLLM.generate (ValueError: bad input)."""
    if isinstance(error, EngineSleepingError):
        return APIError(503, "the engine is sleeping (sleep mode): POST /wake_up first",
                        code="engine_sleeping")
    if isinstance(error, EngineDrainingError):
        return APIError(503, "the server is shutting down", code="shutting_down")
    if isinstance(error, EngineDeadError):
        return APIError(500, "the engine has failed; the server must be restarted",
                        code="engine_dead")
    # The engine's messages name the offending field first ("bad_words tokenize to ...").
    name = str(error).split(" ", 1)[0]
    return bad_request(str(error), name if name in p.GenerationRequest.model_fields else None)


# ---- the service ------------------------------------------------------------------------------


class OpenAIServing:
    """The OpenAI API over one AsyncLLM. Each public coroutine raises APIError for bad requests."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str,
                 lora: LoRAServing | None = None, timelines: TimelineStore | None = None,
                 options: FrontendOptions | None = None, *, strict_requests: bool = False,
                 generation_defaults: GenerationDefaults | None = None) -> None:
        """lora: the LoRA adapters requests may name as `model` (None: LoRA is off).
        timelines: where requests' timelines are kept (None: return_timeline gives none).
        options: the server flags' effect on answers (names, chat template, logprobs).
        strict_requests: unknown request fields are a 400 (else a warning once per name).
        generation_defaults: sampling defaults for fields a request leaves out."""
        self.async_llm = async_llm
        self.options = options or FrontendOptions()
        self.unknown_fields = UnknownFieldPolicy(strict_requests)
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.timelines = timelines
        self.tokenizer = async_llm.tokenizer
        self.served_model_name = served_model_name
        self.lora = lora
        self.max_model_len = async_llm.max_model_len
        self.vocab_size = async_llm.model_config.vocab_size

    # ---- endpoints ----

    def models(self) -> p.ModelList:
        cards = [self.model_card()]
        cards += [self.model_card(alias) for alias in self.options.served_model_aliases]
        if self.lora is not None:
            cards += self.lora.model_cards(self.max_model_len)
        return p.ModelList(data=cards)

    def model_card(self, model_id: str | None = None) -> p.ModelCard:
        """The card of the base model, or of the adapter named `model_id`."""
        if self.check_model(model_id) is not None:
            return self.lora.model_card(model_id, self.max_model_len)
        name = model_id if model_id in self.options.served_model_aliases else self.served_model_name
        return p.ModelCard(id=name, max_model_len=self.max_model_len,
                           root=self.served_model_name)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        if (model is None or model == self.served_model_name
                or model in self.options.served_model_aliases):
            return None
        lora = self.lora.lookup(model) if self.lora is not None else None
        if lora is None:
            shown = model if len(model) <= 100 else model[:100] + "..."
            raise APIError(404, f"The model `{shown}` does not exist.", param="model",
                           code="model_not_found")
        return lora

    def response_model(self, request: p.GenerationRequest) -> str:
        """The `model` a response names: the adapter's when the request picked one (checked on
        arrival: an adapter unloaded since still names the request it served)."""
        return request.model or self.served_model_name

    async def create_completion(
        self, request: p.CompletionRequest
    ) -> p.CompletionResponse | EventStream:
        """The full response, or (stream=True) the SSE events once generation runs."""
        self._check_common(request)
        if request.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of is not supported (use n)", "best_of")
        prompts = [self._truncate(prompt, request.truncate_prompt_tokens)
                   for prompt in await self._completion_prompts(request.prompt)]
        if len(prompts) * request.n > p.MAX_PROMPTS:
            raise bad_request(f"n ({request.n}) times the number of prompts ({len(prompts)}) "
                              f"must be at most {p.MAX_PROMPTS}", "n")
        self._check_num_logprobs(request.logprobs, "logprobs")
        # echo with logprobs shows the prompt's logprobs too: one engine pass serves both.
        wanted = [request.prompt_logprobs, request.logprobs if request.echo else None]
        prompt_logprobs = max((k for k in wanted if k is not None), default=None)
        constraint = await self._structured_outputs(request)
        default_max_tokens = self.generation_defaults.max_tokens or 16  # OpenAI's default: 16
        params = [self._sampling_params(request, prompt, request.max_tokens,
                                        default_max_tokens=default_max_tokens,
                                        logprobs=request.logprobs,
                                        prompt_logprobs=prompt_logprobs,
                                        structured_outputs=constraint)
                  for prompt in prompts]
        response_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(self, request, response_id, prompts)
        return await self._run(request, prompts, params, fmt)

    async def prepare_chat_completion(
        self, request: p.ChatCompletionRequest
    ) -> tuple[PromptInput, list[SamplingParams], ToolPlan]:
        """The checked prompt and sampling params of a chat request (APIError for bad input).
        /v1/responses turns its requests into chat requests and starts them from here."""
        self._check_common(request)
        if request.top_logprobs and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        self._check_num_logprobs(request.top_logprobs, "top_logprobs")
        try:
            tool_plan = plan_tools(request)
        except ValueError as error:
            raise bad_request(str(error), "tool_choice" if request.tools else "tools") from None
        constraint = await self._structured_outputs(request, tool_plan)
        prompt = await self._chat_prompt(request.messages, request, tool_plan.tools_in_prompt)
        prompt = self._truncate(prompt, request.truncate_prompt_tokens)
        max_tokens = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = [self._sampling_params(request, prompt, max_tokens, logprobs=logprobs,
                                        default_max_tokens=self.generation_defaults.max_tokens,
                                        prompt_logprobs=request.prompt_logprobs,
                                        max_tokens_param=param, prompt_param="messages",
                                        structured_outputs=constraint)]
        return prompt, params, tool_plan

    async def create_chat_completion(
        self, request: p.ChatCompletionRequest
    ) -> p.ChatCompletionResponse | EventStream:
        prompt, params, tool_plan = await self.prepare_chat_completion(request)
        response_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(self, request, response_id, prompt, tool_plan.parser)
        return await self._run(request, [prompt], params, fmt)

    async def tokenize(self, request: p.TokenizeRequest) -> p.TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if request.messages is not None:
            token_ids = (await self._chat_prompt(request.messages, request)).token_ids
        else:
            token_ids = await asyncio.to_thread(self.tokenizer.encode, request.prompt,
                                                request.add_special_tokens)
        return p.TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len,
                                  tokens=token_ids)

    async def detokenize(self, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self.check_model(request.model)
        self._check_token_ids(request.tokens, "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, request.tokens)
        return p.DetokenizeResponse(prompt=text)

    # ---- prompts ----

    async def _completion_prompts(self, prompt: str | list) -> list[PromptInput]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            if not all(texts):
                raise bad_request("prompt must not be empty", "prompt")
            token_lists = await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])
            prompts = [PromptInput(ids, text) for ids, text in zip(token_lists, texts)]
        else:
            token_lists = [prompt] if isinstance(prompt[0], int) else prompt
            prompts = [PromptInput(list(ids), None) for ids in token_lists]
        for prompt_input in prompts:
            if not prompt_input.token_ids:
                raise bad_request("prompt must not be empty", "prompt")
            self._check_token_ids(prompt_input.token_ids, "prompt")
        return prompts

    async def _chat_prompt(self, messages: list[p.ChatMessage], fields: p.ChatTemplateFields,
                           tools: list[p.ChatTool] | None = None) -> PromptInput:
        chat_template = self.options.chat_template
        if fields.chat_template is not None:
            if not self.options.trust_request_chat_template:
                raise bad_request("this server does not render a request's own chat_template "
                                  "(start it with --trust-request-chat-template)",
                                  "chat_template")
            chat_template = fields.chat_template
        conversation, template_tools = template_messages(
            messages, tools, self.tokenizer.supports_tools_in_template(chat_template))
        template_kwargs = self.options.template_kwargs(fields.chat_template_kwargs)

        def render() -> tuple[str, list[int]]:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=fields.add_generation_prompt,
                tools=template_tools, chat_template=chat_template,
                continue_final_message=fields.continue_final_message,
                template_kwargs=template_kwargs)
            return text, self.tokenizer.encode(text, add_special_tokens=False)

        try:
            text, token_ids = await asyncio.to_thread(render)
        except ValueError as error:
            raise bad_request(str(error), "messages") from None
        if not token_ids:
            raise bad_request("the rendered conversation is empty", "messages")
        return PromptInput(token_ids, text)

    def _check_num_logprobs(self, num_logprobs: int | None, param: str) -> None:
        if num_logprobs is not None and num_logprobs > self.options.max_logprobs:
            raise bad_request(f"{param} must be at most {self.options.max_logprobs} on this "
                              f"server (--max-logprobs), got {num_logprobs}", param)

    def _check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise bad_request(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})", param)

    # ---- sampling parameters ----

    def _check_common(self, request: p.GenerationRequest) -> None:
        self.unknown_fields.check(request)
        self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        self._check_num_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.stream and request.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not available with stream=true (as in vLLM)",
                              "prompt_logprobs")
        if request.allowed_token_ids:
            self._check_token_ids(request.allowed_token_ids, "allowed_token_ids")

    def _truncate(self, prompt: PromptInput, truncate_prompt_tokens: int | None) -> PromptInput:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: the context length), as vLLM
        keeps them; the text is dropped, as it no longer matches (echo decodes the ids)."""
        if truncate_prompt_tokens is None:
            return prompt
        num_kept = (self.max_model_len if truncate_prompt_tokens == -1
                    else truncate_prompt_tokens)
        if not 1 <= num_kept <= self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens must be -1 (the context length) or in "
                              f"[1, {self.max_model_len}], got {truncate_prompt_tokens}",
                              "truncate_prompt_tokens")
        if len(prompt.token_ids) <= num_kept:
            return prompt
        return PromptInput(prompt.token_ids[-num_kept:], None)

    async def _structured_outputs(self, request: p.GenerationRequest,
                                  tool_plan: ToolPlan | None = None
                                  ) -> StructuredOutputsParams | None:
        """The request's constraint (response_format, structured_outputs or a forced tool call),
        checked to compile before anything is scheduled; 400 says what is wrong."""
        sources = []
        if request.response_format is not None and request.response_format.type != "text":
            sources.append("response_format")
        if request.structured_outputs is not None:
            sources.append("structured_outputs")
        sources += [name for name in _GUIDED_FIELDS if getattr(request, name) is not None]
        if tool_plan is not None and tool_plan.constraint is not None:
            sources.append("tool_choice")
        if len(sources) > 1:
            raise bad_request(f"give only one of {' and '.join(sources)}", sources[-1])
        if not sources:
            return None
        param = sources[0]
        try:
            if param == "tool_choice":
                constraint = tool_plan.constraint
            elif param in _GUIDED_FIELDS:
                constraint = StructuredOutputsParams(**{_GUIDED_FIELDS[param]:
                                                        getattr(request, param)})
            elif param == "structured_outputs":
                so = request.structured_outputs
                constraint = StructuredOutputsParams(json=so.json_, json_object=so.json_object,
                                                     regex=so.regex, choice=so.choice,
                                                     grammar=so.grammar)
            elif request.response_format.type == "json_object":
                constraint = StructuredOutputsParams(json_object=True)
            else:
                json_schema = request.response_format.json_schema
                if json_schema is None or json_schema.schema_ is None:
                    raise ValueError('response_format of type "json_schema" needs '
                                     '{"json_schema": {"name": ..., "schema": {...}}}')
                constraint = StructuredOutputsParams(json=json_schema.schema_)
        except ValueError as error:
            raise bad_request(str(error), param) from None
        whitespace_pattern = request.guided_whitespace_pattern
        if request.structured_outputs is not None and whitespace_pattern is None:
            whitespace_pattern = request.structured_outputs.whitespace_pattern
        constraint = self._with_whitespace_pattern(constraint, whitespace_pattern)
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self.async_llm.validate_structured_outputs, constraint),
                GRAMMAR_VALIDATION_TIMEOUT_S)
        except TimeoutError:
            raise bad_request(f"{param}: the constraint took longer than "
                              f"{GRAMMAR_VALIDATION_TIMEOUT_S:g} s to compile", param) from None
        except ValueError as error:
            raise bad_request(f"{param}: {error}", param) from None
        return constraint

    @staticmethod
    def _with_whitespace_pattern(constraint: StructuredOutputsParams, pattern: str | None
                                 ) -> StructuredOutputsParams:
        """guided_whitespace_pattern: a JSON schema constraint carries it to llguidance as the
        schema's own "x-guidance" option; other constraints have no JSON whitespace."""
        if pattern is None or constraint.json is None:
            return constraint
        schema = constraint.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return constraint  # the backend's validation reports the broken JSON
        if not isinstance(schema, dict):
            return constraint
        options = dict(schema.get("x-guidance") or {}, whitespace_pattern=pattern)
        return StructuredOutputsParams(json={**schema, "x-guidance": options})

    def _sampling_params(
        self,
        request: p.GenerationRequest,
        prompt: PromptInput,
        max_tokens: int | None,
        *,
        default_max_tokens: int | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        max_tokens_param: str = "max_tokens",
        prompt_param: str = "prompt",
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        num_prompt_tokens = len(prompt.token_ids)
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {num_prompt_tokens} tokens and at least one must be generated.", prompt_param)
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} in the completion).", max_tokens_param)
        if request.stop_token_ids:
            self._check_token_ids(request.stop_token_ids, "stop_token_ids")
        # A field the request leaves out takes the model's default (--generation-config), then
        # the API's; a value the request gives always wins.
        defaults = self.generation_defaults

        def pick(value, default, api_default):
            if value is not None:
                return value
            return api_default if default is None else default

        try:
            return SamplingParams(
                n=request.n,
                temperature=pick(request.temperature, defaults.temperature, 1.0),
                top_p=pick(request.top_p, defaults.top_p, 1.0),
                top_k=pick(request.top_k, defaults.top_k, 0),
                min_p=pick(request.min_p, defaults.min_p, 0.0),
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty,
                                        1.0),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logit_bias=self._logit_bias(request.logit_bias),
                structured_outputs=structured_outputs,
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
            )
        except ValueError as error:
            # SamplingParams names the offending field first: "top_p must be in (0, 1], got 0".
            name = str(error).split(" ", 1)[0]
            param = max_tokens_param if name == "max_tokens" else name
            raise bad_request(str(error), param if param in type(request).model_fields else None
                              ) from None

    def _logit_bias(self, logit_bias: dict[str, float] | None) -> dict[int, float] | None:
        if not logit_bias:
            return None
        biases = {}
        for key, bias in logit_bias.items():
            # len() first: int() of a 10,000-digit string raises (and takes time).
            if not (key.isascii() and key.isdigit() and len(key) <= 10
                    and int(key) < self.vocab_size):
                shown = key if len(key) <= 20 else key[:20] + "..."
                raise bad_request(f"logit_bias key {shown!r} is not a token id in "
                                  f"[0, {self.vocab_size})", "logit_bias")
            biases[int(key)] = bias
        return biases

    # ---- running ----

    async def start_generation(self, request: p.GenerationRequest, prompts: list[PromptInput],
                               params: list[SamplingParams], response_id: str) -> Generation:
        """One engine request per prompt, started: bad input the engine finds is an APIError
        here, before any response begins. The caller must aclose() the Generation."""
        # Engine ids are ours alone: clients' request_id values may repeat.
        base_id = f"cmpl-{uuid.uuid4().hex}"
        lora = self.check_model(request.model)
        engine_ids = [f"{base_id}-{index}" for index in range(len(prompts))]
        if self.timelines is not None:
            self.timelines.add_alias(response_id, engine_ids)
        streams = [
            self.async_llm.generate({"prompt_token_ids": prompt.token_ids}, prompt_params,
                                    engine_id, priority=request.priority,
                                    cache_salt=request.cache_salt, lora_request=lora)
            for engine_id, prompt, prompt_params in zip(engine_ids, prompts, params)
        ]
        generation = Generation(streams)
        try:
            await generation.start()
        except (ValueError, EngineDrainingError, EngineDeadError, EngineSleepingError) as error:
            raise engine_error(error) from None
        return generation

    async def _run(self, request: p.GenerationRequest, prompts: list[PromptInput],
                   params: list[SamplingParams], fmt: ResponseFormat) -> BaseModel | EventStream:
        generation = await self.start_generation(request, prompts, params, fmt.response_id)
        usage = Usage([len(prompt.token_ids) for prompt in prompts])
        if request.stream:
            options = request.stream_options or p.StreamOptions()
            events = self._stream(generation, fmt, usage, request.n, bool(options.include_usage),
                                  request.return_timeline, bool(options.continuous_usage_stats))
            return EventStream(events, generation)
        response = await self._collect(generation, fmt, usage, request.n)
        if request.return_timeline:
            response.timeline = self._timeline(fmt.response_id)
        return response

    def _timeline(self, response_id: str) -> dict | None:
        return self.timelines.get(response_id) if self.timelines is not None else None

    async def _collect(self, generation: Generation, fmt: ResponseFormat, usage: Usage,
                       n: int) -> BaseModel:
        choices: dict[int, Choice] = {}
        last_outputs: dict[int, RequestOutput] = {}
        try:
            async for prompt_index, output in generation.outputs():
                usage.add(prompt_index, output)
                last_outputs[prompt_index] = output
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    choices.setdefault(index, Choice()).add(completion)
        except (EngineDrainingError, EngineDeadError) as error:
            raise engine_error(error) from None
        finally:
            await generation.aclose()
        final = [fmt.final_choice(index, index // n, choices[index], last_outputs[index // n])
                 for index in sorted(choices)]
        return fmt.response(final, usage.info(), last_outputs)

    async def _stream(self, generation: Generation, fmt: ResponseFormat, usage: Usage,
                      n: int, include_usage: bool, return_timeline: bool = False,
                      continuous_usage: bool = False) -> AsyncIterator[str]:
        """continuous_usage: every chunk carries the usage so far (vLLM's
        continuous_usage_stats); include_usage: a last chunk carries the total."""
        choices: dict[int, Choice] = {}

        def with_usage(chunk: BaseModel) -> BaseModel:
            if continuous_usage:
                chunk.usage = usage.info()
            return chunk

        try:
            for chunk in fmt.initial_chunks():
                yield sse(with_usage(chunk))
            async for prompt_index, output in generation.outputs():
                usage.add(prompt_index, output)
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    choice = choices.setdefault(index, Choice())
                    if choice.finish_reason is not None:
                        continue  # a finished sibling (n > 1), repeated with nothing new
                    streamed = fmt.stream_choice(index, prompt_index, output, completion, choice)
                    choice.finish_reason = completion.finish_reason
                    if streamed is not None:
                        yield sse(with_usage(fmt.chunk([streamed])))
            if include_usage or return_timeline:
                chunk = fmt.chunk([], usage=usage.info() if include_usage else None)
                if return_timeline:
                    chunk.timeline = self._timeline(fmt.response_id)
                yield sse(chunk)
        except (EngineDrainingError, EngineDeadError) as error:
            yield sse(engine_error(error).body())
        finally:
            await generation.aclose()
        yield "data: [DONE]\n\n"

    # ---- logprobs ----

    def completion_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                            first_offset: int, num_top: int) -> p.CompletionLogProbs:
        """Parallel lists; `positions[i]` is None for a prompt's first token (no logprob).
        num_top: the request's `logprobs` (echoed prompt positions may carry more, when
        prompt_logprobs asked for more)."""
        result = p.CompletionLogProbs()
        offset = first_offset
        for token_id, position in zip(token_ids, positions):
            if position is None or token_id not in position:
                text = self.tokenizer.decode_token(token_id)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                text = position[token_id].decoded_token or ""
                result.token_logprobs.append(clamp_logprob(position[token_id].logprob))
                result.top_logprobs.append({
                    self._logprob_token(top_id, lp.decoded_token): clamp_logprob(lp.logprob)
                    for top_id, lp in position.items()
                    if top_id == token_id or lp.rank is None or lp.rank <= num_top})
            result.tokens.append(self._logprob_token(token_id, text))
            result.text_offset.append(offset)
            offset += len(text)  # offsets count text, whatever the token's spelling
        return result

    def prompt_logprobs(self, request: p.GenerationRequest, output: RequestOutput
                        ) -> p.PromptLogprobs | None:
        """vLLM's prompt_logprobs field: per prompt position, the actual token and the top
        `request.prompt_logprobs` (None when the request did not ask)."""
        num_top = request.prompt_logprobs
        if num_top is None or output.prompt_logprobs is None:
            return None
        result: p.PromptLogprobs = []
        for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs):
            if position is None:
                result.append(None)
                continue
            result.append({
                other_id: p.PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                          decoded_token=lp.decoded_token)
                for other_id, lp in position.items()
                if other_id == token_id or (lp.rank is not None and lp.rank <= num_top)})
        return result

    def chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs],
                      num_top: int) -> p.ChatLogProbs:
        content = []
        for token_id, position in zip(token_ids, positions):
            chosen = position[token_id]
            top = sorted(((top_id, lp) for top_id, lp in position.items()
                          if lp.rank is not None and lp.rank <= num_top),
                         key=lambda item: item[1].rank)[:num_top]
            content.append(p.ChatLogProbsContent(
                token=self._logprob_token(token_id, chosen.decoded_token),
                logprob=clamp_logprob(chosen.logprob),
                bytes=list((chosen.decoded_token or "").encode()),
                top_logprobs=[p.ChatLogProb(token=self._logprob_token(top_id, lp.decoded_token),
                                            logprob=clamp_logprob(lp.logprob),
                                            bytes=list((lp.decoded_token or "").encode()))
                              for top_id, lp in top]))
        return p.ChatLogProbs(content=content)

    def _logprob_token(self, token_id: int, decoded_token: str | None) -> str:
        """A logprob entry's `token`: its text, or with --return-tokens-as-token-ids
        "token_id:N" (vLLM's spelling; exact where a token is part of a UTF-8 character)."""
        if self.options.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return decoded_token or ""
