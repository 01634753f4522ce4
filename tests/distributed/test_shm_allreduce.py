"""ShmAllReduce: exact sums over 2 and 3 processes, back to back; timeouts; no segment left."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

from pagedserve.distributed import shm_allreduce
from pagedserve.distributed.shm_allreduce import ShmAllReduce
from tests.distributed.harness import run_processes

MAX_BYTES = 256 * 576 * 4


def _name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _run_ranks(tmp_path: Path, world_size: int, args: dict, timeout_s: float = 60.0) -> list[dict]:
    """One worker process per rank (tests/distributed/shm_allreduce_worker.py); their JSON."""
    rank_args = [{"group_ranks": list(range(world_size)), "world_size": world_size,
                  "max_bytes": MAX_BYTES, "timeout_s": 20.0, **args, "rank": rank,
                  "out": str(tmp_path / f"rank{rank}.json")} for rank in range(world_size)]
    return run_processes("tests.distributed.shm_allreduce_worker", rank_args, tmp_path, timeout_s)


def _segment_path(name: str) -> str:
    return os.path.join("/dev/shm", f"pagedserve-shm-allreduce-{name}")


def _write_stale_segment(name: str, world_size: int) -> None:
    """A complete-looking segment whose creator is dead, as a crash during construction would
    leave: members must not use it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    slot_bytes = (MAX_BYTES + 63) // 64 * 64
    data_offset = (64 * (1 + world_size) + 4095) // 4096 * 4096
    header = torch.zeros(data_offset // 8, dtype=torch.int64)
    header[:5] = torch.tensor([shm_allreduce._MAGIC, shm_allreduce._LAYOUT_VERSION, world_size,
                               slot_bytes, dead.pid])
    with open(_segment_path(name), "wb") as f:
        f.write(header.numpy().tobytes())
        f.truncate(data_offset + 2 * world_size * slot_bytes)


@pytest.mark.parametrize("world_size", [2, 3])
def test_exact_sums_back_to_back(tmp_path: Path, world_size: int) -> None:
    name = _name()
    args = {"name": name, "seed": 1234 + world_size, "iterations": 300, "delay_p": 0.05}
    if world_size == 2:
        _write_stale_segment(name, world_size)  # no barrier: members skip it, rank 0 replaces it
    else:
        barrier_dir = tmp_path / "barrier"
        barrier_dir.mkdir()
        args["barrier_dir"] = str(barrier_dir)
    try:
        results = _run_ranks(tmp_path, world_size, args)
        assert not os.path.exists(_segment_path(name))
    finally:
        if os.path.exists(_segment_path(name)):
            os.unlink(_segment_path(name))
    for result in results:
        assert result["error"] is None
        assert result["mismatches"] == []
        assert result["ok"] == 300
    assert results[0]["segment_left_after_init"] is False
    assert len({result["digest"] for result in results}) == 1  # bitwise identical on all ranks


def test_member_that_never_arrives_times_out() -> None:
    """Global ranks 4 and 5 (rank 5 a thread of this process: cheaper than a second process);
    rank 5 stops after 30 calls: rank 4's 31st call raises, naming rank 5, and so do later ones."""
    name = _name()
    peer_calls: list[int] = []

    def peer() -> None:
        with ShmAllReduce([4, 5], 1, name, 4096, timeout_s=2.0) as shm:
            for call in range(30):
                shm.all_reduce(torch.full((3, 5), float(call)))
                peer_calls.append(call)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        with ShmAllReduce([4, 5], 0, name, 4096, timeout_s=0.5) as shm:
            assert not os.path.exists(_segment_path(name))
            for call in range(30):
                x = torch.full((3, 5), float(call))
                assert torch.equal(shm.all_reduce(x), torch.full((3, 5), 2.0 * call))
            with pytest.raises(RuntimeError, match=r"call 31 timed out .* ranks \[5\] of group"):
                shm.all_reduce(torch.zeros(3, 5))
            with pytest.raises(RuntimeError, match="unusable"):
                shm.all_reduce(torch.zeros(3, 5))
    finally:
        thread.join(timeout=10)
    assert not thread.is_alive() and peer_calls == list(range(30))


def test_construction_timeouts_leave_no_segment() -> None:
    name = _name()
    with pytest.raises(RuntimeError, match=r"ranks \[7\] of group \[3, 7\] did not map"):
        ShmAllReduce([3, 7], 0, name, 1024, timeout_s=0.2)
    assert not os.path.exists(_segment_path(name))
    with pytest.raises(RuntimeError, match="waiting for rank 3 to create"):
        ShmAllReduce([3, 7], 1, name, 1024, timeout_s=0.2)
    with pytest.raises(RuntimeError, match="rank 3 failed to create"):  # no wait after a barrier
        ShmAllReduce([3, 7], 1, name, 1024, barrier=lambda: None, timeout_s=30.0)


def test_rejects_what_it_cannot_reduce() -> None:
    with ShmAllReduce([0], 0, _name(), 1024) as shm:
        assert not os.path.exists(shm.path)
        x = torch.arange(256, dtype=torch.float32)  # exactly 1024 bytes
        assert shm.supports(x) and shm.all_reduce(x) is x
        for bad in (torch.zeros(257), torch.zeros(4, 4).t(), torch.zeros(4, dtype=torch.int32),
                    torch.zeros(4, dtype=torch.float64)):
            assert not shm.supports(bad)
            with pytest.raises(ValueError):
                shm.all_reduce(bad)
    assert shm._mm is None
