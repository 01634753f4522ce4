"""Many instances against one, in one invocation: the same doc-QA load at each concurrency through
  - one engine (all threads),
  - `serve -dp 2` (two replicas behind one API server, a thread each),
  - `pagedserve router` over two instances (a thread each), cache_aware and round_robin,
  - prefill/decode disaggregation: a prefill and a decode instance (a thread each) joined by
    TcpConnector, behind `pagedserve router --pd`.
For each: `pagedserve bench serve`'s throughput, TTFT and ITL, its prefix hit rate (usage's
cached_tokens, which for P/D includes the KV the decode loaded), the device pools' own hit rate
(without the transfer), and the instances' counters (prompt tokens computed, per instance; tokens
loaded over the P/D transfer; the router's affinity hits).

    .venv/bin/python scripts/bench_many_instances.py --concurrency 8 32

Each case starts its processes afresh the way the README does, and each concurrency uses its own
documents (seed), the same in every case. Every process is stopped by its pid before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_kv_tiers import cpu_name, free_port, stop, wait_healthy  # noqa: E402

SERVER_COUNTERS = {
    "prompt tokens computed": "pagedserve:prompt_tokens_computed_total",
    "P/D tokens loaded": "pagedserve:kv_tier_loaded_tokens_total",
    "P/D fallbacks": "pagedserve:kv_tier_load_fallbacks_total",
}
ROUTER_COUNTERS = {"affinity hits": "pagedserve_router:affinity_hits_total"}


@dataclass
class Case:
    name: str
    backends: list[tuple[str, list[str], str]] = field(default_factory=list)
    """(label, pagedserve args, base URL) of each engine process."""
    front: tuple[list[str], str] | None = None
    """The router's args and URL (None: the first backend is the front)."""


def serve_args(args, port: int, threads: int | None, *extra: str) -> list[str]:
    command = ["serve", args.model, "--port", str(port), "--log-level", "warning",
               "--max-num-waiting", "10000"]
    if threads is not None:
        command += ["--num-threads", str(threads)]
    return command + list(extra)


def build_cases(args) -> list[Case]:
    cases = []
    port = free_port()
    cases.append(Case("one engine", [("engine", serve_args(args, port, args.threads),
                                      f"http://127.0.0.1:{port}")]))
    port = free_port()
    cases.append(Case("DP=2", [("dp", serve_args(args, port, None, "-dp", "2"),
                                f"http://127.0.0.1:{port}")]))
    for policy in ("cache_aware", "round_robin"):
        ports = [free_port(), free_port()]
        router_port = free_port()
        backends = [(f"w{i}", serve_args(args, p, 1), f"http://127.0.0.1:{p}")
                    for i, p in enumerate(ports)]
        router = ["router", "--policy", policy, "--port", str(router_port)]
        for _, _, url in backends:
            router += ["--worker", url]
        cases.append(Case(f"router {policy}", backends,
                          (router, f"http://127.0.0.1:{router_port}")))
    prefill_port, decode_port, router_port, kv_port = (free_port() for _ in range(4))

    def transfer(role: str) -> str:
        return json.dumps({"kv_connector": "TcpConnector", "kv_role": role,
                           "kv_connector_extra_config": {"port": kv_port}})

    backends = [
        ("prefill", serve_args(args, prefill_port, 1, "--kv-transfer-config",
                               transfer("kv_producer")), f"http://127.0.0.1:{prefill_port}"),
        ("decode", serve_args(args, decode_port, 1, "--kv-transfer-config",
                              transfer("kv_consumer")), f"http://127.0.0.1:{decode_port}")]
    router = ["router", "--pd", "--prefill", backends[0][2], "--decode", backends[1][2],
              "--port", str(router_port)]
    cases.append(Case("P/D", backends, (router, f"http://127.0.0.1:{router_port}")))
    return [c for c in cases if not args.cases or c.name in args.cases]


def start(command: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", *command],
                                stdout=log, stderr=subprocess.STDOUT)


def counters(base_url: str, names: dict[str, str]) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {label: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(prefix + "{") or line.startswith(prefix + " "))
            for label, prefix in names.items()}


