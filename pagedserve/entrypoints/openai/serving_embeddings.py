"""POST /v1/embeddings: inputs in, one pooling request per input through the same engine that
generates (AsyncLLM.encode), vectors back as floats or base64.

The pooling type (last token or mean) is the server's (--pooling-type); the request picks the
dimensions, normalization and encoding. Knows nothing of HTTP: api_server.py owns the route; this
module raises APIError. run-batch may call `create_embedding` with a parsed request too.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import uuid

import numpy as np

from pagedserve.engine.async_llm import EngineDeadError, EngineDrainingError
from pagedserve.engine.llm_engine import EngineSleepingError
from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.errors import bad_request
from pagedserve.entrypoints.openai.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
)
from pagedserve.entrypoints.openai.serving import OpenAIServing, engine_error
from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams

ENGINE_ERRORS = (ValueError, EngineDrainingError, EngineDeadError, EngineSleepingError)
"""What AsyncLLM.encode raises for a request it cannot serve (serving.engine_error maps them)."""


class EmbeddingServing:
    """The embeddings endpoint over the server's OpenAIServing (its model names, LoRA adapters,
    tokenizer and engine)."""

    def __init__(self, serving: OpenAIServing, pooling_type: str = "last") -> None:
        """pooling_type: one of POOLING_TYPES (ValueError otherwise)."""
        self.serving = serving
        self.async_llm = serving.async_llm
        self.default_params = PoolingParams(pooling_type)
        self.hidden_size = serving.async_llm.model_config.hidden_size

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        lora = self.serving.check_model(request.model)
        params = self._pooling_params(request)
        token_lists = await self._token_lists(request)
        response_id = f"embd-{uuid.uuid4().hex}"
        # One engine request per input, named after the response (its timeline answers to it).
        engine_ids = [f"{response_id}-{index}" for index in range(len(token_lists))]
        if self.serving.timelines is not None:
            self.serving.timelines.add_alias(response_id, engine_ids)
        vectors = await self._embed_all(token_lists, engine_ids, params, request.priority, lora)
        data = [EmbeddingData(index=index, embedding=encode_vector(vector, request.encoding_format))
                for index, vector in enumerate(vectors)]
        num_tokens = sum(len(token_ids) for token_ids in token_lists)
        return EmbeddingResponse(
            id=response_id, model=request.model or self.serving.served_model_name,
            data=data, usage=p.UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))

    def _pooling_params(self, request: EmbeddingRequest) -> PoolingParams:
        if request.dimensions is not None and request.dimensions > self.hidden_size:
            raise bad_request(f"dimensions must be at most the model's embedding size "
                              f"{self.hidden_size}, got {request.dimensions}", "dimensions")
        return dataclasses.replace(self.default_params, dimensions=request.dimensions,
                                   normalize=request.normalize)

    async def _token_lists(self, request: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, truncated as asked; 400 for an input that cannot fit."""
        inputs = request.input
        if isinstance(inputs, str) or isinstance(inputs[0], int):
            inputs = [inputs]
        tokenizer = self.serving.tokenizer
        if isinstance(inputs[0], str):
            token_lists = await asyncio.to_thread(
                lambda: [tokenizer.encode(text, request.add_special_tokens) for text in inputs])
        else:
            token_lists = [list(token_ids) for token_ids in inputs]
        max_model_len = self.serving.max_model_len
        keep = request.truncate_prompt_tokens
        if keep is not None:
            if keep > max_model_len:
                raise bad_request(f"truncate_prompt_tokens ({keep}) must be at most the context "
                                  f"length {max_model_len}", "truncate_prompt_tokens")
            keep = max_model_len if keep == -1 else keep
            token_lists = [token_ids[-keep:] if keep else [] for token_ids in token_lists]
        for token_ids in token_lists:
            if not token_ids:
                raise bad_request("input must not be empty", "input")
            self.serving._check_token_ids(token_ids, "input")  # the completions' own check
            if len(token_ids) > max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"you requested {len(token_ids)} tokens in the input for embedding "
                    f"generation. Please reduce the length of the input.", "input")
        return token_lists

    async def _embed_all(self, token_lists: list[list[int]], engine_ids: list[str],
                         params: PoolingParams, priority: int, lora: LoRARequest | None
                         ) -> list[list[float]]:
        """One engine request per input, all in flight at once. If one fails (or the caller is
        cancelled: the client went away) the others are cancelled, which aborts them."""

        async def embed_one(token_ids: list[int], engine_id: str) -> list[float]:
            final = None
            async for output in self.async_llm.encode(
                    {"prompt_token_ids": token_ids}, params, engine_id, priority=priority,
                    lora_request=lora):
                final = output
            if final is None or final.outputs is None:  # aborted: only a shutdown does that
                raise EngineDrainingError("the server is shutting down")
            return final.outputs.embedding

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(embed_one(token_ids, engine_id))
                         for token_ids, engine_id in zip(token_lists, engine_ids)]
        except* ENGINE_ERRORS as errors:
            raise engine_error(errors.exceptions[0]) from None
        return [task.result() for task in tasks]


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """floats as they are, or the base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
