"""`pagedserve bench collectives`: what one all-reduce (tensor parallel; gloo and the
shared-memory one) and one send/recv of the hidden states (pipeline parallel, gloo) cost
between worker processes, at the sizes a step uses.

Starts --world-size processes of this module (gloo on the CPU, each pinned to its own share of
the CPUs with one thread, as the engine's workers are), times each collective on (tokens, hidden)
tensors, and prints the mean and median per call, and the mean per decode step (2 all-reduces
per layer). The mean is what a step pays: on a busy core a few calls wait milliseconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from pagedserve.distributed.ports import unused_port

DTYPES = ("float32", "bfloat16")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=576, help="SmolLM2: 576")
    parser.add_argument("--num-layers", type=int, default=30, help="for the per-step figure")
    parser.add_argument("--tokens", type=str, default="1,8,32,256",
                        help="comma-separated rows per collective (the step's tokens)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--iterations", type=int, default=200)


def main(args: argparse.Namespace) -> int:
    port = unused_port()
    config = json.dumps({"world_size": args.world_size, "port": port,
                         "hidden_size": args.hidden_size, "dtype": args.dtype,
                         "tokens": [int(t) for t in args.tokens.split(",")],
                         "iterations": args.iterations})
    processes = [subprocess.Popen([sys.executable, "-m", "pagedserve.benchmarks.collectives",
                                   config, str(rank)], stdout=subprocess.PIPE, text=True)
                 for rank in range(args.world_size)]
    try:
        outputs = [process.communicate(timeout=600)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    if any(process.returncode for process in processes):
        raise RuntimeError("a benchmark rank failed")
    results = json.loads(outputs[0])
    print(f"gloo, {args.world_size} processes, one thread each, {args.dtype}, hidden "
          f"{args.hidden_size}, mean of {args.iterations} back-to-back calls")
    print(f"{'tokens':>8}{'backend':>9}{'all-reduce mean us':>20}{'median us':>11}"
          f"{'per step (' + str(2 * args.num_layers) + ' calls)':>22}{'send+recv us':>14}")
    for row in results:
        for backend, key, send_recv in (("gloo", "all_reduce", f"{row['send_recv_us']:.1f}"),
                                        ("shm", "shm_all_reduce", "")):
            per_step_ms = 2 * args.num_layers * row[f"{key}_us"] / 1000
            print(f"{row['tokens']:>8}{backend:>9}{row[f'{key}_us']:>20.1f}"
                  f"{row[f'{key}_median_us']:>11.1f}{per_step_ms:>19.2f} ms{send_recv:>14}")
    return 0


def _rank_main(config: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from pagedserve.distributed.cpu_binding import bind_to_cpus, cpu_share, usable_cpus
    from pagedserve.distributed.parallel_state import SHM_ALL_REDUCE_MAX_BYTES
    from pagedserve.distributed.shm_allreduce import ShmAllReduce

    world_size = config["world_size"]
    bind_to_cpus(cpu_share(usable_cpus(), rank, world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}",
                            world_size=world_size, rank=rank)
    shm = ShmAllReduce(list(range(world_size)), rank, f"pagedserve-bench-{config['port']}",
                       SHM_ALL_REDUCE_MAX_BYTES, barrier=dist.barrier)
    dtype = getattr(torch, config["dtype"])
    iterations = config["iterations"]
    results = []
    for tokens in config["tokens"]:
        x = torch.randn(tokens, config["hidden_size"]).to(dtype)
        all_reduce_us, median_us = _time_calls(lambda: dist.all_reduce(x), iterations)
        shm_us, shm_median_us = _time_calls(lambda: shm.all_reduce(x), iterations)
        # Ping-pong between ranks 0 and 1: half a round trip is one send/recv.
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)
        send_recv_us = (time.perf_counter() - start) / iterations / 2 * 1e6
        results.append({"tokens": tokens, "all_reduce_us": all_reduce_us,
                        "all_reduce_median_us": median_us, "shm_all_reduce_us": shm_us,
                        "shm_all_reduce_median_us": shm_median_us, "send_recv_us": send_recv_us})
    shm.close()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(results))


def _time_calls(call, iterations: int) -> tuple[float, float]:
    """(mean, median) microseconds of back-to-back calls, after a barrier and a warm-up: as a
    step issues them (timing one call after a barrier would measure how far apart the ranks
    left the barrier instead)."""
    import torch.distributed as dist

    for _ in range(10):
        call()
    dist.barrier()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sum(times) / iterations * 1e6, sorted(times)[iterations // 2] * 1e6


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]), int(sys.argv[2]))
