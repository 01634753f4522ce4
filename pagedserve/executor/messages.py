"""The control messages between a multi-process executor and its worker processes.

Each crosses a socket as one length-prefixed msgpack frame (serialization.py): typed dataclasses,
one per call, never pickled. A worker answers a call with `WorkerReply` or, when the call raised,
`WorkerFailure`; only the output rank answers `ExecuteModel`, and other ranks only if they fail.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

from pagedserve import config as config_module
from pagedserve.core.outputs import SchedulerOutput
from pagedserve.executor import serialization


@dataclass
class Hello:
    """A worker's first frame: which rank dialled in."""

    rank: int


@dataclass
class InitWorker:
    """Join the process groups, load the model shard, then reply (the first call after Hello)."""

    config: config_module.EngineConfig
    distributed_init_method: str


@dataclass
class DetermineNumKVBlocks:
    pass


@dataclass
class InitializeKVCache:
    num_blocks: int


@dataclass
class ExecuteModel:
    scheduler_output: SchedulerOutput


@dataclass
class CheckIdle:
    pass


@dataclass
class MemoryReport:
    pass


@dataclass
class ExpertLoad:
    pass


@dataclass
class AddLoRA:
    """Load an adapter into host memory. Every rank replies: None, or the error's message (a bad
    adapter fails its own load, not the worker)."""

    lora_int_id: int
    lora_path: str


@dataclass
class RemoveLoRA:
    lora_int_id: int


@dataclass
class StartProfile:
    """Start torch.profiler on the rank's main thread. Every rank replies: None, or the error's
    message (the worker keeps serving)."""


@dataclass
class StopProfile:
    """Stop it; export: write the trace (False: drop it). Every rank replies
    ProfileReply."""

    export: bool = True


@dataclass
class ProfileReply:
    path: str | None = None
    """The trace written (None: dropped, or the stop failed)."""
    error: str | None = None


@dataclass
class Shutdown:
    pass


@dataclass
class Sleep:
    """Free the KV cache (level 1), or the KV cache and the weights (level 2)."""

    level: int


@dataclass
class WakeUp:
    pass


@dataclass
class UpdateWeights:
    """Load this rank's shard of another model file of the same shape, then run it."""

    model_path: str


@dataclass
class CalibrateOutlierChannels:
    """Choose the int8 layers' outlier channels from a pass over these tokens (every rank)."""

    token_ids: list[int]


@dataclass
class WorkerReply:
    value: Any = None


@dataclass
class WorkerFailure:
    rank: int
    message: str


for _cls in (Hello, InitWorker, DetermineNumKVBlocks, InitializeKVCache, ExecuteModel, CheckIdle,
             MemoryReport, ExpertLoad, AddLoRA, RemoveLoRA, StartProfile, StopProfile, ProfileReply,
             Shutdown, Sleep, WakeUp, UpdateWeights, CalibrateOutlierChannels, WorkerReply,
             WorkerFailure,
             config_module.EngineConfig, config_module.ModelConfig, config_module.MoEConfig,
             config_module.CacheConfig, config_module.SchedulerConfig,
             config_module.DeviceConfig, config_module.SpeculativeConfig,
             config_module.StructuredOutputConfig, config_module.ParallelConfig,
             config_module.KVTransferConfig, config_module.LoRAConfig,
             config_module.ProfilerConfig):
    serialization.register(_cls)

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30
"""A frame longer than this is a corrupt stream, not a message."""


def encode_frame(message: Any) -> bytes:
    """A message as one frame: sent with sock.sendall, to several workers after one encode."""
    payload = serialization.encode(message)
    return _HEADER.pack(len(payload)) + payload


def send_message(sock: socket.socket, message: Any) -> None:
    sock.sendall(encode_frame(message))


def recv_message(sock: socket.socket) -> Any:
    """The next message; raises ConnectionError when the peer has gone."""
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {length} bytes: the stream is corrupt")
    return serialization.decode(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    buffer = bytearray(num_bytes)
    view, received = memoryview(buffer), 0
    while received < num_bytes:
        count = sock.recv_into(view[received:], num_bytes - received)
        if count == 0:
            raise ConnectionError("the peer closed the connection")
        received += count
    return bytes(buffer)
