"""pagedserve on one CUDA GPU: its eager path, CUDA graphs with the Triton kernels, and graphs with
async scheduling, against HF transformers generate(), in one process on the same random-weight
models and prompt ids (the protocol of shared/gpu/gpu_bench.py: Llama shapes of SmolLM2-135M and
SmolLM2-1.7B, SmolLM2's tokenizer, 200 prompt / 128 output tokens, bf16, greedy, ignore_eos).

Prints one JSON line per measurement, then a table with each figure's ratio to the eager path and
to HF, and batch 1's decode step against the time to read the weights once (bandwidth) and batch
256's rate against the bf16 matmul peak.

Usage: python bench_cuda.py TOKDIR WORKDIR [batches...]   (SHAPES=135m,1.7b by default;
VARIANTS=eager,graphs,graphs+async,hf)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch
import transformers

TOK, WORK = sys.argv[1], sys.argv[2]
BATCHES = [int(b) for b in sys.argv[3:]] or [1, 32, 256]
IN_LEN, OUT_LEN = 200, 128
SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32),
}
VARIANTS = {
    "eager": dict(enforce_eager=True, gpu_kernels=False, async_scheduling=False),
    "graphs": dict(enforce_eager=False, gpu_kernels=True, async_scheduling=False),
    "graphs+async": dict(enforce_eager=False, gpu_kernels=True, async_scheduling=True),
}
REPEATS = int(os.environ.get("REPEATS", "2"))
"""Timed runs of each pagedserve figure (the table shows the fastest; HF runs once)."""
BANDWIDTH = 4.3e12
"""Bytes/s of a device-to-device copy measured on this workplace's H200 (device KINDS.md)."""
BF16_PEAK = 790e12
"""FLOP/s of an 8192^3 bf16 matmul through torch, measured there likewise."""

results: list[dict] = []


def log(**record) -> None:
    results.append(record)
    print(json.dumps(record), flush=True)


def make_model(name: str) -> tuple[str, int]:
    path = os.path.join(WORK, name)
    config = transformers.LlamaConfig(
        vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, **SHAPES[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    for f in os.listdir(TOK):
        shutil.copy(os.path.join(TOK, f), path)
    del model
    torch.cuda.empty_cache()
    return path, num_params


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, 49000, (batch, IN_LEN), generator=g).tolist()


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def bench_pagedserve(path: str, name: str, variant: str, tokens: dict) -> None:
    from pagedserve import LLM, SamplingParams

    (llm, load_s) = timed(lambda: LLM(model=path, device="cuda", dtype="bfloat16",
                                      kv_cache_memory="40GiB", **VARIANTS[variant]))
    runner = llm.engine.executor.worker.model_runner
    graphs = runner.cuda_graphs
    if graphs is not None:
        log(engine="pagedserve", variant=variant, model=name, capture=graphs.describe())
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=OUT_LEN)
    first = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    llm.generate(prompts(4), SamplingParams(temperature=0, ignore_eos=True, max_tokens=8))
    for batch in BATCHES:
        ps = prompts(batch)
        llm.generate(ps, first)  # the first step of this shape may compile a Triton variant
        for repeat in range(REPEATS):
            _, prefill_s = timed(lambda: llm.generate(ps, first))
            outs, seconds = timed(lambda: llm.generate(ps, params))
            ids = [o.outputs[0].token_ids for o in outs]
            assert tokens.setdefault((variant, batch), ids) == ids, "a repeat gave other tokens"
            n = sum(map(len, ids))
            log(engine="pagedserve", variant=variant, model=name, batch=batch, repeat=repeat,
                out_tok=n, seconds=round(seconds, 3), out_tok_s=round(n / seconds, 1),
                load_s=round(load_s, 1),
                decode_ms_per_step=round((seconds - prefill_s) / (OUT_LEN - 1) * 1e3, 3))
    if os.environ.get("PROFILE") == "1":
        for batch in (1, 64):
            profile_steps(llm, name, variant, batch)
    if graphs is not None:
        stats = graphs.stats
        log(engine="pagedserve", variant=variant, model=name, replays=stats.replays,
            eager_steps=dict(stats.eager_steps), padded_tokens=stats.padded_tokens,
            replayed_tokens=stats.replayed_tokens)
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()


