"""DiskStore: KV payloads as one file per key under a directory, size-bounded LRU.

Owns the directory layout, atomic writes and the in-memory LRU index, which is rebuilt from the
files at startup so a restarted server finds the previous run's blocks. Knows nothing about what
the bytes mean: a truncated or corrupt file is returned as it is and the codec above rejects it.

Layout: path/<h[:2]>/<h> with h = sha256(key) hex; a write goes through the temp file
path/<h[:2]>/.tmp-<h>-<pid>-<random>, renamed over the final name when complete.

Several instances may share a directory (each half of the connector opens its own store, maybe in
another process): contains and get look at the files, so each sees the others' blocks. The byte
bound is kept by each instance over the files it indexed at startup, wrote or read; with several
writers the directory can hold up to max_bytes per writer.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
import threading
import time
from collections import OrderedDict

from pagedserve.kv_transfer.store import KVStore, KVStoreError

_TMP_PREFIX = ".tmp-"
_NAME_LEN = 64  # sha256 hex digest
_STALE_TMP_S = 3600  # a temp file this old is a crash's leftover even if its pid is alive (reused)


class DiskStore(KVStore):
    """Thread-safe: puts from a writer thread, gets from loader threads, contains from the
    scheduler. File contents are read and written outside the lock; the lock covers the index
    and this instance's renames / unlinks, which must agree with it."""

    name = "disk"

    def __init__(self, path: str, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        # file name -> size in bytes, least recently used first.
        self._index: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        # Last stamp given to a file's mtime. Stamps are strictly increasing (the kernel's file
        # clock is coarse: writes a few ms apart can share an mtime), so the order survives a
        # restart exactly.
        self._last_stamp_ns = 0
        try:
            os.makedirs(self.path, exist_ok=True)
            self._load_index()
        except OSError as e:
            raise _store_error(f"cannot open {self.path}", e) from e
        with self._lock:
            self._evict_to(self.max_bytes)  # max_bytes may have shrunk since the last run

    def contains(self, keys: list[str]) -> list[bool]:
        names = [_file_name(key) for key in keys]
        with self._lock:
            indexed = [name in self._index for name in names]
        # Not indexed here: maybe written by another instance on this directory since we started.
        return [found or os.path.exists(self._file_path(name))
                for name, found in zip(names, indexed)]

    def get(self, key: str) -> bytes | None:
        name = _file_name(key)
        file_path = self._file_path(name)
        try:
            with open(file_path, "rb") as f:
                value = f.read()
        except FileNotFoundError:
            # Deleted behind our back. Re-check under the lock: a put may have just replaced it.
            with self._lock:
                if name in self._index and not os.path.exists(file_path):
                    self.num_bytes -= self._index.pop(name)
            return None
        except OSError as e:
            raise _store_error(f"cannot read {file_path}", e) from e
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            elif not os.path.exists(file_path):
                return value  # evicted by a put since the read: nothing left to track
            else:  # written by another instance: from now on ours to count and evict too
                self._index[name] = len(value)
                self.num_bytes += len(value)
            self._touch(file_path)
            self._evict_to(self.max_bytes)
        return value

    def put(self, key: str, value: bytes) -> None:
        name = _file_name(key)
        file_path = self._file_path(name)
        if len(value) > self.max_bytes:
            # Could never fit: not stored, and an older value under the key is dropped too.
            with self._lock:
                self._remove(name)
                _unlink_quietly(file_path)
            return
        tmp_path = self._write_tmp(name, value)  # the slow part, outside the lock
        try:
            with self._lock:
                os.replace(tmp_path, file_path)  # atomic: readers see the old file or the new
                old_size = self._index.pop(name, None)
                if old_size is not None:
                    self.num_bytes -= old_size
                self._index[name] = len(value)
                self.num_bytes += len(value)
                self._touch(file_path)
                self._evict_to(self.max_bytes)
        except OSError as e:
            _unlink_quietly(tmp_path)
            raise _store_error(f"cannot write {file_path}", e) from e

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self.num_bytes = 0

    # -- internals -----------------------------------------------------------------------------

    def _file_path(self, name: str) -> str:
        return os.path.join(self.path, name[:2], name)

    def _write_tmp(self, name: str, value: bytes) -> str:
        """Write value to a new temp file beside its final name; return its path. No fsync: a
        crash may lose recent blocks, which only costs a recompute."""
        shard = os.path.join(self.path, name[:2])
        tmp_path = None
        try:
            os.makedirs(shard, exist_ok=True)
            fd, tmp_path = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{name}-{os.getpid()}-",
                                            dir=shard)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            return tmp_path
        except OSError as e:
            if tmp_path is not None:
                _unlink_quietly(tmp_path)
            raise _store_error(f"cannot write to {shard}", e) from e

    def _touch(self, file_path: str) -> None:
        """Stamp the file's mtime with the next LRU stamp (caller holds the lock)."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        try:
            os.utime(file_path, ns=(self._last_stamp_ns, self._last_stamp_ns))
        except OSError:
            pass  # only the order after a restart suffers

    def _evict_to(self, num_bytes: int) -> None:
        """Delete least recently used files until at most num_bytes remain (caller holds the
        lock)."""
        while self._index and self.num_bytes > num_bytes:
            name = next(iter(self._index))
            self._remove(name)

    def _remove(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is not None:
            self.num_bytes -= size
            _unlink_quietly(self._file_path(name))

    def _load_index(self) -> None:
        """Index the files already here (oldest stamp first); delete crashed writers' temp files."""
        found: list[tuple[int, str, int]] = []  # (mtime_ns, name, size)
        for shard in os.scandir(self.path):
            if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                if entry.name.startswith(_TMP_PREFIX):
                    if _is_stale_tmp(entry):
                        _unlink_quietly(entry.path)
                elif len(entry.name) == _NAME_LEN and entry.name.startswith(shard.name):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # evicted by another instance while we scan
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        for mtime_ns, name, size in sorted(found):
            self._index[name] = size
            self.num_bytes += size
            self._last_stamp_ns = max(self._last_stamp_ns, mtime_ns)


def _file_name(key: str) -> str:
    # A hash, not the key itself: any key is a safe, fixed-length name, spread evenly over shards.
    return hashlib.sha256(key.encode()).hexdigest()


def _is_stale_tmp(entry: os.DirEntry) -> bool:
    """Whether a temp file was left by a crash mid-write (its writer is gone), rather than being
    written now by another instance on this directory."""
    try:
        pid = int(entry.name[len(_TMP_PREFIX) + _NAME_LEN + 1 :].split("-")[0])
        if pid <= 0 or time.time() - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
            return True
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    except (ValueError, OSError):
        return True  # not our name format, or vanished: nothing to protect
    return False


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone, or the disk went read-only: the index no longer counts it


def _store_error(what: str, e: OSError) -> KVStoreError:
    reason = {
        errno.ENOSPC: "disk full",
        errno.EDQUOT: "disk quota exceeded",
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
    }.get(e.errno, e.strerror or type(e).__name__)
    return KVStoreError(f"disk store: {what}: {reason} ({errno.errorcode.get(e.errno, e.errno)})")
