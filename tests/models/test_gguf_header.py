"""The struct-based GGUF header reader (models/gguf_header.py) against gguf's own GGUFReader: the
same metadata, tensor infos and tensor data, on a file written with every value type and on the
default model's file; and the header is parsed once per file."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from pagedserve.models import gguf_header
from pagedserve.models.gguf_header import read_gguf_header, tensor_data

VT = gguf.GGUFValueType
# One key per value type, scalars and arrays of each, nested arrays, a non-ASCII string.
VALUES = {
    "t.uint8": (200, VT.UINT8, None), "t.int8": (-100, VT.INT8, None),
    "t.uint16": (60000, VT.UINT16, None), "t.int16": (-30000, VT.INT16, None),
    "t.uint32": (4_000_000_000, VT.UINT32, None), "t.int32": (-2_000_000_000, VT.INT32, None),
    "t.float32": (0.1, VT.FLOAT32, None), "t.bool": (True, VT.BOOL, None),
    "t.string": ("héllo <|im_end|>", VT.STRING, None),
    "t.uint64": (2**63 + 5, VT.UINT64, None), "t.int64": (-(2**62), VT.INT64, None),
    "t.float64": (1e-300, VT.FLOAT64, None),
    **{f"t.array.{kind.name.lower()}": (values, VT.ARRAY, kind) for kind, values in [
        (VT.UINT8, [0, 255]), (VT.INT8, [-128, 127]), (VT.UINT16, [1, 65535]),
        (VT.INT16, [-1, 2]), (VT.UINT32, [7, 2**32 - 1]), (VT.INT32, [-7, 8]),
        (VT.FLOAT32, [0.5, -2.25]), (VT.BOOL, [True, False, True]),
        (VT.STRING, ["a", "", "ünï", "Ġthe"]), (VT.UINT64, [2**64 - 1]), (VT.INT64, [-1, 3]),
        (VT.FLOAT64, [1.5, -0.1])]},
    "t.nested": ([[1, 2], [3], [4, 5, 6]], VT.ARRAY, None),
    "t.nested_strings": ([["x", "y"], ["z"]], VT.ARRAY, None),
}


def _flatten(value):
    """GGUFReader.contents() flattens nested arrays (its FIXME); ours keeps them nested."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [item for inner in value for item in _flatten(inner)]
    return value


def _assert_same_as_gguf_reader(path: str) -> gguf_header.GGUFHeader:
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    expected = {key: field.contents() for key, field in reader.fields.items()
                if not key.startswith("GGUF.")}
    assert list(header.metadata) == list(expected)
    for key, value in expected.items():
        assert _flatten(header.metadata[key]) == value, key
    file_data = np.memmap(path, mode="r")
    assert len(header.tensors) == len(reader.tensors)
    for info, tensor in zip(header.tensors, reader.tensors):
        assert (info.name, info.shape, info.tensor_type, info.offset, info.num_bytes) == (
            tensor.name, tuple(tensor.shape.tolist()), tensor.tensor_type, tensor.data_offset,
            tensor.n_bytes)
        data = tensor_data(file_data, header.byte_order, info)
        assert data.dtype == tensor.data.dtype and data.shape == tensor.data.shape, info.name
        assert np.array_equal(data, tensor.data), info.name
    return header


def test_every_value_type_and_tensor_type_reads_as_gguf_reader_does(tmp_path):
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, (value, kind, sub_type) in VALUES.items():
        writer.add_key_value(key, value, kind, sub_type)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8_0", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    header = _assert_same_as_gguf_reader(path)
    for key, (value, _, _) in VALUES.items():  # and the values are the ones written
        written = header.metadata[key]
        if isinstance(value, float) or (isinstance(value, list) and isinstance(value[0], float)):
            assert written == pytest.approx(value, rel=1e-6), key
        else:
            assert written == value, key
    assert header.metadata["general.architecture"] == "llama"
    assert [t.name for t in header.tensors] == ["f32", "f16", "i32", "q8_0"]


@pytest.mark.slow
def test_default_model_reads_as_gguf_reader_does(model_path):
    header = _assert_same_as_gguf_reader(model_path)
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152


def test_header_is_parsed_once_per_file_version(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("t.value", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    parses = []
    parse = gguf_header._Parser.header
    monkeypatch.setattr(gguf_header._Parser, "header",
                        lambda self: parses.append(self.path) or parse(self))
    first = read_gguf_header(path)
    assert read_gguf_header(str(path)) is first and len(parses) == 1
    os.utime(path, ns=(0, 12345))  # a changed file (mtime) is parsed again
    assert read_gguf_header(path) is not first and len(parses) == 2


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(path)


@pytest.mark.slow
def test_large_files_log_their_loading_progress(model_path, monkeypatch, caplog):
    import logging

    import torch

    from pagedserve.models import gguf_loader

    monkeypatch.setattr(gguf_loader, "PROGRESS_MIN_BYTES", 0)  # the default model counts as large
    with caplog.at_level(logging.INFO, logger=gguf_loader.__name__):
        num_weights = sum(1 for _ in gguf_loader.iter_gguf_weights(model_path, torch.bfloat16,
                                                                   keep_packed=True))
    progress = [r.getMessage() for r in caplog.records if "startup: weights" in r.getMessage()]
    assert num_weights == 272
    percents = [int(line.split("%")[0].split()[-1]) for line in progress]
    # Every 10% (a tensor larger than a tenth of the file skips some), ending at 100%.
    assert len(percents) >= 5 and percents == sorted(set(percents)) and percents[-1] == 100
    assert all(p % 10 == 0 for p in percents)
