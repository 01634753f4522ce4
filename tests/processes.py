"""Start `pagedserve` commands as processes the way the README does, and stop them by pid.

    with ServedProcess(["serve", MODEL_NAME, "--port", str(port), ...], tmp_path / "a.log",
                       f"http://127.0.0.1:{port}") as server:
        httpx.post(server.base_url + "/v1/completions", ...)
        metric(server.base_url, "pagedserve:prompt_tokens_computed_total")

Each process writes its log to a file (not a pipe nobody drains); a failed start raises with the
log's tail. Leaving the `with` stops the process with SIGTERM (SIGKILL after a timeout) and waits
for it, so no test leaves one behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).parents[1]


def xdist_worker() -> tuple[int, int] | None:
    """(this pytest-xdist worker's index, the number of workers), or None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker is None:
        return None
    return int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])


_FIRST_TEST_PORT = 20_000
_PORTS_PER_WORKER = 2_000
_next_port: int | None = None


def free_port(count: int = 1) -> int:
    """A port P with P .. P + count - 1 free on 127.0.0.1, for a server a test starts.

    Taken from this pytest-xdist worker's own range below Linux's ephemeral ports (32768 on):
    a port from bind(0) could be handed to the other worker too while our server still loads
    (it binds only when ready), and a loopback client's source port could take it meanwhile.
    Calls walk the range, so a port is not handed out twice until it wraps; each is checked by
    binding it (without SO_REUSEADDR, so a port in TIME_WAIT counts as taken)."""
    global _next_port
    worker_index = (xdist_worker() or (0, 1))[0]
    first = _FIRST_TEST_PORT + worker_index * _PORTS_PER_WORKER
    if _next_port is None:  # another session beside this one most likely starts elsewhere
        _next_port = os.getpid() % _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        offset, _next_port = _next_port, (_next_port + count) % _PORTS_PER_WORKER
        if offset + count > _PORTS_PER_WORKER:
            continue
        if all(_bindable(first + offset + i) for i in range(count)):
            return first + offset
    raise RuntimeError(f"no {count} consecutive free ports in {first}..{first + _PORTS_PER_WORKER}")


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def pagedserve_command(*args: str) -> list[str]:
    """`pagedserve ARGS...` with this interpreter (the console script may not be on PATH)."""
    return [sys.executable, "-m", "pagedserve.entrypoints.cli", *args]


class ServedProcess:
    def __init__(self, args: list[str], log_path: Path, base_url: str,
                 start_timeout_s: float = 240.0, env: dict[str, str] | None = None) -> None:
        """args: the pagedserve subcommand and its flags; base_url: where /health answers."""
        self.command = pagedserve_command(*args)
        self.log_path = Path(log_path)
        self.base_url = base_url
        self.start_timeout_s = start_timeout_s
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self) -> ServedProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=REPO_ROOT, env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise AssertionError(f"{self.command} exited with {self.process.returncode}:"
                                         f"\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.base_url} was not healthy after "
                                         f"{self.start_timeout_s:.0f} s:\n{self.log_tail()}")
                try:
                    if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the server drains), SIGKILL past the timeout; returns the exit code."""
        if self.process is None:
            return None
        process = self.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.wait()

    def __enter__(self) -> ServedProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is `pid` (a server's worker or replica processes), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` on base_url's /metrics whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
