"""CUDA graphs: the forward pass of a step of up to a few hundred tokens, captured once per padded
size and replayed, so a decode step costs one launch instead of hundreds.

A graph of size N serves any step of at most N tokens, decodes and small prefill chunks alike: the
step's inputs are staged into the persistent buffers of worker/step_inputs.py, padded to N tokens
(id 0, slot -1: no K/V written; sequences of up to a block each over the null block) and N
sequences (the extra ones with no query tokens and seq_len 0). What makes one graph serve every
mix of requests is the attention backend: it must find each request's queries and keys from
device tensors alone (the Triton backend, attention/triton_backend.py). Everything else in the
model is row-wise (matmuls, norms, activations, rotary), so padding rows never change a real
token's output.

Steps the graphs cannot serve run eagerly and are counted by reason (`CudaGraphStats`): more
tokens than the largest size, a LoRA adapter in the step, KV tier transfers. The engine decides
once whether graphs run at all (cuda, one rank, not --enforce-eager).

A graph holds the addresses of the weights, the KV cache and the input buffers: `clear` drops
the graphs when the KV cache or the weights go (sleep, weight reload), `capture` makes them again.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.metadata import forward_context
from pagedserve.config import SchedulerConfig
from pagedserve.core.stats import CudaGraphCounters
from pagedserve.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def usable_graph_sizes(configured: tuple[int, ...],
                       scheduler_config: SchedulerConfig) -> tuple[int, ...]:
    """The configured sizes a step can reach: at most the token budget, and at most twice
    max_num_seqs (decodes plus a small chunk; larger steps are prefill-bound anyway)."""
    largest = min(scheduler_config.max_num_batched_tokens, 2 * scheduler_config.max_num_seqs)
    return tuple(size for size in configured if size <= largest)


@dataclass
class CudaGraphStats(CudaGraphCounters):
    """The runner's counters (core/stats.py), and what was captured."""

    sizes: tuple[int, ...] = ()
    """The sizes captured (tokens)."""
    capture_seconds: float = 0.0
    capture_bytes: int = 0
    """Device memory the graphs took (their shared pool), as the free memory fell."""


class TorchCudaGraphs:
    """Capture and replay with torch.cuda's graphs, all sharing one memory pool (a smaller graph
    reuses the larger ones' activations: only one replays at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = None

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def capture(self, forward: Callable[[], torch.Tensor]
                ) -> tuple[Callable[[], None], torch.Tensor]:
        """(replay, the output tensor each replay rewrites)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        return graph.replay, output


class EagerGraphs:
    """The same contract without CUDA, for tests on the CPU: a "capture" keeps the function, a
    "replay" runs it again on the buffers as they are now and writes its result over the
    captured output. What it checks is everything but the capture itself: staging, padding,
    and that nothing a replay needs comes from the host."""

    device = torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def free_bytes(self) -> int:
        return 0

    def capture(self, forward: Callable[[], torch.Tensor]
                ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()
        return lambda: output.copy_(forward()), output


class CudaGraphRunner:
    def __init__(self, sizes: tuple[int, ...], inputs: StepInputs,
                 graphs: TorchCudaGraphs | EagerGraphs | None = None) -> None:
        """graphs: how to capture (default: torch.cuda's graphs on the inputs' device)."""
        if max(sizes) > inputs.max_num_tokens or max(sizes) > inputs.max_num_seqs:
            raise ValueError(f"CUDA graph size {max(sizes)} exceeds the step buffers "
                             f"({inputs.max_num_tokens} tokens, {inputs.max_num_seqs} sequences)")
        self.sizes = sizes
        self.inputs = inputs
        self.graphs = graphs if graphs is not None else TorchCudaGraphs(inputs.device)
        self._replays: dict[int, Callable[[], None]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.stats = CudaGraphStats()

    @property
    def captured(self) -> bool:
        return bool(self._replays)

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds a step of `num_tokens` tokens (None: none)."""
        index = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[index] if index < len(self.sizes) and self._replays else None

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module, kv_caches: list[KVCache],
                layer_groups: tuple[int, ...]) -> None:
        """Capture every size, largest first. Each is run once eagerly first, which compiles
        its kernels (Triton) and sets up the libraries' workspaces. The buffers hold a step of
        padding alone while capturing, so nothing is written to the KV cache."""
        self.clear()
        inputs, graphs = self.inputs, self.graphs
        graphs.synchronize()
        free_before = graphs.free_bytes()
        start = time.perf_counter()
        for size in reversed(self.sizes):
            _, _, meta = inputs.stage([], [], [], kv_caches, layer_groups, size)

            def forward(size=size, meta=meta) -> torch.Tensor:
                # Fresh views each call: layers that cache per-step values by input identity
                # (rotary's cos/sin lookup) must compute them inside the graph, not reuse the
                # warm-up's.
                with forward_context(meta):
                    return model(inputs.tokens[0, :size], inputs.tokens[1, :size], None)

            forward()  # warm-up
            graphs.synchronize()
            self._replays[size], self._outputs[size] = graphs.capture(forward)
        graphs.synchronize()
        self.stats.sizes = self.sizes
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.capture_bytes = max(0, free_before - graphs.free_bytes())

    def replay(self, size: int, num_tokens: int) -> torch.Tensor:
        """Run the graph of `size` on the inputs staged for it; the step's hidden states, (size,
        hidden) in a buffer the next replay overwrites (rows num_tokens.. are padding)."""
        self._replays[size]()
        self.stats.observe_replay(size, num_tokens)
        return self._outputs[size]

    def clear(self) -> None:
        """Drop every graph (and with them the pool's memory)."""
        self._replays.clear()
        self._outputs.clear()

    def describe(self) -> str:
        stats = self.stats
        return (f"{len(stats.sizes)} sizes of 1-{max(stats.sizes)} tokens in "
                f"{stats.capture_seconds:.2f} s, {stats.capture_bytes / 2**20:.0f} MiB")
