"""Run a test body on several threads at once and re-raise what any of them raised."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(work: Callable[[int], None], num_threads: int) -> None:
    """work(t) on threads t = 0..num_threads-1, started together (a barrier); the first
    exception any thread raised is raised here."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def run(t: int) -> None:
        try:
            barrier.wait()
            work(t)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
