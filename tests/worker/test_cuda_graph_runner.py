"""The CUDA graph runner's data flow without a GPU: steps staged into the persistent buffers,
padded to a captured size and "replayed" (worker/cuda_graph.py EagerGraphs re-runs the captured
function on the buffers as they are), against the same steps run unpadded.

What this checks is all but the capture itself: a padded step gives its real tokens the same
hidden states, padding writes no KV, and a captured step reads no host metadata (it holds
NoHostData lists, which raise). The model is a tiny random Llama with the Triton attention
backend and fused kernels swapped in, run by the Triton interpreter on the CPU (compiled on a
GPU; tests/worker/test_cuda_graphs.py captures real graphs there).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import ON_CUDA

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from pagedserve.attention.kv_cache import KVCacheSpec  # noqa: E402
from pagedserve.attention.layer import Attention  # noqa: E402
from pagedserve.attention.metadata import forward_context  # noqa: E402
from pagedserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedserve.kernels import cpu_ops, triton_ops  # noqa: E402
from pagedserve.layers.norm import RMSNorm  # noqa: E402
from pagedserve.layers.rotary import RotaryEmbedding  # noqa: E402
from pagedserve.models.llama import LlamaMLP  # noqa: E402
from pagedserve.models.loader import load_model, load_model_config  # noqa: E402
from pagedserve.worker.cuda_graph import CudaGraphRunner, EagerGraphs  # noqa: E402
from pagedserve.worker.step_inputs import StepInputs  # noqa: E402
from tests.engine.tiny_models import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.skipif(ON_CUDA, reason="the GPU captures real graphs "
                                                "(tests/worker/test_cuda_graphs.py)")

BLOCK_SIZE = 4
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def triton_model(tmp_path_factory, tokenizer):
    """A tiny Llama on the CPU whose attention, norms, rotary and activation are the Triton
    kernels (as a model built on cuda holds them)."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), tokenizer, seed=5)
    config = load_model_config(path)
    model = load_model(path, config, torch.float32, torch.device("cpu"),
                       kernel_config=cpu_ops.KernelConfig(cpu_kernels=False))
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = TritonAttentionBackend()
        elif isinstance(module, (RMSNorm, RotaryEmbedding, LlamaMLP)):
            module.gpu_kernels = triton_ops
    return model, config


def new_cache(config):
    spec = KVCacheSpec.create("auto", torch.float32, config.num_hidden_layers,
                              config.num_key_value_heads, config.head_dim, BLOCK_SIZE)
    return spec.allocate(NUM_BLOCKS, "cpu")


@torch.inference_mode()
def test_replayed_padded_steps_equal_unpadded_ones(triton_model):
    model, config = triton_model
    graph_cache, eager_cache = new_cache(config), new_cache(config)
    graph_inputs = StepInputs(32, 16, 8, 1, BLOCK_SIZE, torch.device("cpu"))
    eager_inputs = StepInputs(32, 16, 8, 1, BLOCK_SIZE, torch.device("cpu"))
    runner = CudaGraphRunner((2, 4, 8), graph_inputs, EagerGraphs())
    runner.capture(model, graph_cache, ())
    assert runner.captured and runner.stats.sizes == (2, 4, 8)
    assert all(part.eq(0).all() for layer in graph_cache for part in layer), "capture wrote KV"

    # Three requests: A (5-token prompt) and B (3) start together; C (2) joins at step 2.
    prompts = {"A": [11, 42, 7, 300, 5], "B": [9, 77, 120], "C": [400, 3]}
    blocks = {"A": [3, 9, 4], "B": [12, 2], "C": [7, 30]}
    tokens = {r: list(p) for r, p in prompts.items()}
    computed = {r: 0 for r in prompts}
    schedule = [["A", "B"], ["A", "B", "C"], ["A", "B", "C"], ["C", "A"], ["B"]]
    for step, req_ids in enumerate(schedule):
        # decodes first, as the runner orders them
        req_ids = sorted(req_ids, key=lambda r: len(tokens[r]) - computed[r] != 1)
        input_ids, positions, chunks = [], [], []
        for r in req_ids:
            start, end = computed[r], len(tokens[r])
            input_ids += tokens[r][start:end]
            positions += range(start, end)
            chunks.append(((blocks[r],), start, end))
        size = runner.size_for(len(input_ids))
        assert size is not None and size >= len(input_ids)
        graph_inputs.stage(input_ids, positions, chunks, graph_cache, (), size)
        padded = runner.replay(size, len(input_ids))
        assert padded.isfinite().all()  # the padding rows too: they attend to zeros
        replayed = padded[: len(input_ids)]
        ids, pos, meta = eager_inputs.stage(input_ids, positions, chunks,
                                            eager_cache, ())
        with forward_context(meta):
            expected = model(ids, pos, None)
        torch.testing.assert_close(replayed, expected, rtol=1e-5, atol=1e-5)
        # Each request samples greedily from its last row: the same token either way.
        last_rows = [meta.query_start_loc[i + 1] - 1 for i in range(len(req_ids))]
        graph_next = model.compute_logits(replayed[last_rows]).argmax(-1).tolist()
        assert graph_next == model.compute_logits(expected[last_rows]).argmax(-1).tolist()
        for r, token in zip(req_ids, graph_next):
            computed[r] = len(tokens[r])
            tokens[r].append(token)
    for graph_layer, eager_layer in zip(graph_cache, eager_cache):
        for graph_part, eager_part in zip(graph_layer, eager_layer):
            torch.testing.assert_close(graph_part, eager_part, rtol=1e-5, atol=1e-5)
    # Blocks no request holds stayed untouched: the padding rows wrote nothing.
    held = {b for bs in blocks.values() for b in bs}
    free = [b for b in range(NUM_BLOCKS) if b not in held]
    assert all(part[:, free].eq(0).all() for layer in graph_cache for part in layer)
    stats = runner.stats
    assert stats.replays == len(schedule) and stats.padded_tokens > 0