def bench(args, base_url: str, concurrency: int, output: Path) -> dict:
    subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
         "--base-url", base_url, "--dataset", "doc-qa", "--num-docs", str(args.num_docs),
         "--doc-len", str(args.doc_len), "--questions-per-doc", str(args.questions_per_doc),
         "--output-len", str(args.output_len), "--max-concurrency", str(concurrency),
         "--seed", str(concurrency), "--disable-progress", "--output-json", str(output)],
        check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads(output.read_text())["metrics"]
    # The part of cached_tokens from the device pools' prefix caches (not a P/D transfer).
    metrics["pool_hit_rate"] = (((metrics["total_cached_tokens"] or 0)
                                 - (metrics["total_kv_tier_cached_tokens"] or 0))
                                / max(1, metrics["total_input_tokens"] or 0))
    return metrics


def run_case(case: Case, args, workdir: Path) -> dict:
    processes = []
    workdir = workdir / case.name.replace("/", "").replace(" ", "-")
    workdir.mkdir()
    try:
        for label, command, url in case.backends:
            processes.append(start(command, workdir / f"{label}.log"))
            wait_healthy(url + "/health", processes[-1])
        front_url = case.backends[0][2]
        if case.front is not None:
            command, front_url = case.front
            processes.append(start(command, workdir / "router.log"))
            wait_healthy(front_url + "/health", processes[-1])
        results = {}
        for concurrency in args.concurrency:
            before = [counters(url, SERVER_COUNTERS) for _, _, url in case.backends]
            metrics = bench(args, front_url, concurrency,
                            workdir / f"bench-{concurrency}.json")
            time.sleep(1.5)  # one stats interval: /metrics follows the engines' last steps
            after = [counters(url, SERVER_COUNTERS) for _, _, url in case.backends]
            server = {label: sum(a[label] - b[label] for a, b in zip(after, before))
                      for label in SERVER_COUNTERS}
            per_instance = [a["prompt tokens computed"] - b["prompt tokens computed"]
                            for a, b in zip(after, before)]
            server["prompt tokens computed"] = "+".join(f"{n:.0f}" for n in per_instance)
            if case.front is not None and case.name.startswith("router"):
                server.update(counters(front_url, ROUTER_COUNTERS))
            results[concurrency] = {"bench": metrics, "server": server}
        return results
    finally:
        for process in reversed(processes):
            stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="the one engine's threads (the others get one per instance)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--num-docs", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=1000)
    parser.add_argument("--questions-per-doc", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--cases", nargs="*", default=None, help="run only these cases")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-many-instances-"))
    results = {}
    try:
        for case in build_cases(args):
            print(f"running {case.name}", file=sys.stderr)
            results[case.name] = run_case(case, args, workdir)
    finally:
        if args.keep_logs:
            print(f"logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"doc-QA: {args.num_docs} docs x {args.questions_per_doc} questions, doc "
          f"{args.doc_len} tokens, output {args.output_len}; model {args.model}; CPU {cpu_name()}, "
          f"{len(os.sched_getaffinity(0))} cores")
    rows = [("requests/s", "request_throughput"), ("output tok/s", "output_throughput"),
            ("TTFT p50 ms", "median_ttft_ms"), ("TTFT p99 ms", "p99_ttft_ms"),
            ("ITL p50 ms", "median_itl_ms"), ("ITL p99 ms", "p99_itl_ms"),
            ("prefix hit rate", "prefix_cache_hit_rate"), ("pool hit rate", "pool_hit_rate")]
    names = list(results)
    for concurrency in args.concurrency:
        print(f"\nconcurrency {concurrency}")
        print(f"{'':24}" + "".join(f"{n:>20}" for n in names))
        for label, key in rows:
            print(f"{label:24}" + "".join(
                f"{results[n][concurrency]['bench'].get(key) or 0.0:20.2f}" for n in names))
        for label in [*SERVER_COUNTERS, *ROUTER_COUNTERS]:
            print(f"{label:24}" + "".join(
                f"{_number(results[n][concurrency]['server'].get(label, 0.0)):>20}"
                for n in names))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))


def _number(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.0f}"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
