"""One worker process per rank; the engine drives them over sockets, the ranks talk to each other
over torch.distributed (gloo on the CPU, NCCL on CUDA).

    engine process                         worker processes (this node, or `serve --headless`)
    MultiprocExecutor --ExecuteModel-->    rank 0 ... rank N-1   (every rank gets every step)
            <--WorkerReply(output)--       the output rank: tensor rank 0 of the last stage

Every rank dials the engine's control port and says which rank it is; a frame is encoded once and
sent to all. A collector thread reads the replies: one per call from each rank asked, in the order
the calls were sent. A rank that fails a call, dies or closes its socket fails every call in
flight at once (ExecutorError) and the executor for good: nothing waits on a dead rank. A worker
whose socket closes (the engine died) exits, so none outlives its engine.
"""

from __future__ import annotations

import collections
import logging
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import EngineConfig, ParallelConfig
from pagedserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.ports import unused_port
from pagedserve.executor import messages
from pagedserve.executor.abstract import Executor, ExecutorError, merge_expert_load

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""How long every rank gets to dial in and load its shard (remote nodes may start later)."""
SHUTDOWN_TIMEOUT_S = 10.0
"""How long a worker gets to exit after Shutdown before it is terminated, then killed."""


def start_local_workers(
    parallel: ParallelConfig, node_rank: int, control_address: tuple[str, int]
) -> list[subprocess.Popen]:
    """Start this node's ranks. Each runs in a session of its own, so a Ctrl-C in the terminal
    reaches the engine (which drains, then stops them) and not the workers mid-step."""
    host, port = control_address
    first_rank = node_rank * parallel.local_world_size
    return [
        subprocess.Popen(
            [sys.executable, "-m", "pagedserve.executor.worker_process",
             "--control", f"{host}:{port}", "--rank", str(first_rank + local_rank),
             "--local-rank", str(local_rank)],
            start_new_session=True,
        )
        for local_rank in range(parallel.local_world_size)
    ]


def stop_processes(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait up to timeout_s for processes to exit, then terminate, then kill; reap them all."""
    deadline = time.monotonic() + timeout_s
    for signal_name in ("wait", "terminate", "kill"):
        for process in processes:
            if process.poll() is None and signal_name != "wait":
                getattr(process, signal_name)()
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(process.poll() is not None for process in processes):
            return
        deadline = time.monotonic() + 2.0


