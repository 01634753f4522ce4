"""`pagedserve serve` with worker processes: tensor parallel on one node, pipeline parallel over
two "nodes" on loopback (`serve --headless` for node 1), both through the official openai client
with streaming; and a worker killed mid-stream: the stream ends with an error, /health answers
503, the server exits non-zero, and no worker process is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.utils import MODEL_NAME
from tests.processes import child_pids, free_port
from tests.shared_engines import SUITE_ACTIVATION_QUANTIZATION

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
SERVE = [sys.executable, "-m", "pagedserve.entrypoints.openai.api_server"]
# The suite's int16 activations: -tp adds its ranks' partial sums in another order than one
# process, which fp32's default int8 can turn into another token (tests/shared_engines.py)
COMMON_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "2048",
                "--activation-quantization", SUITE_ACTIVATION_QUANTIZATION,
                "--log-level", "warning"]


def start(args: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(SERVE + args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_healthy(process: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, f"server exited: {log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "server did not become healthy"
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)



def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # exited, waiting for its (new) parent to reap it


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def ask(base_url: str) -> tuple[str, str]:
    """A plain completion and the same one streamed through the chat route; greedy."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    text = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                     max_tokens=12, temperature=0).choices[0].text
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, usage, finish_reason = [], None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reason = choice.finish_reason or finish_reason
    assert finish_reason in ("stop", "length") and usage.completion_tokens > 0
    return text, "".join(pieces)


@pytest.fixture(scope="module")
def single_process_answers(tmp_path_factory):
    """The same questions to a one-process server: the parallel ones must answer the same."""
    log_path = tmp_path_factory.mktemp("one") / "server.log"
    port = free_port()
    process = start([MODEL_NAME, "--port", str(port), *COMMON_FLAGS], log_path)
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", log_path)
        return ask(f"http://127.0.0.1:{port}")
    finally:
        stop(process)


def test_tp3_serves_then_a_killed_worker_fails_the_server_cleanly(tmp_path,
                                                                   single_process_answers):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    process = start([MODEL_NAME, "--port", str(port), "-tp", "3", *COMMON_FLAGS], log_path)
    try:
        wait_healthy(process, base_url, log_path)
        workers = child_pids(process.pid)
        assert len(workers) == 3, workers
        assert ask(base_url) == single_process_answers

        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        first_chunk, outcome = threading.Event(), {}

        def long_stream() -> None:
            try:
                for _ in client.completions.create(
                        model=MODEL_NAME, prompt="A long story:", max_tokens=1500,
                        temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    first_chunk.set()
                outcome["result"] = "finished"
            except openai.APIError as error:
                outcome["result"] = f"error: {error}"

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert first_chunk.wait(timeout=60), "the stream never started"
        # /health is watched from before the kill until the server is gone: it must turn 503
        # during the server's short grace period, however late this thread gets to look.
        health = []
        watcher = threading.Thread(target=watch_health, args=(base_url, process, health))
        watcher.start()
        os.kill(workers[1], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the stream hung after its worker died"
        assert outcome["result"].startswith("error") and "failed" in outcome["result"]
        assert process.wait(timeout=60) != 0
        watcher.join(timeout=30)
        assert 503 in health, health
        deadline = time.monotonic() + 30
        while not all(is_gone(pid) for pid in workers):
            assert time.monotonic() < deadline, "worker processes left behind"
            time.sleep(0.1)
        # The failure named is the first one the executor sees: rank 1's exit, or a peer's
        # broken collective (gloo "connection reset"), whichever reports first.
        assert "the data plane failed: worker rank" in log_path.read_text()
    finally:
        stop(process)


def watch_health(base_url: str, process: subprocess.Popen, statuses: list) -> None:
    """Append GET /health's status codes to `statuses` until `process` has exited."""
    while process.poll() is None:
        try:
            statuses.append(httpx.get(base_url + "/health", timeout=5).status_code)
        except httpx.TransportError:
            pass  # exiting: the loop ends once the process is gone
        time.sleep(0.02)


def test_pp2_over_two_nodes_on_loopback(tmp_path, single_process_answers):
    port, master_port = free_port(), free_port(2)  # the rendezvous and the workers' control port
    base_url = f"http://127.0.0.1:{port}"
    multi_node = ["-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(master_port)]
    node1_log, node0_log = tmp_path / "node1.log", tmp_path / "node0.log"
    # Node 1 first: its worker keeps dialling until node 0's engine listens.
    node1 = start([MODEL_NAME, "--headless", "--node-rank", "1", *multi_node, *COMMON_FLAGS],
                  node1_log)
    node0 = start([MODEL_NAME, "--port", str(port), "--node-rank", "0", *multi_node,
                   *COMMON_FLAGS], node0_log)
    try:
        wait_healthy(node0, base_url, node0_log)
        assert len(child_pids(node0.pid)) == 1 and len(child_pids(node1.pid)) == 1
        assert ask(base_url) == single_process_answers
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=60) == 0, node0_log.read_text()[-3000:]
        assert node1.wait(timeout=60) == 0, node1_log.read_text()[-3000:]
    finally:
        stop(node0, node1)
