"""Outlier channels of layers that quantize their activations to int8, chosen from a calibration
text when the engine starts.

A layer's input has a few channels much larger than the rest (the hidden state's "massive
activations", amplified by a norm's weights, or the MLP's widest products). int8 quantizes each
32-element group by its largest value, so such a channel costs the other 31 elements of its
group most of their resolution. The compiled kernel (csrc/cpu_ops.cpp, OutlierChannels) takes
OUTLIER_CHANNELS chosen channels out of the quantized activations and multiplies them exactly
in fp32 by their dequantized weights, which a layer keeps beside its codes (16 x N fp16: ~10% of
a 576-wide 4-bit layer's bytes).

Which channels: the ones with the largest |activation| over a forward pass on the shipped
calibration text (pagedserve/data/calibration.txt: prose, a chat turn, code, numbers, a few
languages), run with no outliers set so that the choice does not depend on an earlier one.
Measured on SmolLM2-135M against the exact fp32 engine on the quality test's text
(tests/models/test_quantized_model.py; AMD EPYC Zen 4), 0 / 4 / 8 / 16 channels per layer:
- bf16, every layer int8: perplexity -1.04% without (outside the 1% bound), then -0.45%, +0.18%,
  -0.51%; mean |logprob drift| 0.102, 0.079, 0.074, 0.078 nats (int16 activations: 0.053, most
  of it bf16's own rounding);
- fp32, every layer int8: perplexity -1.02% with 8, -0.47% with 4, -0.33% with 16; drift 0.098
  without, 0.071, 0.065, 0.062.
Perplexity on ~700 tokens moves by up to a percent either way with the choice; the drift falls
steadily with more channels, and 16 keeps both dtypes well inside the bound.

The pass runs on every rank in lockstep (tensor parallelism all-reduces inside it); a pipeline
stage cannot run alone, so under pipeline parallelism the int8 layers run without outlier
channels.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pagedserve.layers.linear import Linear
from pagedserve.layers.quantized import GroupQuantizedWeight

OUTLIER_CHANNELS = 16
"""Input channels per int8 layer multiplied exactly (measured as above). Their cost: 16 fp16
weights per output column beside 576 4-bit codes (a tenth more bytes to read), and 16 FMAs per
row and column block. Against int16 (`bench throughput --compare-activation-quantization int16`,
AMD EPYC Zen 4) 32 x 200-token prompts went from 1.27x with 8 channels to 1.18x with 16, batch-1
decode from 0.90x to 0.82x. Computing the channels' weights from the codes the kernel already
reads would remove the bytes (not built)."""
CALIBRATION_TOKENS = 512
"""At most this many tokens of the calibration text run (the whole text is 560 SmolLM2 tokens)."""
CALIBRATION_TEXT = pathlib.Path(__file__).parent.parent / "data" / "calibration.txt"


def calibration_text() -> str:
    return CALIBRATION_TEXT.read_text(encoding="utf-8")


def int8_linears(model: nn.Module) -> list[Linear]:
    """The layers whose compiled kernel quantizes their activations to int8."""
    return [module for module in model.modules()
            if isinstance(module, Linear) and isinstance(module.packed, GroupQuantizedWeight)
            and module.packed.activation_bits == 8]


@contextlib.contextmanager
def _recording_channel_peaks(linears: list[Linear]) -> Iterator[dict[Linear, torch.Tensor]]:
    """Each layer's largest |input| per channel over the forward passes run inside."""
    peaks: dict[Linear, torch.Tensor] = {}

    def record(module: Linear, args: tuple) -> None:
        x = args[0].detach()
        peak = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        previous = peaks.get(module)
        peaks[module] = peak if previous is None else torch.maximum(previous, peak)

    handles = [linear.register_forward_pre_hook(record) for linear in linears]
    try:
        yield peaks
    finally:
        for handle in handles:
            handle.remove()


def calibrate_outlier_channels(model: nn.Module, token_ids: list[int],
                               run_forward: Callable[[list[int]], None],
                               count: int = OUTLIER_CHANNELS) -> int:
    """Choose `count` outlier channels for each int8 layer of `model` from its activations in
    `run_forward(token_ids)` (one pass over the calibration text) and set them. Returns the
    number of layers set (0: none quantizes to int8, nothing ran). A model already calibrated
    on the same tokens keeps its channels (engines may share one loaded model: each sees the
    channels the first chose, whatever its own KV cache or attention kernels)."""
    linears = int8_linears(model)
    if not linears:
        return 0
    key = (tuple(token_ids), count)
    if getattr(model, "outlier_calibration", None) == key:
        return sum(linear.packed.outlier_channels is not None for linear in linears)
    for linear in linears:
        linear.packed.set_outlier_channels(None)
    _rebuild_decoder_stacks(model)  # a stack built earlier holds the old channels
    with _recording_channel_peaks(linears) as peaks:
        run_forward(token_ids)
    for linear in linears:
        peak = peaks.get(linear)
        if peak is None:  # a layer this pass did not run
            continue
        linear.packed.set_outlier_channels(torch.topk(peak, min(count, peak.numel())).indices)
    _rebuild_decoder_stacks(model)
    model.outlier_calibration = key
    return len(peaks)


def _rebuild_decoder_stacks(model: nn.Module) -> None:
    """The compiled decoder stack copies each layer's outlier channels when it is built: have it
    built again on its next use."""
    for module in model.modules():
        invalidate = getattr(module, "invalidate_decoder_stack", None)
        if invalidate is not None:
            invalidate()
