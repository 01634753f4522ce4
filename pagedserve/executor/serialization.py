"""Bytes for the typed control messages between the engine and its workers (msgpack, no pickle).

Owns the wire format and the allowlist of types that may cross it: registered dataclasses and
enums, numpy arrays of plain dtypes, tuples, sets and frozensets, besides msgpack's own types.
It knows nothing of what the messages mean, of transports, or of torch.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

import msgpack
import numpy as np

from pagedserve.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    RunnerTimings,
    SchedulerOutput,
    TokenLogprobs,
)
from pagedserve.kv_transfer.base import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    LoadJob,
    TierCounters,
)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

# Wire format: msgpack's own types stand for themselves. Anything else is a one-entry map
# {ext tag: value}, decoded by object_hook: a registered dataclass (tag: its name, value: its
# fields), enum (value: its value), tuple, set or frozenset (value: the items) or numpy array (tag:
# dtype and shape, value: the raw bytes as a bin). Inline rather than a nested ext payload, so a
# message is packed and unpacked in one pass, with no per-object packb and no copies of payloads.
_EXT_TYPE = 1
"""Tag of a registered dataclass or enum; its data is the registered name."""
_EXT_TUPLE = 2
_EXT_SET = 3
_EXT_FROZENSET = 4
_EXT_NDARRAY = 5

_NDARRAY_DTYPES = frozenset(
    np.dtype(name).str
    for name in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", "float32", "float64")
)
"""Plain little-endian numeric dtypes only: an object dtype would mean pickle."""

_T = TypeVar("_T", bound=type)


class _Tag:
    """What a tag ext decodes to; object_hook turns {tag: value} into the object.

    A dataclass's tag has the class and its field names (decode builds it inline: it is the most
    frequent tag); any other has build(value).
    """

    __slots__ = ("build", "dataclass", "names")

    def __init__(self, build: Callable[[Any], Any] | None = None, dataclass: type | None = None,
                 names: tuple[str, ...] = ()) -> None:
        self.build = build
        self.dataclass = dataclass
        self.names = names


_ENCODERS: dict[type, Callable[[Any], Any]] = {}
"""type -> what to pack in its place (only exact types: a subclass must be registered itself)."""
_CLASSES_BY_NAME: dict[bytes, type] = {}
_TAGS_BY_NAME: dict[bytes, _Tag] = {}
"""Registered name -> its class and the tag that rebuilds it: the decoding allowlist."""


def register(cls: _T) -> _T:
    """Allow a dataclass or Enum subclass to cross the wire; returns cls, so it is a decorator.

    Both ends must register the same classes (at import of the module that defines them). A
    dataclass crosses as its fields, in order; decoding sets them without calling __init__ or
    __post_init__ (the sender's object was validated already), so all of its state must be fields:
    anything derived in __post_init__ must be a field or a property (encode refuses an instance
    with other attributes). The wire name is the class's __qualname__, unique among registered
    classes.
    """
    name = cls.__qualname__.encode()
    if _CLASSES_BY_NAME.get(name, cls) is not cls:
        raise ValueError(f"another class named {cls.__qualname__} is already registered")
    key = msgpack.ExtType(_EXT_TYPE, name)
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        _ENCODERS[cls] = lambda member: {key: member.value}
        tag = _Tag(cls)
    elif dataclasses.is_dataclass(cls) and isinstance(cls, type):
        if not any("__dict__" in vars(klass) for klass in cls.__mro__):
            raise ValueError(f"{cls.__qualname__} has slots: only dataclasses with a __dict__ "
                             "can be registered")
        names = tuple(f.name for f in dataclasses.fields(cls))
        _ENCODERS[cls] = _dataclass_encoder(cls, key, names)
        tag = _Tag(dataclass=cls, names=names)
    else:
        raise ValueError(f"only dataclasses and enums can be registered, not {cls!r}")
    _CLASSES_BY_NAME[name] = cls
    _TAGS_BY_NAME[name] = tag
    return cls


def _dataclass_encoder(cls: type, key: msgpack.ExtType,
                       names: tuple[str, ...]) -> Callable[[Any], Any]:
    num_fields = len(names)
    # attrgetter fetches every field in one C call; given one name it returns a bare value.
    get_fields = (attrgetter(*names) if num_fields > 1
                  else (lambda obj: (getattr(obj, names[0]),)) if names else (lambda obj: ()))

    def encode_dataclass(obj: Any) -> dict:
        # Decoding restores fields only: state kept outside them would be silently lost.
        if len(obj.__dict__) != num_fields:
            raise ValueError(
                f"cannot encode {cls.__qualname__}: its attributes {sorted(vars(obj))} are not its "
                f"fields {list(names)}; make derived state fields or properties")
        return {key: list(get_fields(obj))}

    return encode_dataclass


def _encode_ndarray(array: np.ndarray) -> dict:
    dtype = array.dtype.str
    if dtype not in _NDARRAY_DTYPES:
        raise ValueError(f"cannot encode a numpy array of dtype {array.dtype} ({dtype}); allowed: "
                         f"{sorted(_NDARRAY_DTYPES)}")
    key = msgpack.ExtType(_EXT_NDARRAY, msgpack.packb([dtype, list(array.shape)]))
    # The data as a bin packed straight from the array's memory (no bytes copy of it first).
    return {key: memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))}


def _ndarray_tag(header: bytes) -> _Tag:
    dtype, shape = msgpack.unpackb(header)
    if dtype not in _NDARRAY_DTYPES:
        raise ValueError(f"numpy dtype {dtype!r} is not allowed")
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"bad numpy array shape {shape!r}")
    dtype = np.dtype(dtype)
    count = math.prod(shape)

    def build(data: Any) -> np.ndarray:
        if type(data) is not bytes or len(data) != count * dtype.itemsize:
            raise ValueError(f"numpy array of shape {shape} and dtype {dtype} needs "
                             f"{count * dtype.itemsize} bytes")
        # A read-only view of the bytes msgpack unpacked: no copy (copy it to write in place).
        return np.frombuffer(data, dtype, count).reshape(shape)

    return _Tag(build)


_ENCODERS[np.ndarray] = _encode_ndarray
_TUPLE_KEY = msgpack.ExtType(_EXT_TUPLE, b"")
_SET_KEY = msgpack.ExtType(_EXT_SET, b"")
_FROZENSET_KEY = msgpack.ExtType(_EXT_FROZENSET, b"")
_ENCODERS[tuple] = lambda value: {_TUPLE_KEY: list(value)}
_ENCODERS[set] = lambda value: {_SET_KEY: list(value)}
_ENCODERS[frozenset] = lambda value: {_FROZENSET_KEY: list(value)}


def _container_tag(kind: type) -> _Tag:
    def build(items: Any) -> Any:
        if type(items) is not list:
            raise ValueError(f"a {kind.__name__} needs a list of items")
        return kind(items)

    return _Tag(build)


_CONTAINER_TAGS = {
    _EXT_TUPLE: _container_tag(tuple),
    _EXT_SET: _container_tag(set),
    _EXT_FROZENSET: _container_tag(frozenset),
}


def _default(obj: Any) -> Any:
    encoder = _ENCODERS.get(type(obj))
    if encoder is not None:
        return encoder(obj)
    if type(obj) is int:  # msgpack hands over the ints it cannot pack
        raise ValueError(f"cannot encode the int {obj}: outside [-2**63, 2**64 - 1]")
    raise ValueError(
        f"cannot encode {type(obj).__module__}.{type(obj).__qualname__}: not a registered message "
        "type (serialization.register) nor a plain value (numpy scalars: use .item())")


def encode(obj: Any) -> bytes:
    """obj as msgpack bytes; ValueError if it holds anything outside the allowlist."""
    # strict_types: a tuple, an IntEnum or a dict subclass reaches _default instead of passing for
    # a list, an int or a dict. surrogatepass: text decoded from JSON may hold lone surrogates.
    packer = msgpack.Packer(default=_default, use_bin_type=True, strict_types=True,
                            unicode_errors="surrogatepass")
    return packer.pack(obj)


def decode(data: bytes) -> Any:
    """The object encode(obj) was given (equal, of the same types); ValueError if data is not one.

    Numpy arrays come back read-only (views, not copies, of the bytes msgpack unpacks them into).
    Only registered classes are instantiated, and without calling their __init__.
    """
    # Every tag must be consumed as the key of a one-entry map: one anywhere else is malformed.
    num_tags = num_consumed = 0
    new_object = object.__new__

    def ext_hook(code: int, payload: bytes) -> Any:
        nonlocal num_tags
        if code == _EXT_TYPE:
            tag = _TAGS_BY_NAME.get(payload)
            if tag is None:
                raise ValueError(f"unknown type tag {payload!r}: not a registered class")
        elif code == _EXT_NDARRAY:
            tag = _ndarray_tag(payload)
        else:
            tag = _CONTAINER_TAGS.get(code)
            if tag is None:
                raise ValueError(f"unknown ext type code {code}")
        num_tags += 1
        return tag

    def object_hook(mapping: dict) -> Any:
        nonlocal num_consumed
        if len(mapping) == 1:
            for key in mapping:
                if type(key) is _Tag:
                    num_consumed += 1
                    value = mapping[key]
                    cls = key.dataclass
                    if cls is None:
                        return key.build(value)
                    if type(value) is not list or len(value) != len(key.names):
                        raise ValueError(f"{cls.__qualname__} needs a list of {len(key.names)} "
                                         "field values")
                    obj = new_object(cls)
                    obj.__dict__.update(zip(key.names, value))
                    return obj
        return mapping

    try:
        # strict_map_key=False: keys may be ints (logit_bias) or tuples; the peer is the engine's
        # own process, not a client, so hash flooding through int keys is not a concern.
        obj = msgpack.unpackb(data, ext_hook=ext_hook, object_hook=object_hook,
                              strict_map_key=False, unicode_errors="surrogatepass")
    except Exception as error:  # msgpack and the hooks raise several kinds; callers get one
        raise ValueError(f"malformed message: {error}") from error
    if num_consumed != num_tags:
        raise ValueError("malformed message: a type tag outside a one-entry map")
    return obj


for _cls in (SchedulerOutput, NewRequestData, CachedRequestData, GrammarOutput, ModelRunnerOutput,
             TokenLogprobs, EngineCoreOutput, SamplingParams, StructuredOutputsParams,
             KVConnectorMetadata, LoadJob, BlockTransfer, KVConnectorOutput, TierCounters,
             RunnerTimings, PoolingParams):
    register(_cls)
