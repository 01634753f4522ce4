"""What LLMEngine does once, at start-up, around the executor: checking that the configured
features run together, choosing the int8 layers' outlier channels, building the KV tiers'
scheduler half (its cost model timed on this engine's own prefill), and describing the KV pool
for the start-up log."""

from __future__ import annotations

import logging

import torch

from pagedserve.attention.kv_cache import KVCacheSpec
from pagedserve.config import EngineConfig, async_scheduling_conflicts
from pagedserve.core.kv_cache_groups import KVCacheLayout
from pagedserve.executor import Executor
from pagedserve.kv_transfer.cost_model import PrefillProfile, PrefillTiming
from pagedserve.kv_transfer.tiered import (
    TieredConnectorScheduler,
    TieredOptions,
    parse_tiers,
)
from pagedserve.layers.outliers import (
    CALIBRATION_TOKENS,
    OUTLIER_CHANNELS,
    calibration_text,
)
from pagedserve.spec_decode.draft_model import check_same_tokenizer
from pagedserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def check_engine_config(config: EngineConfig, tokenizer: Tokenizer) -> TieredOptions | None:
    """Raise ValueError for features configured together that do not run together yet, or a
    draft model whose tokenizer differs from the target's; returns the KV tiers' parsed options
    (None: no tiers). Runs before the weights load, so a bad config fails fast."""
    draft_path = config.speculative.draft_model_path if config.speculative else None
    if draft_path is not None:
        check_same_tokenizer(tokenizer, Tokenizer.from_path(draft_path), draft_path)
    config.parallel.verify_with_model(config.model)
    if config.speculative is not None and config.parallel.world_size > 1:
        raise ValueError("speculative decoding does not run with tensor or pipeline "
                         "parallelism yet")
    if config.kv_transfer is not None and config.parallel.world_size > 1:
        raise ValueError("KV tiers (kv_transfer_config) do not run with tensor or "
                         "pipeline parallelism yet")
    if config.scheduler.async_scheduling:
        conflicts = async_scheduling_conflicts(config.speculative, config.parallel,
                                               config.kv_transfer)
        if conflicts:
            raise ValueError(f"async scheduling does not run with {' or '.join(conflicts)} "
                             "yet")
    if config.kv_transfer is None:
        return None
    return parse_tiers(config.kv_transfer, config.device.device)


def calibrate_outlier_channels(executor: Executor, tokenizer: Tokenizer, config: EngineConfig,
                               num_blocks: int) -> str:
    """Have the workers choose their int8 layers' outlier channels from the calibration text
    (layers/outliers.py); what was done, for the start-up log."""
    limit = min(CALIBRATION_TOKENS, config.scheduler.max_model_len,
                (num_blocks - 1) * config.cache.block_size)
    vocab_size = config.model.vocab_size  # (a test's tiny model may have fewer tokens)
    token_ids = [t for t in tokenizer.encode(calibration_text()) if t < vocab_size]
    token_ids = token_ids[:limit]
    if not token_ids:
        return "none (no room in the KV pool for the calibration text)"
    layers = executor.calibrate_outlier_channels(token_ids)
    if not layers:
        if config.parallel.pipeline_parallel_size > 1:
            return ("none (pipeline stages cannot run the calibration pass alone: int8 "
                    "layers run without outlier channels)")
        return "none (no layer quantizes its activations to int8 here)"
    return (f"{OUTLIER_CHANNELS} int8 input channels multiplied exactly in each of {layers} "
            f"layers, chosen on {len(token_ids)} calibration tokens")


def create_kv_connector(executor: Executor, config: EngineConfig, options: TieredOptions | None,
                        num_blocks: int) -> TieredConnectorScheduler | None:
    """The KV tiers' scheduler half, its cost model calibrated on this engine's own prefill
    (None: no tiers configured)."""
    if options is None:
        return None
    prefill = None
    if options.load_policy == "cost":
        prefill = PrefillProfile.fit(_time_prefills(executor, config, num_blocks))
        logger.info("KV tier cost model: recomputing costs %.1f us/token + %.4f us/token per "
                    "context token", prefill.seconds_per_token * 1e6,
                    prefill.seconds_per_token_per_context * 1e6)
    model = config.model
    spec = KVCacheSpec.create(  # one rank holds the whole model (tiers need world size 1)
        config.cache.cache_dtype, getattr(torch, config.device.dtype),
        model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
        config.cache.block_size)
    return TieredConnectorScheduler(config, options, prefill, spec.bytes_per_block)


def _time_prefills(executor: Executor, config: EngineConfig,
                   num_blocks: int) -> list[PrefillTiming]:
    """Time a prefill chunk at context 0 and after a long context (as long as the pool and the
    context length allow), each the best of two after a warm-up."""
    block_size = config.cache.block_size
    num_tokens = min(128, config.scheduler.max_num_batched_tokens)
    max_context = min((num_blocks - 2) * block_size - num_tokens,
                      config.scheduler.max_model_len - num_tokens - 1, 1024)
    contexts = [0] + ([max_context] if max_context >= num_tokens else [])
    executor.time_prefill(num_tokens, 0)  # warm-up
    return [PrefillTiming(num_tokens, context, min(
                executor.time_prefill(num_tokens, context) for _ in range(2)))
            for context in contexts]


def describe_kv_cache_groups(layout: KVCacheLayout) -> str:
    """For the start-up log: how the pool's blocks are shared ("" for one global group)."""
    if layout.windows == (None,):
        return ""
    if layout.num_groups == 1:
        return f" (every layer's window is {layout.windows[0]}: blocks it passed are freed)"
    num_global = sum(window is None for window in layout.windows)
    windows = sorted({window for window in layout.windows if window is not None})
    return (f" of {layout.layers_per_block} layers each, in {layout.num_groups} KV cache groups "
            f"({num_global} global, {layout.num_groups - num_global} with a window of "
            f"{'/'.join(map(str, windows))} that frees the blocks it passed)")