@dataclass
class _Call:
    """One message sent to the workers, waiting for the replies of `ranks_left`."""

    future: Future
    ranks_left: set[int]
    values: dict[int, Any] = field(default_factory=dict)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.config = config
        self.world_size = parallel.world_size
        self.max_concurrent_batches = parallel.pipeline_parallel_size
        self.output_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        """Makes queueing a call and sending its frame one step, so that calls from several
        threads (a step, an adapter load) reach every rank whole and in the order queued."""
        self._pending: dict[int, collections.deque[_Call]] = {
            rank: collections.deque() for rank in range(self.world_size)}
        """Per rank, the calls awaiting its reply, in the order they were sent."""
        self._failure: str | None = None
        self._shutting_down = False
        self._sockets: dict[int, socket.socket] = {}
        self._collector: threading.Thread | None = None

        host = parallel.master_addr
        rendezvous_port = parallel.master_port or unused_port(host)
        control_port = parallel.master_port + 1 if parallel.master_port else 0
        try:
            self._listener = socket.create_server((host, control_port))
        except OSError as error:
            raise ExecutorError(f"cannot listen for workers on {host}:{control_port}: {error}")
        control_port = self._listener.getsockname()[1]
        self.processes = start_local_workers(parallel, 0, (host, control_port))
        try:
            self._accept_workers(time.monotonic() + STARTUP_TIMEOUT_S)
            self._collector = threading.Thread(target=self._collect, name="pagedserve-collector",
                                               daemon=True)
            self._collector.start()
            init_method = f"tcp://{host}:{rendezvous_port}"
            self._call(messages.InitWorker(config, init_method), self._all_ranks).result(
                timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    @property
    def _all_ranks(self) -> list[int]:
        return list(range(self.world_size))

    # ---- the Executor interface -------------------------------------------------------------

    def determine_num_kv_blocks(self) -> int:
        return min(self._call(messages.DetermineNumKVBlocks(), self._all_ranks).result().values())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call(messages.InitializeKVCache(num_blocks), self._all_ranks).result()

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        call = self._call(messages.ExecuteModel(scheduler_output), [self.output_rank])
        output: Future[ModelRunnerOutput] = Future()

        def unwrap(done: Future) -> None:
            if done.exception() is not None:
                output.set_exception(done.exception())
            else:
                output.set_result(done.result()[self.output_rank])

        call.add_done_callback(unwrap)
        return output

    def add_lora(self, lora_int_id: int, lora_path: str) -> None:
        # Each rank loads between its steps (messages are handled in order).
        replies = self._call(messages.AddLoRA(lora_int_id, lora_path), self._all_ranks).result()
        errors = [error for error in replies.values() if error is not None]
        if errors:
            self.remove_lora(lora_int_id)  # the ranks that did load it
            raise ValueError(errors[0])

    def remove_lora(self, lora_int_id: int) -> None:
        self._call(messages.RemoveLoRA(lora_int_id), self._all_ranks).result()

    def start_profile(self) -> None:
        # Each rank starts between its steps, on its main thread (messages run in order).
        replies = self._call(messages.StartProfile(), self._all_ranks).result()
        errors = [f"rank {rank}: {error}" for rank, error in sorted(replies.items())
                  if error is not None]
        if errors:
            self._call(messages.StopProfile(export=False), self._all_ranks).result()  # the others
            raise ValueError("cannot start the profiler: " + "; ".join(errors))

    def stop_profile(self) -> list[str]:
        replies = self._call(messages.StopProfile(), self._all_ranks).result()
        errors = [f"rank {rank}: {reply.error}" for rank, reply in sorted(replies.items())
                  if reply.error is not None]
        if errors:
            raise ValueError("cannot stop the profiler: " + "; ".join(errors))
        return [reply.path for _, reply in sorted(replies.items())]

    def sleep(self, level: int) -> None:
        self._call(messages.Sleep(level), self._all_ranks).result()

    def wake_up(self) -> None:
        self._call(messages.WakeUp(), self._all_ranks).result()

    def update_weights(self, model_path: str) -> None:
        self._call(messages.UpdateWeights(model_path), self._all_ranks).result()

    def calibrate_outlier_channels(self, token_ids: list[int]) -> int:
        replies = self._call(messages.CalibrateOutlierChannels(token_ids), self._all_ranks)
        return replies.result()[0]

    def memory_report(self) -> list[dict]:
        replies = self._call(messages.MemoryReport(), self._all_ranks).result()
        return [replies[rank] for rank in sorted(replies)]

    def expert_load(self) -> dict[int, list[int]]:
        replies = self._call(messages.ExpertLoad(), self._all_ranks).result()
        return merge_expert_load(replies[rank] for rank in sorted(replies))

    def check_idle(self) -> list[str]:
        replies = self._call(messages.CheckIdle(), self._all_ranks).result()
        return [f"rank {rank}: {problem}" for rank, problems in sorted(replies.items())
                for problem in problems]

    @property
    def is_failed(self) -> bool:
        return self._failure is not None

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        # After a failure the live ranks may be stuck in a collective with the dead one: no wait.
        timeout_s = 0.0 if self._failure is not None else SHUTDOWN_TIMEOUT_S
        if self._failure is None:
            try:
                self._send_to_all(messages.encode_frame(messages.Shutdown()))
            except OSError:
                pass
        stop_processes(self.processes, timeout_s)
        self._fail("the executor was shut down")
        for sock in self._sockets.values():
            sock.close()
        self._listener.close()
        if self._collector is not None and self._collector is not threading.current_thread():
            self._collector.join(timeout=5)

    # ---- calls and replies ------------------------------------------------------------------

    def _call(self, message: Any, reply_ranks: list[int]) -> Future[dict[int, Any]]:
        """Send `message` to every rank; the future gets {rank: reply value} of reply_ranks."""
        frame = messages.encode_frame(message)
        call = _Call(Future(), set(reply_ranks))
        with self._send_lock:
            with self._lock:
                if self._failure is not None:
                    call.future.set_exception(ExecutorError(self._failure))
                    return call.future
                for rank in reply_ranks:
                    self._pending[rank].append(call)
            try:
                self._send_to_all(frame)
            except OSError as error:
                self._fail(f"cannot reach the workers: {error}")
        return call.future

    def _send_to_all(self, frame: bytes) -> None:
        for sock in self._sockets.values():
            sock.sendall(frame)

    def _collect(self) -> None:
        """Read every rank's replies until a failure or shutdown."""
        selector = selectors.DefaultSelector()
        for rank, sock in self._sockets.items():
            selector.register(sock, selectors.EVENT_READ, rank)
        while self._failure is None:
            for key, _ in selector.select(timeout=1.0):
                rank = key.data
                try:
                    reply = messages.recv_message(key.fileobj)
                except (ConnectionError, OSError, ValueError) as error:
                    self._fail(self._describe_death(rank, error))
                    break
                if isinstance(reply, messages.WorkerFailure):
                    self._fail(f"worker rank {reply.rank} failed: {reply.message}")
                    break
                self._complete(rank, reply.value)
        selector.close()

    def _complete(self, rank: int, value: Any) -> None:
        with self._lock:
            if not self._pending[rank]:
                return  # a reply after a failure was declared
            call = self._pending[rank].popleft()
            call.values[rank] = value
            call.ranks_left.discard(rank)
            done = not call.ranks_left
        if done:
            call.future.set_result(call.values)

    def _describe_death(self, rank: int, error: Exception) -> str:
        local = self.processes[rank] if rank < len(self.processes) else None
        if local is not None:
            try:
                local.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            if local.returncode is not None:
                return f"worker rank {rank} (pid {local.pid}) died with exit code {local.returncode}"
        return f"lost the connection to worker rank {rank}: {error}"

    def _fail(self, reason: str) -> None:
        """Fail every call in flight and every later one."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
            calls = {id(call): call for pending in self._pending.values() for call in pending}
            for pending in self._pending.values():
                pending.clear()
        if not self._shutting_down:
            logger.error("the data plane failed: %s", reason)
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(ExecutorError(reason))

    # ---- start-up ---------------------------------------------------------------------------

    def _accept_workers(self, deadline: float) -> None:
        """Wait for every rank to dial in; fail at once if a local worker exits first."""
        self._listener.settimeout(0.5)
        while len(self._sockets) < self.world_size:
            for rank, process in enumerate(self.processes):
                if process.poll() is not None and rank not in self._sockets:
                    raise ExecutorError(f"worker rank {rank} exited with code {process.returncode} "
                                        "before it connected")
            if time.monotonic() > deadline:
                raise ExecutorError(
                    f"only {len(self._sockets)} of {self.world_size} workers connected within "
                    f"{STARTUP_TIMEOUT_S:.0f} s (a multi-node run needs `pagedserve serve "
                    "--headless` on every other node)")
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(30.0)
            hello = messages.recv_message(sock)
            sock.settimeout(None)
            if (not isinstance(hello, messages.Hello) or not 0 <= hello.rank < self.world_size
                    or hello.rank in self._sockets):
                sock.close()
                raise ExecutorError(f"unexpected first message from a worker: {hello!r}")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets[hello.rank] = sock


def run_headless(parallel: ParallelConfig) -> int:
    """`pagedserve serve --headless`: a node without the engine. Start this node's ranks (they
    dial node 0's control port), wait for them, and return 0 if all exited cleanly. SIGTERM or
    SIGINT stops them."""
    if parallel.node_rank == 0 or not parallel.master_port:
        raise ValueError("--headless runs node 1 or later (--node-rank) of a multi-node run and "
                         "needs node 0's --master-addr and --master-port")
    control_address = (parallel.master_addr, parallel.master_port + 1)
    processes = start_local_workers(parallel, parallel.node_rank, control_address)
    logger.info("node %d: started ranks %s, dialling %s:%d", parallel.node_rank,
                [p.pid for p in processes], *control_address)

    def stop(signum, frame) -> None:
        for process in processes:
            if process.poll() is None:
                process.terminate()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        exit_codes = [process.wait() for process in processes]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_processes(processes, SHUTDOWN_TIMEOUT_S)
    return 0 if all(code == 0 for code in exit_codes) else 1
