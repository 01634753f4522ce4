"""The founding document's document-QA experiment, one invocation: the same doc-QA load, whose
documents do not fit the KV pool, against a server with no tier, with the disk tier and with
Redis. For each: `pagedserve bench serve`'s hit rate, TTFT and throughput, plus the server's own
counters from /metrics (prompt tokens computed, tier tokens loaded, the cost model's decisions).

    .venv/bin/python scripts/bench_kv_tiers.py --num-docs 8 --doc-len 1000 \\
        --questions-per-doc 4 --kv-cache-memory 64MiB

Every process it starts (servers, redis-server) is stopped by its pid before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

COUNTERS = {
    "prompt tokens computed": "pagedserve:prompt_tokens_computed_total",
    "prefix cache hits": "vllm:prefix_cache_hits_total",
    "tier tokens loaded": "pagedserve:kv_tier_loaded_tokens_total",
    "tier hit tokens": "pagedserve:kv_tier_hit_tokens_total",
    "decisions: load": 'pagedserve:kv_tier_decisions_total{decision="load"',
    "decisions: recompute": 'pagedserve:kv_tier_decisions_total{decision="recompute"',
    "tier faults": "pagedserve:kv_tier_faults_total",
    "tier bytes saved": "pagedserve:kv_tier_bytes_saved_total",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become healthy")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    values = {}
    for label, prefix in COUNTERS.items():
        values[label] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith(prefix))
    return values


def run_case(name: str, transfer_config: dict | None, args, workdir: Path) -> dict:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", args.model,
               "--port", str(port), "--kv-cache-memory", args.kv_cache_memory,
               "--log-level", "warning"]
    if transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(transfer_config)]
    log = open(workdir / f"server-{name}.log", "wb")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base_url + "/health", server)
        output = workdir / f"bench-{name}.json"
        subprocess.run(
            [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
             "--base-url", base_url, "--dataset", "doc-qa", "--num-docs", str(args.num_docs),
             "--doc-len", str(args.doc_len), "--questions-per-doc", str(args.questions_per_doc),
             "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
             "--seed", "0", "--disable-progress", "--output-json", str(output)],
            check=True, stdout=subprocess.DEVNULL)
        time.sleep(1.5)  # one stats interval: /metrics follows the engine's last step
        result = json.loads(output.read_text())
        return {"bench": result["metrics"], "server": scrape(base_url)}
    finally:
        stop(server)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-docs", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=1000)
    parser.add_argument("--questions-per-doc", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="64MiB",
                        help="small enough that the documents do not all fit")
    parser.add_argument("--load-policy", default="cost", choices=("cost", "always"))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-kv-tiers-"))
    redis_binary = shutil.which("redis-server")
    redis = None
    results = {}
    try:
        cases: list[tuple[str, dict | None]] = [("no tier", None), ("disk", {
            "kv_connector": "DiskConnector",
            "kv_connector_extra_config": {"path": str(workdir / "kv"), "max_bytes": "4GiB",
                                          "load_policy": args.load_policy}})]
        if redis_binary is not None:
            redis_port = free_port()
            redis = subprocess.Popen(
                [redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            cases.append(("redis", {
                "kv_connector": "RedisConnector",
                "kv_connector_extra_config": {"url": f"redis://127.0.0.1:{redis_port}/0",
                                              "load_policy": args.load_policy}}))
        else:
            print("redis-server not found: skipping the Redis case", file=sys.stderr)
        for name, config in cases:
            results[name] = run_case(name, config, args, workdir)
    finally:
        if redis is not None:
            redis.kill()
            redis.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"doc-QA: {args.num_docs} docs x {args.questions_per_doc} questions, doc "
          f"{args.doc_len} tokens, output {args.output_len}, concurrency {args.max_concurrency}, "
          f"KV pool {args.kv_cache_memory}, CPU {cpu_name()}")
    names = list(results)
    rows = [("requests/s", lambda r: r["bench"]["request_throughput"]),
            ("output tokens/s", lambda r: r["bench"]["output_throughput"]),
            ("TTFT p50 (ms)", lambda r: r["bench"]["median_ttft_ms"]),
            ("TTFT p99 (ms)", lambda r: r["bench"]["p99_ttft_ms"]),
            ("prefix hit rate", lambda r: r["bench"].get("prefix_cache_hit_rate") or 0.0),
            ("tier cached tokens", lambda r: r["bench"].get("total_kv_tier_cached_tokens") or 0)]
    rows += [(label, lambda r, label=label: r["server"][label]) for label in COUNTERS]
    print(f"{'':24}" + "".join(f"{n:>14}" for n in names))
    for label, get in rows:
        print(f"{label:24}" + "".join(f"{get(results[n]):14.2f}" for n in names))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
