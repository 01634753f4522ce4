"""Data parallelism (`pagedserve serve -dp N`): N engine replicas behind one API server.

The front process starts N ordinary `pagedserve serve` processes on loopback ports (each its own
engine and KV pool), waits for their /health, then serves the user's host and port through the
request router (pagedserve/router), whose policy picks a replica for each request. It watches the
replicas (one that exits leaves the rotation; with none left the front exits 1) and stops them by
pid when it stops, fails or is signalled. It knows nothing of engines: a replica is a process and
a URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from pagedserve.distributed.cpu_binding import cpu_share, usable_cpus
from pagedserve.distributed.ports import unused_port

logger = logging.getLogger(__name__)

_FRONT_FLAGS = frozenset({"data_parallel_size", "dp_policy", "host", "port", "num_threads",
                          "api_key", "root_path", "allowed_origins", "allowed_methods",
                          "allowed_headers", "allow_credentials", "ssl_keyfile", "ssl_certfile",
                          "ssl_ca_certs", "ssl_cert_reqs"})
"""Flags the front owns (dests), or that only a client-facing server may take (the replicas
speak plain HTTP to the front); every other `serve` flag reaches each replica unchanged."""
_REPLICA_HOST = "127.0.0.1"
_POLL_INTERVAL_S = 0.2
"""How often the front looks at the replicas' processes (and, while starting, their /health)."""
_KILL_GRACE_S = 10.0
"""Added to --shutdown-timeout: a replica gets that long to drain and exit after SIGTERM."""


class ReplicaStartError(RuntimeError):
    """A replica exited before its /health answered 200."""


