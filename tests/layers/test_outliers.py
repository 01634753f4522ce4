"""Outlier channels of int8 layers (layers/outliers.py): chosen at start-up on the calibration
text, the same choice for the same weights, chosen again for weights loaded later (a level-2
wake-up, update_weights), and none where no layer quantizes its activations to int8."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.llm import LLM
from pagedserve.layers.outliers import OUTLIER_CHANNELS, int8_linears
from pagedserve.sampling_params import SamplingParams
from tests.cpu import VECTORIZED_INTEGER_MATMUL

pytestmark = VECTORIZED_INTEGER_MATMUL  # int8 layers in portable loops: minutes per forward pass


def _channels(llm: LLM) -> list[list[int]]:
    model = llm.engine.executor.worker.model_runner.model
    return [linear.packed.outlier_channels.tolist() for linear in int8_linears(model)]


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=12)
    [output] = llm.generate([{"prompt_token_ids": list(range(100, 140))}], params)
    return output.outputs[0].token_ids


@pytest.fixture
def engine(model_path):
    """A fresh engine of the default model in fp32 with int8 activations (not the suite's
    shared weights: its model is replaced here)."""
    llm = LLM(model=model_path, dtype="float32", activation_quantization="int8",
              kv_cache_memory="64MiB", enable_sleep_mode=True)
    yield llm
    llm.engine.assert_idle()
    llm.engine.shutdown()


def test_weights_loaded_later_get_the_same_outlier_channels(engine, model_path):
    chosen = _channels(engine)
    assert len(chosen) == 4 * engine.engine.config.model.num_hidden_layers
    assert all(len(channels) == OUTLIER_CHANNELS for channels in chosen)
    before = _greedy(engine)

    engine.sleep(2)  # the weights go; waking reloads them from the file
    engine.wake_up()
    assert _channels(engine) == chosen
    assert _greedy(engine) == before

    engine.update_weights(model_path)  # a new model object, the same weights
    model = engine.engine.executor.worker.model_runner.model
    assert model.outlier_calibration[1] == OUTLIER_CHANNELS
    assert _channels(engine) == chosen
    assert _greedy(engine) == before


def test_no_int8_layer_no_calibration(model_path):
    llm = LLM(model=model_path, dtype="float32", activation_quantization="int16",
              kv_cache_memory="64MiB")
    try:
        model = llm.engine.executor.worker.model_runner.model
        assert int8_linears(model) == []
        assert not hasattr(model, "outlier_calibration")
        assert llm.engine.executor.calibrate_outlier_channels([1, 2, 3]) == 0
    finally:
        llm.engine.shutdown()


def test_calibration_ignores_channels_chosen_before(engine):
    """Choosing again on the same model clears the old channels first, so the pass sees plain
    int8 activations and picks what the first pass picked."""
    model = engine.engine.executor.worker.model_runner.model
    chosen = _channels(engine)
    for linear in int8_linears(model):  # any other channels
        linear.packed.set_outlier_channels(torch.arange(OUTLIER_CHANNELS))
    del model.outlier_calibration  # (else the same tokens keep what is set)
    tokens = list(engine.engine.executor.worker.calibration_token_ids)
    assert engine.engine.executor.calibrate_outlier_channels(tokens) == len(chosen)
    assert _channels(engine) == chosen
