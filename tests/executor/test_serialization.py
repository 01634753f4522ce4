"""The msgpack wire format of the control messages: exact round trips, and refusals.

Messages come from the real Scheduler where possible. `assert_identical` compares types as well as
values, since == alone takes a list for a tuple, a set for a frozenset and True for 1.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import pickle
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.outputs import (
    EngineCoreOutput,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.serialization import decode, encode, register
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams


def assert_identical(a, b, path="obj"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        assert vars(a).keys() == vars(b).keys(), path
        for name in vars(a):
            assert_identical(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path  # same keys, same order
        assert [type(key) for key in a] == [type(key) for key in b], path
        for key in a:
            assert_identical(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b), path
    else:
        assert a == b, path


def round_trip(obj):
    decoded = decode(encode(obj))
    assert_identical(obj, decoded)
    return decoded


def params_with_everything() -> SamplingParams:
    return SamplingParams(
        temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, presence_penalty=0.5, seed=2**64 - 1,
        stop=["\n\n", "END", "\ud800 lone surrogate"], stop_token_ids=[7, 8], max_tokens=5,
        min_tokens=1, logprobs=3, prompt_logprobs=2, logit_bias={"50": -100, 3: 2.5},
        structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"]}},
    )


def scheduler_outputs() -> list[SchedulerOutput]:
    """Three steps of a real Scheduler: new requests; cached decodes beside a newcomer and a
    finished request; cached decodes with a new block, plus drafts and a grammar bitmask set by
    hand where the engine would fill them in."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=256, max_num_seqs=8),
                          CacheConfig(block_size=4), num_blocks=64)

    def add(req_id, prompt, params):
        scheduler.add_request(Request(req_id, prompt, params, eos_token_ids=frozenset({2})))

    def run_step():
        output = scheduler.schedule()
        sampled = {req_id: [ord(req_id)] for req_id in output.num_scheduled_tokens}
        runner_output = ModelRunnerOutput(sampled_token_ids=sampled)
        scheduler.update_from_output(output, runner_output)
        return output

    add("a", list(range(10, 23)), params_with_everything())
    add("b", [5, 6, 7], SamplingParams(max_tokens=1, seed=-(2**63)))
    add("c", list(range(40, 47)), SamplingParams(temperature=0.0, max_tokens=20,
                                                 structured_outputs={"regex": "[a-z]+"}))
    first = run_step()
    add("d", [9] * 6, SamplingParams(n=1, logit_bias={0: 1.0}, stop="x"))
    second = run_step()
    third = scheduler.schedule()
    third.scheduled_spec_decode_tokens = {"c": [101, 102]}
    bitmask = np.full((3, 5), -1, dtype=np.int32)
    bitmask[1, 2] = 0x0F0F0F0F
    third.grammar = GrammarOutput({"c": 0}, bitmask)
    assert [data.req_id for data in first.scheduled_new_reqs] == ["a", "b", "c"]
    assert second.scheduled_cached_reqs.req_ids == ["a", "c"] and second.finished_req_ids == {"b"}
    assert any(third.scheduled_cached_reqs.new_block_ids)
    return [first, second, third]


def model_runner_output() -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids={"a": [5], "c": [9, 10, 11]},
        logprobs={"a": [TokenLogprobs([5, 1, 2], [-0.25, -1.5, -float("inf")], 1)],
                  "c": [TokenLogprobs([9], [-0.0], 3)] * 3},
        prompt_logprobs={"a": (1, [TokenLogprobs([11, 4], [-2.0, -0.5], 2),
                                   TokenLogprobs([12], [-1e-300], 1)])},
        spec_token_ids={"c": [12, 13]},
    )


def other_messages() -> list:
    return [
        model_runner_output(),
        ModelRunnerOutput(),
        EngineCoreOutput("a", [5, 6], [TokenLogprobs([5], [-0.1], 1)], (1, []), "stop", "END", 3,
                         12.5),
        EngineCoreOutput("b", [], stop_reason=2),
        params_with_everything(),
        StructuredOutputsParams(choice=["yes", "no"]),
    ]


def test_scheduler_outputs_round_trip():
    for output in scheduler_outputs():
        decoded = round_trip(output)
        assert decoded.is_empty == output.is_empty
        if output.grammar is not None:
            assert not decoded.grammar.bitmask.flags.writeable  # a view of the message's bytes
            assert np.array_equal(decoded.grammar.bitmask[[1]], output.grammar.bitmask[[1]])
        else:
            assert decoded == output


def test_runner_and_engine_outputs_round_trip():
    for message in other_messages():
        assert round_trip(message) == message


def test_decoded_sampling_params_are_fully_usable():
    original = params_with_everything()
    decoded = round_trip(original)
    assert decoded == original and vars(decoded) == vars(original)
    assert decoded.logit_bias == {50: -100.0, 3: 2.5}
    assert decoded.top_k == 0  # normalized by the sender, not re-validated
    assert decoded.sampling_type == original.sampling_type
    assert decoded.structured_outputs.spec() == original.structured_outputs.spec()
    assert decoded.all_stop_token_ids([2]) == {2, 7, 8}
    decoded.validate_for_vocab(1000)
    with pytest.raises(ValueError, match="logit_bias"):
        decoded.validate_for_vocab(10)
    clone = decoded.clone()
    clone.max_tokens = 99  # a plain mutable dataclass still
    assert clone != decoded and decoded.max_tokens == 5