def profile_steps(llm, name: str, variant: str, batch: int) -> None:
    """Where a decode step goes: wall ms per engine step, GPU kernel ms and launches per step
    (torch.profiler over 5 steps, after 12 to get past the prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedserve import SamplingParams

    engine = llm.engine
    for i, p in enumerate(prompts(batch)):
        engine.add_request(f"profile-{batch}-{i}", p,
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=64))
    for _ in range(12):
        engine.step()
    (_, seconds) = timed(lambda: [engine.step() for _ in range(20)])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 5 / 1e3
    launches = sum(e.count for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 5
    log(engine="pagedserve", variant=variant, model=name, profile_batch=batch,
        wall_ms_per_step=round(seconds / 20 * 1e3, 3), gpu_kernel_ms_per_step=round(gpu_ms, 3),
        kernels_per_step=launches)
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    print(events.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=50))
    while engine.has_unfinished_requests():
        engine.step()


def bench_hf(path: str, name: str, tokens: dict) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16).cuda().eval()

    def gen(ps, new):
        ids = torch.tensor(ps, device="cuda")
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=2)
        return out[:, ids.shape[1]:]

    gen(prompts(4), 8)
    for batch in BATCHES:
        out, seconds = timed(lambda: gen(prompts(batch), OUT_LEN))
        tokens[("hf", batch)] = out.tolist()
        log(engine="hf", variant="hf", model=name, batch=batch, out_tok=out.numel(),
            seconds=round(seconds, 3), out_tok_s=round(out.numel() / seconds, 1),
            attn=model.config._attn_implementation)
    del model
    torch.cuda.empty_cache()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        prefix = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        same, total = same + prefix, total + max(len(x), len(y))
    return same / max(total, 1)


def summarize(name: str, num_params: int, tokens: dict) -> None:
    rows: dict = {}
    for r in results:  # the fastest repeat of each
        if r.get("model") == name and "batch" in r and "out_tok_s" in r:
            best = rows.get((r["variant"], r["batch"]))
            if best is None or r["out_tok_s"] > best["out_tok_s"]:
                rows[(r["variant"], r["batch"])] = r
    weight_bytes = 2 * num_params
    print(f"\n== {name}: {num_params / 1e9:.2f} B parameters, {weight_bytes / 1e9:.2f} GB bf16")
    print(f"{'variant':14} {'batch':>5} {'tok/s':>9} {'x eager':>8} {'x HF':>6} "
          f"{'ms/step':>8} {'agree eager':>11} {'agree graphs':>12}")
    for (variant, batch), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        eager = rows.get(("eager", batch))
        hf = rows.get(("hf", batch))
        same, same_graphs = (
            agreement(tokens[(variant, batch)], tokens[(other, batch)])
            if (other, batch) in tokens and (variant, batch) in tokens else float("nan")
            for other in ("eager", "graphs"))
        print(f"{variant:14} {batch:>5} {r['out_tok_s']:>9.1f} "
              f"{r['out_tok_s'] / eager['out_tok_s'] if eager else float('nan'):>8.2f} "
              f"{r['out_tok_s'] / hf['out_tok_s'] if hf else float('nan'):>6.2f} "
              f"{r.get('decode_ms_per_step', float('nan')):>8.3f} {same:>11.3f} "
              f"{same_graphs:>12.3f}")
    for variant in VARIANTS:
        one = rows.get((variant, 1))
        if one is not None:
            floor_ms = weight_bytes / BANDWIDTH * 1e3
            print(f"{variant}: batch-1 decode step {one['decode_ms_per_step']:.3f} ms against "
                  f"{floor_ms:.3f} ms to read the weights once ({floor_ms / one['decode_ms_per_step']:.0%}"
                  f" of the bandwidth limit)")
        big = rows.get((variant, max(BATCHES)))
        if big is not None:
            flops = 2 * num_params * big["out_tok_s"]
            print(f"{variant}: batch {max(BATCHES)} {big['out_tok_s']:.0f} tok/s = "
                  f"{flops / 1e12:.1f} TFLOP/s of matmul work ({flops / BF16_PEAK:.1%} of the "
                  f"bf16 peak)")


if __name__ == "__main__":
    log(torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
        transformers=transformers.__version__)
    wanted = os.environ.get("VARIANTS", "eager,graphs,graphs+async,hf").split(",")
    for name in os.environ.get("SHAPES", "135m,1.7b").split(","):
        path, num_params = make_model(name)
        tokens: dict = {}
        for variant in wanted:
            try:
                if variant == "hf":
                    bench_hf(path, name, tokens)
                else:
                    bench_pagedserve(path, name, variant, tokens)
            except Exception as e:  # report and go on: one failure must not cost the whole lease
                import traceback

                traceback.print_exc()
                log(engine=variant, model=name, error=repr(e)[:500])
        summarize(name, num_params, tokens)
