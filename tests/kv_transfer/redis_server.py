"""A throwaway redis-server for tests: 127.0.0.1, a free port, no persistence.

`stop()` kills it like a crash (SIGKILL, by its own pid); `restart()` brings it back empty on the
same port, so a store made before keeps its URL. Use the context manager (or the fixture built on
it in the tests) so the process is killed even when a test fails.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.processes import free_port


class RedisServer:
    def __init__(self, maxmemory: str | None = None, policy: str = "allkeys-lru",
                 start_timeout_s: float = 20.0) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not on PATH (scripts/test.sh installs it with apt-get)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                     "--save", "", "--appendonly", "no", "--daemonize", "no"]
        if maxmemory is not None:
            self.args += ["--maxmemory", maxmemory, "--maxmemory-policy", policy]
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        assert self.proc is None, "already running"
        # Its log goes to a file, not a pipe nobody drains (a full pipe would block the server).
        log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        self._log = log
        client = redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=1,
                             retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:  # poll until it answers, or has died, or the deadline passes
                if self.proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n"
                                       f"{log.read().decode(errors='replace')[-3000:]}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer PING on {self.port} "
                                       f"within {self.start_timeout_s}s")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def stop(self) -> None:
        """Kill the server (SIGKILL, by pid) and wait for it: its data is gone."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._log.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