def test_plain_values_keep_their_types():
    value = {
        "floats": [float("inf"), -float("inf"), float("nan"), -0.0, 1e-310, 0.1],
        "ints": [0, -1, 2**64 - 1, -(2**63), True, False],
        "text": ["", "é\u4e2d", "\udfff"],
        "bytes": b"\x00\xff",
        "none": None,
        "tuple": (1, (2, [3]), ()),
        "set": {1, "x"},
        "frozenset": frozenset({(1, 2)}),
        "nested": [[], {}, set(), frozenset()],
        7: "int key",
        (1, "a"): "tuple key",
        frozenset({3}): "frozenset key",
        None: "None key",
        2.5: "float key",
    }
    round_trip(value)
    round_trip((value, [value]))


def test_numpy_arrays():
    arrays = [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.array([[True, False]]),
        np.array(3.5),  # 0-d
        np.zeros((0, 7), dtype=np.uint8),
        np.array([np.nan, -np.inf, 1.5], dtype=np.float16),
        np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2].T,  # not contiguous
    ]
    arrays += [np.arange(6).astype(dtype) for dtype in ("i1", "u2", "u4", "u8", "f4", "f8")]
    for array in arrays:
        decoded = round_trip(array)
        assert decoded.flags.c_contiguous
    with pytest.raises(ValueError, match="dtype"):
        encode(np.array([object()]))
    with pytest.raises(ValueError, match="dtype"):
        encode(np.arange(3, dtype=">i4"))


def test_registered_enums_and_user_dataclasses():
    @register
    class Color(enum.Enum):
        RED = "red"
        BLUE = (1, 2)

    @register
    class Level(enum.IntEnum):
        LOW = 1

    @register
    @dataclasses.dataclass(frozen=True)
    class FrozenConfig:
        sizes: tuple[int, ...] = (1, 2)
        color: Color = Color.BLUE
        level: Level = Level.LOW

    @register
    @dataclasses.dataclass
    class Empty:
        pass

    @register
    @dataclasses.dataclass
    class One:
        value: object = None

    message = [Color.RED, Color.BLUE, Level.LOW, FrozenConfig(), Empty(), One(One(Level.LOW))]
    decoded = round_trip(message)
    assert decoded[2] is Level.LOW and hash(decoded[3]) == hash(FrozenConfig())
    assert register(One) is One  # registering again is harmless


def test_unregistered_types_are_refused_at_encode():
    @dataclasses.dataclass
    class Unregistered:
        x: int = 0

    class Plain:
        pass

    class MyDict(dict):
        pass

    for value in [Unregistered(), [Plain()], {"k": MyDict()}, np.int64(3), np.float64(1.0),
                  2**64, -(2**63) - 1, {1.5j: 1}]:
        with pytest.raises(ValueError, match="cannot encode"):
            encode(value)
    request = Request("r", [1], SamplingParams())  # not a message: state outside its fields
    with pytest.raises(ValueError, match="not a registered message type"):
        encode(request)


def test_state_outside_the_fields_is_refused_at_encode():
    @register
    @dataclasses.dataclass
    class Derived:
        x: int

        def __post_init__(self):
            self.doubled = 2 * self.x

    with pytest.raises(ValueError, match="doubled"):
        encode(Derived(1))


def test_register_refuses_what_it_cannot_round_trip():
    @dataclasses.dataclass(slots=True)
    class Slotted:
        x: int

    class NotADataclass:
        pass

    for cls in (Slotted, NotADataclass, int):
        with pytest.raises(ValueError):
            register(cls)
    impostor = dataclasses.make_dataclass("TokenLogprobs", [("x", int)])
    with pytest.raises(ValueError, match="already registered"):
        register(impostor)


def tagged(code: int, name: bytes, value) -> bytes:
    return msgpack.packb({msgpack.ExtType(code, name): value})


@pytest.mark.parametrize("payload", [
    tagged(1, b"Popen", ["ls"]),  # unknown (unregistered) class name: nothing is imported
    tagged(1, b"subprocess.Popen", ["ls"]),
    tagged(42, b"", [1]),  # unknown ext code
    tagged(1, b"TokenLogprobs", [[1], [0.5]]),  # a field missing
    tagged(1, b"TokenLogprobs", {"token_ids": [1]}),
    tagged(2, b"", "not a list"),
    tagged(3, b"", [[1]]),  # unhashable set item
    tagged(1, b"SamplingType", 0),  # an enum that is not registered
    tagged(5, msgpack.packb(["|O", [1]]), b"\x00" * 8),  # object dtype
    tagged(5, msgpack.packb(["<i4", [3]]), b"\x00" * 8),  # wrong byte count
    tagged(5, msgpack.packb(["<i4", [-1]]), b""),
    tagged(5, b"\xc1", b""),  # header is not msgpack
    msgpack.packb([msgpack.ExtType(2, b""), [1]]),  # a tag outside a one-entry map
    msgpack.packb({msgpack.ExtType(2, b""): [1], "x": 1}),
    tagged(1, b"", []),
    encode(model_runner_output())[:-3],  # truncated
    encode([1]) + b"\x01",  # trailing bytes
    b"\xc1",  # never-used msgpack byte
    b"",
])
def test_malformed_payloads_are_refused(payload):
    with pytest.raises(ValueError, match="malformed message"):
        decode(payload)


def test_no_pickle_is_used(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    messages = scheduler_outputs() + other_messages()
    for message in messages:
        round_trip(message)
    round_trip(messages)


def test_module_imports_no_torch():
    code = ("import sys\n"
            "import pagedserve.executor.serialization\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