def test_the_runner_picks_the_smallest_size_that_holds_a_step():
    runner = CudaGraphRunner((1, 2, 4, 8), StepInputs(8, 8, 2, 1, 4, torch.device("cpu")),
                             EagerGraphs())
    assert runner.size_for(3) is None  # nothing captured yet
    runner._replays = {size: None for size in runner.sizes}  # as if captured
    assert [runner.size_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="exceeds the step buffers"):
        CudaGraphRunner((16,), StepInputs(8, 8, 2, 1, 4, torch.device("cpu")))


def use_graph_path(llm, sizes: tuple[int, ...]):
    """Turn a CPU engine's runner into what it is on cuda: the Triton kernels in the model, the
    persistent step buffers, and graphs of `sizes` (captured by the eager stand-in)."""
    from pagedserve.config import SchedulerConfig

    runner = llm.engine.executor.worker.model_runner
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.backend = TritonAttentionBackend()
        elif isinstance(module, (RMSNorm, RotaryEmbedding, LlamaMLP)):
            module.gpu_kernels = triton_ops
    config: SchedulerConfig = llm.engine.config.scheduler
    runner.step_inputs = StepInputs.for_steps(config, sizes, runner.block_size,
                                              runner.num_kv_cache_groups, torch.device("cpu"))
    runner.cuda_graphs = CudaGraphRunner(sizes, runner.step_inputs, EagerGraphs())
    runner.capture_cuda_graphs()
    return runner.cuda_graphs.stats


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_on_the_graph_path_gives_the_eager_tokens(tmp_path, tokenizer,
                                                             async_scheduling):
    """The runner's cuda branch end to end on the CPU: steps staged into the buffers, replayed
    at a padded size or run eagerly when larger, placeholders of async scheduling filled into
    the replayed buffers; the tokens are those of the plain engine."""
    from pagedserve.engine.llm import LLM
    from pagedserve.metrics import PrometheusStatLogger
    from pagedserve.sampling_params import SamplingParams
    from tests.test_metrics import MODEL as METRICS_MODEL
    from tests.test_metrics import scrape

    path = write_tiny_llama(tmp_path, tokenizer, seed=7)
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38]]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True)
              for i in range(len(prompts))]
    args = dict(model=path, dtype="float32", kv_cache_memory="8MiB", cpu_kernels=False,
                max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                async_scheduling=async_scheduling)
    plain = LLM(**args)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.engine.shutdown()
    graphed = LLM(**args)
    stats = use_graph_path(graphed, (2, 4))
    outputs = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert stats.replays > 0 and stats.eager_steps["tokens"] > 0  # decodes replayed; prompts not
    if async_scheduling:
        assert graphed.engine.num_overlapped_steps > 0
    # The engine counts what the runner's outputs say, and /metrics exports it.
    counters = graphed.engine.get_stats().cuda_graphs
    assert (counters.replays, counters.replayed_tokens, counters.padded_tokens,
            counters.eager_steps) == (stats.replays, stats.replayed_tokens, stats.padded_tokens,
                                      dict(stats.eager_steps))
    stat_logger = PrometheusStatLogger(METRICS_MODEL)
    stat_logger.record_step(graphed.engine.get_stats(), 0.0)
    exported = scrape(stat_logger)
    assert exported[("pagedserve:cuda_graph_replays_total",)] == stats.replays
    assert (exported[("pagedserve:cuda_graph_eager_steps_total", ("reason", "tokens"))]
            == stats.eager_steps["tokens"])
    graphed.engine.assert_idle()
    graphed.engine.shutdown()
    assert outputs == expected