@dataclass(frozen=True)
class DataParallelConfig:
    data_parallel_size: int
    """Replicas (engine processes) behind the front."""
    policy: str = "cache_aware"
    """The router's policy: round_robin, least_load or cache_aware."""
    host: str = "127.0.0.1"
    port: int = 8000
    """Where the front serves the API; replicas listen on free loopback ports."""
    num_threads_per_rank: int = 1
    """--num-threads of every engine rank of every replica."""
    bind_cpus: bool = True
    """Pin replica i to the i-th share of the CPUs (--cpu-binding auto)."""
    shutdown_timeout: float = 30.0
    """Seconds running requests get to finish after SIGTERM (front and replicas alike)."""
    api_key: str | None = None
    """Checked by the front; the replicas, on loopback, need none."""

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.num_threads_per_rank < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads_per_rank}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> DataParallelConfig:
        if args.headless or args.nnodes > 1:
            raise ValueError("--data-parallel-size runs every replica on this machine; it does "
                             "not combine with --headless or --nnodes")
        num_threads = args.num_threads
        if num_threads is None:
            # Every rank of every replica gets an even share of the usable cores.
            num_ranks = (args.data_parallel_size * args.tensor_parallel_size
                         * args.pipeline_parallel_size)
            num_threads = max(1, len(usable_cpus()) // max(1, num_ranks))
        return cls(data_parallel_size=args.data_parallel_size, policy=args.dp_policy,
                   host=args.host, port=args.port, num_threads_per_rank=num_threads,
                   bind_cpus=args.cpu_binding == "auto", shutdown_timeout=args.shutdown_timeout,
                   api_key=args.api_key)


def replica_flags(args: argparse.Namespace) -> list[str]:
    """The `serve` flags of `args` that differ from their defaults, less those the front owns:
    rebuilt from the parsed values, so `--port=1` or abbreviated flags need no care."""
    from pagedserve.entrypoints.openai.server_config import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags: list[str] = []
    for action in parser._actions:
        if action.dest in _FRONT_FLAGS or action.dest == "help" or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if not action.option_strings:  # the positional MODEL: first (else --model carries it)
            if value is not None:
                flags.insert(0, str(value))
        elif value == action.default or value is None:
            continue
        elif isinstance(action, argparse.BooleanOptionalAction):
            long_flag = action.option_strings[0]
            flags.append(long_flag if value else "--no-" + long_flag.removeprefix("--"))
        elif action.nargs == 0:  # store_true: only a True differs from the default
            flags.append(action.option_strings[0])
        elif isinstance(value, dict):  # a JSON object flag
            flags += [action.option_strings[0], json.dumps(value)]
        elif isinstance(value, list):  # nargs="+": --lora-modules a=x b=y
            flags += [action.option_strings[0], *map(str, value)]
        else:
            flags += [action.option_strings[0], str(value)]
    return flags


def replica_command(flags: list[str], port: int, num_threads: int) -> list[str]:
    return [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", *flags,
            "--host", _REPLICA_HOST, "--port", str(port), "--num-threads", str(num_threads)]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


@dataclass
class Replica:
    label: str
    """"0" .. "N-1": the replica="..." label of its metrics."""
    url: str
    process: subprocess.Popen
    log_thread: threading.Thread

    @property
    def pid(self) -> int:
        return self.process.pid


class ReplicaGroup:
    """The replica processes: started, watched and stopped, always by their own pids.

    Each replica's stdout and stderr reach the front's stderr line by line, prefixed
    `[replica i] `, through one thread per replica.
    """

    def __init__(self, config: DataParallelConfig, flags: list[str]) -> None:
        self.config = config
        self.flags = flags
        self.replicas: list[Replica] = []
        self.alive: list[Replica] = []
        self._stderr_lock = threading.Lock()

    def start(self) -> None:
        # Log lines as they are written; the key is the front's to check (the replicas are on
        # loopback, and the router polls their /metrics without one).
        env = {**{k: v for k, v in os.environ.items() if k != "PAGEDSERVE_API_KEY"},
               "PYTHONUNBUFFERED": "1"}
        cpus = usable_cpus()
        for index in range(self.config.data_parallel_size):
            # another process may take the port before the replica binds it: that replica
            # then fails its start, and so does the front (exit 2), saying which replica
            port = unused_port(_REPLICA_HOST)
            command = replica_command(self.flags, port, self.config.num_threads_per_rank)
            # A session of its own: the terminal's Ctrl-C reaches the front only, which then
            # drains the replicas once (a second signal would cut a replica's drain short).
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
            log_thread = threading.Thread(target=self._forward_log, args=(process, index),
                                          name=f"replica-{index}-log", daemon=True)
            replica = Replica(str(index), f"http://{_REPLICA_HOST}:{port}", process, log_thread)
            self.replicas.append(replica)  # at once: stop() must know every pid
            self.alive.append(replica)
            log_thread.start()
            if self.config.bind_cpus:
                # The replica is still starting its interpreter: threads it starts later
                # inherit the mask.
                share = cpu_share(cpus, index, self.config.data_parallel_size)
                try:
                    os.sched_setaffinity(process.pid, share)
                except ProcessLookupError:
                    pass  # already gone: wait_until_healthy reports it
            logger.info("replica %s: pid %d, %s", replica.label, replica.pid, replica.url)

    def _forward_log(self, process: subprocess.Popen, index: int) -> None:
        prefix = f"[replica {index}] ".encode()
        for line in iter(process.stdout.readline, b""):
            with self._stderr_lock:
                sys.stderr.buffer.write(prefix + line)
                sys.stderr.buffer.flush()

    def wait_until_healthy(self) -> None:
        """Return when every replica's /health answers 200; raise ReplicaStartError as soon as
        one exits instead. No deadline: a large model may take long to load (Ctrl-C stops it)."""
        pending = list(self.alive)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for replica in list(pending):
                    if replica.process.poll() is not None:
                        raise ReplicaStartError(
                            f"replica {replica.label} (pid {replica.pid}) "
                            f"{describe_exit(replica.process.returncode)} while starting; its "
                            f"log is above, each line prefixed [replica {replica.label}]")
                    try:
                        if client.get(replica.url + "/health").status_code == 200:
                            pending.remove(replica)
                    except httpx.TransportError:
                        pass  # not listening yet
                if pending:
                    time.sleep(_POLL_INTERVAL_S)

    def reap_exited(self) -> list[Replica]:
        """The replicas that exited since the last call."""
        exited = [r for r in self.alive if r.process.poll() is not None]
        self.alive = [r for r in self.alive if r not in exited]
        return exited

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every live replica (each drains its requests), SIGKILL those still running
        after timeout_s, and reap them all. Idempotent."""
        running = [r for r in self.replicas if r.process.poll() is None]
        for replica in running:
            replica.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for replica in running:
            try:
                replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("replica %s (pid %d) did not exit %.0f s after SIGTERM: killing "
                               "it", replica.label, replica.pid, timeout_s)
                replica.process.kill()
                replica.process.wait()
        for replica in self.replicas:
            if replica.log_thread.is_alive():
                replica.log_thread.join(timeout=1.0)  # the replica's last lines
        self.alive = []


def run_data_parallel(args: argparse.Namespace) -> int:
    """`pagedserve serve -dp N`: start the replicas, serve the router until SIGTERM/SIGINT (or
    until every replica has exited), stop the replicas. Returns the exit code: 0 after a signal,
    1 when every replica exited by itself, 2 when one failed to start."""
    config = DataParallelConfig.from_cli_args(args)
    _check_can_listen(config.host, config.port)  # now, not after N models have loaded
    # Every proxied request would log an httpx line beside uvicorn's access line.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    group = ReplicaGroup(config, replica_flags(args))
    stop_timeout_s = config.shutdown_timeout + _KILL_GRACE_S
    # Until the router's server installs its own handlers, SIGTERM ends the front through the
    # `finally` below (Python's default would end it at once and leave the replicas running).
    previous_handler = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        group.start()
        try:
            group.wait_until_healthy()
        except ReplicaStartError as error:
            print(f"pagedserve serve: error: {error}", file=sys.stderr)
            return 2
        logger.info("%d replicas are healthy; serving on http://%s:%d (policy %s)",
                    config.data_parallel_size, config.host, config.port, config.policy)
        return asyncio.run(_serve(config, group, stop_timeout_s, args.log_level))
    finally:
        group.stop(stop_timeout_s)
        signal.signal(signal.SIGTERM, previous_handler)


def _check_can_listen(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()  # SO_REUSEADDR, as uvicorn
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


async def _serve(config: DataParallelConfig, group: ReplicaGroup, stop_timeout_s: float,
                 log_level: str) -> int:
    from pagedserve.router import Router, RouterConfig, serve_router

    router = Router(RouterConfig(policy=config.policy, worker_metrics_label="replica",
                                 shutdown_timeout_s=config.shutdown_timeout,
                                 api_key=config.api_key),
                    worker_urls=[r.url for r in group.replicas],
                    worker_labels=[r.label for r in group.replicas])
    every_replica_exited = False

    async def watch() -> None:
        nonlocal every_replica_exited
        while group.alive:
            await asyncio.sleep(_POLL_INTERVAL_S)
            for replica in group.reap_exited():
                # Its requests in flight end with an error when their connections drop.
                router.remove_worker(replica.url)
                logger.error("replica %s (pid %d) %s; %d of %d replicas left", replica.label,
                             replica.pid, describe_exit(replica.process.returncode),
                             len(group.alive), config.data_parallel_size)
        logger.error("every replica has exited: the front exits")
        every_replica_exited = True
        # The same path as `kill -TERM <front>`: the router's server stops as it does then.
        signal.raise_signal(signal.SIGTERM)

    async def on_shutdown() -> None:
        # The front serves no more requests: the replicas exit now because they are told to,
        # and the router's health checks must not report that as a failure.
        watcher.cancel()
        for replica in group.alive:
            router.remove_worker(replica.url)
        await asyncio.to_thread(group.stop, stop_timeout_s)

    watcher = asyncio.create_task(watch())
    try:
        await serve_router(router, config.host, config.port, on_shutdown=on_shutdown,
                           log_level=log_level)
    finally:
        watcher.cancel()
    return 1 if every_replica_exited else 0
