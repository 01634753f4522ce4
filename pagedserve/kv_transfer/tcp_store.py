"""A store one instance serves to others over TCP: the prefill side of P/D disaggregation.

The producer (the prefill instance) keeps its saved blocks in a size-bounded MemoryStore and
serves it on host:port; each consumer (a decode instance) reads it through TcpStore. So the KV
moves directly between the two instances, one block a request, with no third process.

Wire format, both ways little-endian and length-prefixed; keys are UTF-8, values raw bytes, a key
list is JSON. Nothing received is unpickled or evaluated, and a frame over _MAX_FRAME_BYTES closes
the connection.

    request:   u8 op | u32 length | body        op: CONTAINS (body: JSON list of keys)
                                                    GET      (body: key)
                                                    PUT      (body: u32 key length | key | value)
    response:  u8 status | u64 length | body    status: OK, MISSING (GET), ERROR (body: message)
                                                CONTAINS answers one byte (0/1) a key

The listener binds where the producer's kv_connector_extra_config says (127.0.0.1 by default) and
has no authentication: expose it only on a network the instances share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import struct
import threading
import time

from pagedserve.kv_transfer.store import KVStore, KVStoreError, MemoryStore

logger = logging.getLogger(__name__)

_REQUEST = struct.Struct("<BI")
_RESPONSE = struct.Struct("<BQ")
_KEY_LENGTH = struct.Struct("<I")
_MAX_FRAME_BYTES = 256 << 20
OP_CONTAINS, OP_GET, OP_PUT = 1, 2, 3
STATUS_OK, STATUS_MISSING, STATUS_ERROR = 0, 1, 2


def _read_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, remaining = [], num_bytes
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed mid-frame")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class _Handler(socketserver.BaseRequestHandler):
    """One connection: frames in, answers out, until the peer closes or sends garbage."""

    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.lock:
            self.server.connections.add(sock)
        try:
            while True:
                try:
                    header = _read_exactly(sock, _REQUEST.size)
                except ConnectionError:
                    return  # the peer closed between frames: the normal end
                op, length = _REQUEST.unpack(header)
                if length > _MAX_FRAME_BYTES:
                    return
                status, body = self._answer(op, _read_exactly(sock, length))
                sock.sendall(_RESPONSE.pack(status, len(body)) + body)
        except (OSError, ConnectionError):
            return
        finally:
            with self.server.lock:
                self.server.connections.discard(sock)

    def _answer(self, op: int, body: bytes) -> tuple[int, bytes]:
        store = self.server.store
        try:
            if op == OP_CONTAINS:
                keys = json.loads(body)
                if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                    return STATUS_ERROR, b"CONTAINS wants a JSON list of strings"
                return STATUS_OK, bytes(store.contains(keys))
            if op == OP_GET:
                value = store.get(body.decode())
                return (STATUS_MISSING, b"") if value is None else (STATUS_OK, value)
            if op == OP_PUT:
                (key_length,) = _KEY_LENGTH.unpack_from(body)
                key = body[_KEY_LENGTH.size : _KEY_LENGTH.size + key_length].decode()
                store.put(key, body[_KEY_LENGTH.size + key_length :])
                return STATUS_OK, b""
            return STATUS_ERROR, f"unknown op {op}".encode()
        except (ValueError, struct.error) as e:  # bad JSON, bad UTF-8, short body
            return STATUS_ERROR, f"bad request: {e}".encode()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    store: KVStore
    lock: threading.Lock
    connections: set[socket.socket]


class TcpStoreServer:
    """Serves `store` on host:port from a background thread until close()."""

    def __init__(self, store: KVStore, host: str, port: int) -> None:
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as e:
            raise ValueError(f"TcpConnector cannot listen on {host}:{port}: {e}") from None
        self._server.store = store
        self._server.lock = threading.Lock()
        self._server.connections = set()
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-tcp-server",
                                        daemon=True)
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        with self._server.lock:  # hang up on the consumers, as a dead process would
            for sock in self._server.connections:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)


class ServedMemoryStore(MemoryStore):
    """The producer's side: a MemoryStore that others read over TCP while this process writes."""

    name = "tcp"

    def __init__(self, host: str, port: int, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.server = TcpStoreServer(self, host, port)

    def close(self) -> None:
        self.server.close()


class TcpStore(KVStore):
    """The consumer's side: reads (and, for the start-up probe, writes) a producer's store.

    One connection per thread (the loader threads read in parallel). A failed call closes that
    connection and raises KVStoreError; for `retry_interval_s` after a failure every call fails at
    once, so a dead producer costs each request one quick miss, not a timeout.
    """

    name = "tcp"

    def __init__(self, host: str, port: int, timeout_s: float = 5.0,
                 connect_timeout_s: float = 1.0, retry_interval_s: float = 1.0) -> None:
        self.address = (host, int(port))
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_interval_s = retry_interval_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._failed_at = -float("inf")

    def _socket(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.create_connection(self.address, timeout=self.connect_timeout_s)
            sock.settimeout(self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def _drop_socket(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close()

    def _call(self, op: int, body: bytes) -> tuple[int, bytes]:
        if time.monotonic() - self._failed_at < self.retry_interval_s:
            raise KVStoreError(f"tcp store {self.address[0]}:{self.address[1]} failed recently")
        try:
            sock = self._socket()
            sock.sendall(_REQUEST.pack(op, len(body)) + body)
            status, length = _RESPONSE.unpack(_read_exactly(sock, _RESPONSE.size))
            if length > _MAX_FRAME_BYTES:
                raise ConnectionError(f"response of {length} bytes is over the limit")
            answer = _read_exactly(sock, length)
        except (OSError, ConnectionError) as e:
            self._drop_socket()
            self._failed_at = time.monotonic()
            raise KVStoreError(f"tcp store {self.address[0]}:{self.address[1]}: {e}") from None
        if status == STATUS_ERROR:
            raise KVStoreError(f"tcp store refused the call: {answer.decode(errors='replace')}")
        return status, answer

    def contains(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        _, answer = self._call(OP_CONTAINS, json.dumps(keys).encode())
        if len(answer) != len(keys):
            raise KVStoreError("tcp store answered CONTAINS with the wrong length")
        return [bool(b) for b in answer]

    def get(self, key: str) -> bytes | None:
        status, answer = self._call(OP_GET, key.encode())
        return None if status == STATUS_MISSING else answer

    def put(self, key: str, value: bytes) -> None:
        encoded = key.encode()
        self._call(OP_PUT, _KEY_LENGTH.pack(len(encoded)) + encoded + value)

    def close(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()
