"""TcpStore against a ServedMemoryStore on a loopback port: the P/D transfer's wire."""

from __future__ import annotations

import socket
import struct

import pytest

from pagedserve.kv_transfer.store import KVStoreError
from pagedserve.kv_transfer.tcp_store import ServedMemoryStore, TcpStore
from tests.kv_transfer.threads import run_in_threads
from tests.processes import free_port


@pytest.fixture
def served():
    store = ServedMemoryStore("127.0.0.1", free_port(), max_bytes=1 << 20)
    yield store
    store.close()


def client_of(served: ServedMemoryStore, **options) -> TcpStore:
    host, port = served.server.address
    return TcpStore(host, port, **options)


def test_round_trip_contains_and_missing(served):
    client = client_of(served)
    try:
        served.put("a", b"\x00" * 1000 + b"end")  # the producer writes in its own process
        client.put("b", b"written by a client")
        assert client.contains(["a", "b", "c"]) == [True, True, False]
        assert client.get("a") == b"\x00" * 1000 + b"end"
        assert served.get("b") == b"written by a client"
        assert client.get("c") is None
        assert client.contains([]) == []
    finally:
        client.close()


def test_threads_read_in_parallel(served):
    client = client_of(served)
    for i in range(32):
        served.put(f"k{i}", bytes([i]) * (4096 + i))

    def work(t: int) -> None:
        for i in range(t, 32, 4):
            assert client.get(f"k{i}") == bytes([i]) * (4096 + i)

    try:
        run_in_threads(work, 4)
    finally:
        client.close()


def test_dead_server_is_a_fault_then_skipped_until_the_retry_interval(served):
    client = client_of(served, connect_timeout_s=0.5, retry_interval_s=3600)
    try:
        assert client.contains(["x"]) == [False]
        served.close()
        with pytest.raises(KVStoreError):
            client.get("x")  # the old connection is gone
        with pytest.raises(KVStoreError, match="failed recently"):
            client.contains(["x"])  # not tried again within the interval
    finally:
        client.close()


def test_garbage_gets_an_error_and_the_server_keeps_serving(served):
    host, port = served.server.address
    with socket.create_connection((host, port), timeout=5) as sock:
        body = b"not json"
        sock.sendall(struct.pack("<BI", 1, len(body)) + body)  # CONTAINS with a bad body
        status, length = struct.unpack("<BQ", sock.recv(9))
        assert status == 2 and b"bad request" in sock.recv(length)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(struct.pack("<BI", 2, 1 << 30))  # a frame over the limit: hung up on
        assert sock.recv(16) == b""
    client = client_of(served)
    try:
        served.put("k", b"v")
        assert client.get("k") == b"v"
    finally:
        client.close()


def test_port_in_use_is_a_clear_error(served):
    host, port = served.server.address
    with pytest.raises(ValueError, match="cannot listen"):
        ServedMemoryStore(host, port, max_bytes=1024)
