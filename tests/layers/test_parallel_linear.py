"""Tensor-parallel slices of GGUF codes, one process: each rank's layer is built under a stand-in
TP group (no collectives run) and loaded from the full matrix.

A column split keeps the codes packed and equals rows of the dequantized matrix; a row split on
32-element group boundaries keeps them packed and equals its columns; a row split inside a group
falls back to dense (with one warning naming the layer). The vocabulary pads to a multiple of tp.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.distributed import parallel_state
from pagedserve.distributed.parallel_state import GroupCoordinator
from pagedserve.layers.linear import MergedLinear, RowParallelLinear, VocabEmbedding
from pagedserve.layers.quantized import GQT, GGUFQuantWeight, decode_gguf_blocks
from pagedserve.models.decoder_stack import build_decoder_stack
from tests.layers.test_quantized import synthetic_blocks


@pytest.fixture
def as_tp_rank(monkeypatch):
    """as_tp_rank(rank, size): layers built afterwards see that TP rank (collectives unusable)."""

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP",
                            GroupCoordinator(list(range(size)), rank, device_group=None))

    return set_rank


def _dense_weight(layer) -> torch.Tensor:
    """The layer's weights, dense: its dense weight, or (a layer on the compiled kernels holds
    only its codes) those codes dequantized."""
    if layer.weight is not None:
        return layer.weight
    out = torch.empty(layer.packed.out_features, layer.packed.in_features)
    layer.packed.dequantize_into(out)
    return out


def _assert_packed_matches_dense(layer) -> None:
    """The packed kernel runs on the shard's shape and agrees with its dense weights."""
    weight = _dense_weight(layer)
    x = torch.randn(3, weight.shape[1])
    dense = x @ weight.t()
    error = (layer.packed(x.bfloat16()).float() - dense).norm() / dense.norm()
    assert error < 1e-2, error  # bf16 activations only


def _gguf(qtype: GQT, n: int, k: int, seed: int) -> GGUFQuantWeight:
    return decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed), qtype, (n, k))


def test_column_split_keeps_codes_packed(as_tp_rank):
    k, tp = 256, 2
    full = {"q": _gguf(GQT.Q4_K, 64, k, 1), "k": _gguf(GQT.Q4_1, 32, k, 2),
            "v": _gguf(GQT.Q4_0, 32, k, 3)}
    for rank in range(tp):
        as_tp_rank(rank, tp)
        layer = MergedLinear(k, {"q": 64, "k": 32, "v": 32})
        for shard_id, weight in full.items():
            layer.weight_loader(layer.weight, weight, shard_id)
        pending = layer.weight.pending_quant
        expected = []
        for shard_id, weight in full.items():
            rows = slice(rank * weight.shape[0] // tp, (rank + 1) * weight.shape[0] // tp)
            assert isinstance(pending[shard_id], GGUFQuantWeight)  # still codes, not floats
            assert torch.equal(pending[shard_id].codes, weight.codes[rows])
            expected.append(weight.dequantize()[rows])
        layer.process_weights_after_loading(torch.bfloat16)
        assert layer.packed is not None  # every shard packable: the int4 kernel serves it
        _assert_packed_matches_dense(layer)
        assert torch.equal(_dense_weight(layer), torch.cat(expected))  # fp32 until .to


def test_row_split_on_group_boundaries_keeps_codes_packed(as_tp_rank):
    n, k, tp = 48, 256, 4  # 64 columns per rank: two whole groups
    full = _gguf(GQT.Q8_0, n, k, 4)
    for rank in range(tp):
        as_tp_rank(rank, tp)
        layer = RowParallelLinear(k, n)
        layer.weight_loader(layer.weight, full)
        shard = layer.weight.pending_quant[None]
        columns = slice(rank * k // tp, (rank + 1) * k // tp)
        assert torch.equal(shard.dequantize(), full.dequantize()[:, columns])
        layer.process_weights_after_loading(torch.bfloat16)
        assert layer.packed is not None
        _assert_packed_matches_dense(layer)


def test_row_split_inside_a_group_falls_back_to_dense(as_tp_rank, caplog):
    n, k, tp = 32, 192, 4  # 48 columns per rank: not whole 32-element groups
    full = _gguf(GQT.Q4_1, n, k, 5)
    as_tp_rank(1, tp)
    layer = RowParallelLinear(k, n, prefix="model.layers.3.mlp.down_proj")
    with caplog.at_level(logging.WARNING):
        layer.weight_loader(layer.weight, full)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "model.layers.3.mlp.down_proj"]
    assert not hasattr(layer.weight, "pending_quant")
    assert torch.equal(layer.weight, full.dequantize()[:, 48:96])
    layer.process_weights_after_loading(torch.bfloat16)
    assert layer.packed is None


def test_vocab_split_pads_and_keeps_tied_head_codes(as_tp_rank):
    vocab, hidden, tp = 10, 64, 4  # 3 rows per rank; the last rank: row 9 and two padding rows
    full = _gguf(GQT.Q4_0, vocab, hidden, 6)
    dense = full.dequantize()
    as_tp_rank(3, tp)
    table = VocabEmbedding(vocab, hidden, serves_as_head=True)
    table.weight_loader(table.weight, full)
    assert table.weight.pending_quant[None].shape == (3, hidden)
    table.process_weights_after_loading(torch.bfloat16)
    assert table.packed_head is not None
    logits = table.packed_head(torch.randn(2, hidden).bfloat16()).float()  # this rank's 3 rows
    assert logits.shape == (2, 3) and not logits[:, 1:].any()  # padding rows: zero logits
    # The rank's rows: a dense table, or (on the compiled kernels) looked up on the codes
    rows = table.weight if table.packed_table is None else table.packed_table.lookup(
        torch.arange(3))
    assert torch.equal(rows[:1], dense[9:].to(rows.dtype))
    assert not rows[1:].any()

    as_tp_rank(1, tp)
    dense_table = VocabEmbedding(vocab, hidden, serves_as_head=True)
    dense_table.weight_loader(dense_table.weight, dense)
    assert torch.equal(dense_table.weight, dense[3:6])


def test_quantize_on_load_quantizes_the_local_shard(as_tp_rank):
    torch.manual_seed(0)
    n, k, tp = 32, 128, 2
    full = torch.randn(n, k)
    as_tp_rank(1, tp)
    layer = RowParallelLinear(k, n)
    layer.weight_loader(layer.weight, full)
    layer.process_weights_after_loading(torch.bfloat16, quantize="int8")
    assert layer.weight is None and layer.packed is not None
    x = torch.randn(4, k // tp)
    expected = x @ full[:, k // tp :].t()  # rank 1: the second half of the input columns
    error = (layer.packed(x.bfloat16()).float() - expected).norm() / expected.norm()
    assert error < 2e-2, error  # int8 codes and bf16 activations


def test_decoder_stack_is_off_under_tensor_parallelism(as_tp_rank):
    as_tp_rank(0, 2)
    # decided before looking at the model or the kernels
    assert build_decoder_stack(model=None, kernels=object()) is None
