"""The main of one worker process: dial the engine, build the Worker, serve its calls.

Started by the executor (this node) or by `pagedserve serve --headless` (another node) as
`python -m pagedserve.executor.worker_process --control HOST:PORT --rank R --local-rank L`.
A reader thread takes the engine's frames off the socket; if the socket closes the engine is
gone, and the process exits at once, even from inside a collective that would never finish.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback

from pagedserve.executor import messages
from pagedserve.worker.worker import Worker

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 600.0
"""A headless node may start before the engine's node: keep dialling this long."""


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _read_forever(sock: socket.socket, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            message = messages.recv_message(sock)
        except (ConnectionError, OSError):
            os._exit(1)  # the engine is gone: never outlive it, never wait on a collective
        inbox.put(message)
        if isinstance(message, messages.Shutdown):
            return


def _handle(worker: Worker, message) -> messages.WorkerReply | None:
    """Run one call; None when this rank sends no reply (a step on a rank without output)."""
    if isinstance(message, messages.ExecuteModel):
        output = worker.execute_model(message.scheduler_output)
        return None if output is None else messages.WorkerReply(output)
    if isinstance(message, messages.DetermineNumKVBlocks):
        return messages.WorkerReply(worker.determine_num_kv_blocks())
    if isinstance(message, messages.InitializeKVCache):
        worker.initialize_kv_cache(message.num_blocks)
        return messages.WorkerReply()
    if isinstance(message, messages.Sleep):
        worker.sleep(message.level)
        return messages.WorkerReply()
    if isinstance(message, messages.WakeUp):
        worker.wake_up()
        return messages.WorkerReply()
    if isinstance(message, messages.CalibrateOutlierChannels):
        return messages.WorkerReply(worker.calibrate_outlier_channels(message.token_ids))
    if isinstance(message, messages.UpdateWeights):
        worker.update_weights(message.model_path)
        return messages.WorkerReply()
    if isinstance(message, messages.CheckIdle):
        return messages.WorkerReply(worker.check_idle())
    if isinstance(message, messages.MemoryReport):
        return messages.WorkerReply(worker.memory_report())
    if isinstance(message, messages.ExpertLoad):
        return messages.WorkerReply(worker.expert_load())
    if isinstance(message, messages.AddLoRA):
        try:
            worker.add_lora(message.lora_int_id, message.lora_path)
        except ValueError as error:
            return messages.WorkerReply(str(error))
        return messages.WorkerReply()
    if isinstance(message, messages.StartProfile):
        try:
            worker.start_profile()
        except ValueError as error:  # a busy profiler, an unwritable directory
            return messages.WorkerReply(str(error))
        return messages.WorkerReply()
    if isinstance(message, messages.StopProfile):
        try:
            path = worker.stop_profile(message.export)
        except ValueError as error:
            return messages.WorkerReply(messages.ProfileReply(error=str(error)))
        return messages.WorkerReply(messages.ProfileReply(path=path))
    if isinstance(message, messages.RemoveLoRA):
        worker.remove_lora(message.lora_int_id)
        return messages.WorkerReply()
    raise TypeError(f"unexpected message {type(message).__name__}")


def serve(sock: socket.socket, rank: int, local_rank: int) -> int:
    messages.send_message(sock, messages.Hello(rank))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_forever, args=(sock, inbox), daemon=True).start()
    message = inbox.get()
    try:
        assert isinstance(message, messages.InitWorker), type(message)
        worker = Worker(message.config, rank, local_rank, message.distributed_init_method)
        worker.init_device()
        worker.load_model()
        messages.send_message(sock, messages.WorkerReply())
        while not isinstance(message := inbox.get(), messages.Shutdown):
            reply = _handle(worker, message)
            if reply is not None:
                messages.send_message(sock, reply)
    except Exception as error:
        logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            messages.send_message(sock, messages.WorkerFailure(rank, f"{type(error).__name__}: "
                                                                     f"{error}"))
        except OSError:
            pass
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve.executor.worker_process")
    parser.add_argument("--control", required=True, help="HOST:PORT of the engine")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank {args.rank} %(name)s: %(message)s")
    # SIGTERM (the executor stopping this worker) as an exception, so that `finally` blocks run:
    # torch's extension build holds a lock file that a plain kill would leave behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    host, port = args.control.rsplit(":", 1)
    sock = _connect(host, int(port), time.monotonic() + CONNECT_TIMEOUT_S)
    try:
        return serve(sock, args.rank, args.local_rank)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
