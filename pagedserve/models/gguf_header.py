"""A GGUF file's header: its metadata key/values and its tensor infos, parsed once per file.

gguf's GGUFReader builds a numpy view per value, one per vocabulary entry (seconds for a 49k-token
vocabulary, and the engine read each header three times: config, tokenizer, weights). Here one
pass over one mmap with struct decodes every value to plain Python (arrays of strings in one loop,
numeric arrays by numpy in one call), and `read_gguf_header` caches the result per file
(path, size, mtime), so config, tokenizer and weights share one parse. Tensor data stays in the
file: `tensor_data` maps one tensor as GGUFReader would. Knows nothing of models or tokenizers.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType), as struct formats; STRING and ARRAY are read apart.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?",
                10: "u8", 11: "i8", 12: "f8"}
# Tensor types GGUFReader maps as typed elements; every other type maps as raw bytes.
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4",
    GGMLQuantizationType.F64: "f8", GGMLQuantizationType.I8: "i1",
    GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    """As the file lists it: innermost dimension first (the reverse of numpy/torch order)."""
    tensor_type: GGMLQuantizationType
    offset: int
    """Absolute byte offset of the tensor's data in the file."""

    @property
    def num_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return int(np.prod(self.shape, dtype=np.int64)) * type_size // block_size


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    """Key -> value as plain Python: str, int, float, bool, or (nested) lists of them."""
    tensors: tuple[GGUFTensorInfo, ...]
    byte_order: str
    """struct's byte-order prefix: "<" (what llama.cpp writes) or ">"."""

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file at `path`, parsed once per (file, size, mtime)."""
    real_path = os.path.realpath(path)
    stat = os.stat(real_path)
    return _read_cached(real_path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _Parser(data, path).header()


def tensor_data(file_data: np.ndarray, byte_order: str, info: GGUFTensorInfo) -> np.ndarray:
    """`info`'s data as a view of `file_data` (the whole file, e.g. np.memmap(path, mode="r")),
    typed and shaped as GGUFReader's `ReaderTensor.data`: typed elements in numpy order for
    F16/F32/F64 and the integer types, raw bytes (rows, bytes per row) for every other type."""
    numpy_shape = tuple(reversed(info.shape))
    element_type = _ELEMENT_TYPES.get(info.tensor_type)
    if element_type is None:
        dtype = np.dtype(np.uint8)
        numpy_shape = quant_shape_to_byte_shape(numpy_shape, info.tensor_type)
    else:
        dtype = np.dtype(byte_order + element_type)
    raw = file_data[info.offset : info.offset + info.num_bytes]
    return raw.view(dtype).reshape(numpy_shape)


class _Parser:
    """One forward pass over the header bytes; `offset` is where the next read starts."""

    def __init__(self, data: mmap.mmap, path: str) -> None:
        self.data = data
        self.path = path
        self.offset = 0
        self.order = "<"

    def header(self) -> GGUFHeader:
        if self.data[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.offset = 4
        version = self._scalar("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported "
                             f"(supported: {SUPPORTED_VERSIONS})")
        num_tensors, num_values = self._scalar("Q"), self._scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_values):
            key = self._string()
            if key in metadata:
                raise ValueError(f"{self.path}: duplicate metadata key {key!r}")
            metadata[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.offset // alignment) * alignment
        names = [name for name, *_ in infos]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.path}: duplicate tensor names")
        tensors = tuple(GGUFTensorInfo(name, shape, GGMLQuantizationType(kind), data_start + offset)
                        for name, shape, kind, offset in infos)
        return GGUFHeader(self.path, version, metadata, tensors, self.order)

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        start, self.offset = self.offset, self.offset + length
        return self.data[start : self.offset].decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            return self._array()
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type} at byte "
                             f"{self.offset}")
        return self._scalar(fmt)

    def _array(self) -> list:
        item_type, count = self._scalar("I"), self._scalar("Q")
        if item_type == _STRING:
            return self._strings(count)
        numpy_type = _NUMPY_TYPES.get(item_type)
        if numpy_type is None:  # arrays of arrays: one value at a time
            return [self._value(item_type) for _ in range(count)]
        dtype = np.dtype(self.order + numpy_type)
        values = np.frombuffer(self.data, dtype, count, self.offset)
        self.offset += count * dtype.itemsize
        return values.tolist()

    def _strings(self, count: int) -> list[str]:
        # The hot loop (every vocabulary entry and merge): locals only, no method calls.
        data, offset, order = self.data, self.offset, self.order + "Q"
        unpack_length = struct.Struct(order).unpack_from
        strings = []
        append = strings.append
        for _ in range(count):
            (length,) = unpack_length(data, offset)
            offset += 8
            append(data[offset : offset + length].decode("utf-8"))
            offset += length
        self.offset = offset
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._scalar("I")
        shape = struct.unpack_from(f"{self.order}{num_dims}Q", self.data, self.offset)
        self.offset += 8 * num_dims
        kind, offset = self._scalar("I"), self._scalar("Q")
        return name, tuple(shape), kind, offset
