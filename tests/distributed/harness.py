"""Run the ranks of one distributed test as separate processes (gloo over local TCP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.processes import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_ranks(world_size: int, args: dict, out_dir: Path, timeout_s: float = 600.0) -> list[dict]:
    """Start `python -m tests.distributed.rank_main` once per rank with args plus rank,
    init_method, out_dir and timeout_s. Returns each rank's rank{r}.json (see run_processes).
    timeout_s guards against a hang, it is no speed check: beside a CPU burner, four ranks on two
    cores take minutes."""
    args = {**args, "init_method": f"tcp://127.0.0.1:{free_port()}", "out_dir": str(out_dir),
            "timeout_s": timeout_s}
    return run_processes("tests.distributed.rank_main",
                         [{**args, "rank": rank} for rank in range(world_size)], out_dir, timeout_s)


def run_processes(module: str, rank_args: list[dict], out_dir: Path,
                  timeout_s: float) -> list[dict]:
    """Start `python -m module JSON` once per entry of rank_args (one thread each); wait for all,
    killing any left at the end by pid. Rank r writes out_dir/rank{r}.json, returned in rank
    order; AssertionError with the logs if a rank fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    procs: list[subprocess.Popen] = []
    logs = [out_dir / f"rank{rank}.log" for rank in range(len(rank_args))]
    try:
        for args, log in zip(rank_args, logs):
            with open(log, "w") as log_file:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, json.dumps(args)],
                    cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                ))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    assert not failed, "\n".join(
        f"--- rank {rank} (exit {procs[rank].returncode}):\n{logs[rank].read_text()[-3000:]}"
        for rank in failed)
    return [json.loads((out_dir / f"rank{rank}.json").read_text())
            for rank in range(len(rank_args))]
