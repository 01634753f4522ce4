"""A free TCP port for a listener this process is about to start (a torch.distributed
rendezvous, a data-parallel replica, the collectives benchmark's workers). Torch-free."""

from __future__ import annotations

import socket


def unused_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now (bind to port 0). Another process may take it
    before the caller's listener binds it: that listener then fails its start, and its caller
    says so (a rendezvous or a replica that cannot bind does not start)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
