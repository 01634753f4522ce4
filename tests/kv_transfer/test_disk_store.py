"""DiskStore: round trip, byte-bounded LRU, restart survival, atomic writes, faults, threads."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest

from pagedserve.kv_transfer import disk_store
from pagedserve.kv_transfer.disk_store import DiskStore
from pagedserve.kv_transfer.store import KVStoreError
from tests.kv_transfer.threads import run_in_threads

KB = 1024


def value(tag: int, size: int = 10 * KB) -> bytes:
    return bytes([tag % 256]) * size


def all_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


def test_round_trip_and_contains(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=1 << 20)
    key = "model:abc/0:" + "f" * 180  # ':' and '/' are fine: the file name is a hash
    assert store.get(key) is None
    assert store.contains([key, "other"]) == [False, False]
    store.put(key, value(1))
    assert store.get(key) == value(1)
    assert store.contains([key, "other"]) == [True, False]
    store.put(key, value(2, 3 * KB))  # replaces, and the byte count follows
    assert store.get(key) == value(2, 3 * KB)
    assert store.num_bytes == 3 * KB
    [name] = all_files(tmp_path)
    assert name.split(os.sep)[0] == name.split(os.sep)[1][:2]  # sharded by a 2-hex prefix


def test_lru_eviction_by_bytes(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=30 * KB)
    for i in "abc":
        store.put(i, value(ord(i)))
    assert store.get("a") == value(ord("a"))  # a is now the most recent: b goes first
    store.put("d", value(ord("d")))
    assert store.contains(["a", "b", "c", "d"]) == [True, False, True, True]
    store.put("e", value(ord("e"), 20 * KB))  # needs two values' room: c and a go
    assert store.contains(["a", "b", "c", "d", "e"]) == [False, False, False, True, True]
    assert store.num_bytes == 30 * KB
    assert len(all_files(tmp_path)) == 2  # evicted files are deleted, not just forgotten


def test_oversized_value_is_not_stored_and_drops_the_old_one(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=10 * KB)
    store.put("k", value(1))
    store.put("k", value(2, 11 * KB))
    assert store.get("k") is None and store.num_bytes == 0 and all_files(tmp_path) == []


def test_restart_sees_old_values_in_old_lru_order(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=40 * KB)
    for i in "abcd":
        store.put(i, value(ord(i)))
    store.get("a")  # recency order now: b c d a
    store.close()

    store = DiskStore(str(tmp_path), max_bytes=40 * KB)
    assert store.contains(list("abcd")) == [True] * 4
    assert store.get("c") == value(ord("c"))  # order: b d a c
    assert store.num_bytes == 40 * KB
    store.put("e", value(ord("e")))
    store.put("f", value(ord("f")))
    assert store.contains(list("abcdef")) == [True, False, True, False, True, True]
    store.close()

    # A smaller bound at startup evicts the oldest at once: a, then c (order: a c e f).
    store = DiskStore(str(tmp_path), max_bytes=20 * KB)
    assert store.contains(list("acef")) == [False, False, True, True]
    assert len(all_files(tmp_path)) == 2


def test_crash_leftover_temp_files_are_cleaned_and_others_kept(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=1 << 20)
    store.put("k", value(1))
    [final] = all_files(tmp_path)
    shard = os.path.dirname(tmp_path / final)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: a writer that crashed

    def tmp_file(pid: int, age_s: float = 0.0) -> str:
        path = os.path.join(shard, f"{disk_store._TMP_PREFIX}{'0' * 64}-{pid}-x{age_s:.0f}")
        with open(path, "wb") as f:
            f.write(b"half a blo")
        if age_s:
            mtime = time.time() - age_s
            os.utime(path, (mtime, mtime))
        return os.path.relpath(path, tmp_path)

    tmp_file(dead.pid)
    tmp_file(os.getpid(), age_s=2 * disk_store._STALE_TMP_S)  # too old: its pid was reused
    in_flight = tmp_file(os.getpid())  # another instance in this process is writing it
    (tmp_path / "README").write_text("not ours")
    store.close()

    store = DiskStore(str(tmp_path), max_bytes=1 << 20)
    assert all_files(tmp_path) == sorted([final, in_flight, "README"])
    assert store.num_bytes == 10 * KB and store.get("k") == value(1)


def test_instances_on_one_directory_see_each_others_blocks(tmp_path):
    # Each half of the connector opens its own store on the same path.
    scheduler_half = DiskStore(str(tmp_path), max_bytes=20 * KB)
    worker_half = DiskStore(str(tmp_path), max_bytes=20 * KB)
    worker_half.put("a", value(1))
    assert scheduler_half.contains(["a", "b"]) == [True, False]
    assert scheduler_half.get("a") == value(1)  # read, and now counted here too
    assert scheduler_half.num_bytes == 10 * KB
    worker_half.put("b", value(2))
    worker_half.put("c", value(3))  # evicts a: the other instance's get is a miss, not an error
    assert scheduler_half.contains(["a", "b", "c"]) == [True, True, True]  # a: indexed, "probably"
    assert scheduler_half.get("a") is None
    assert scheduler_half.contains(["a"]) == [False] and scheduler_half.num_bytes == 0


def test_writes_leave_no_temp_files_and_truncated_files_read_as_is(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=1 << 20)
    for i in range(5):
        store.put(f"k{i}", value(i))
    files = all_files(tmp_path)
    assert len(files) == 5 and not any(os.path.basename(f).startswith(".tmp") for f in files)
    # A file truncated behind our back is returned as it is: the codec above rejects it.
    path = tmp_path / next(f for f in files if open(tmp_path / f, "rb").read() == value(3))
    os.truncate(path, 100)
    assert store.get("k3") == value(3, 100)


def test_file_deleted_behind_our_back_is_a_miss(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=1 << 20)
    store.put("k", value(1))
    os.unlink(tmp_path / all_files(tmp_path)[0])
    assert store.contains(["k"]) == [True]  # contains is only "probably"
    assert store.get("k") is None
    assert store.contains(["k"]) == [False] and store.num_bytes == 0


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO])
def test_write_fault_raises_kv_store_error(tmp_path, monkeypatch, code):
    store = DiskStore(str(tmp_path), max_bytes=1 << 20)
    store.put("old", value(1))

    monkeypatch.setattr(disk_store.os, "replace", _raise(code))
    with pytest.raises(KVStoreError, match=errno.errorcode[code]):
        store.put("new", value(2))
    with pytest.raises(KVStoreError):
        store.put("old", value(3))
    monkeypatch.undo()
    assert len(all_files(tmp_path)) == 1  # the temp files are gone
    assert store.contains(["old", "new"]) == [True, False]
    assert store.get("old") == value(1) and store.num_bytes == 10 * KB
    store.put("new", value(2))  # the fault cleared: works again
    assert store.get("new") == value(2)


def test_disk_full_while_writing(tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path), max_bytes=1 << 20)

    def fill_up(fd, *args, **kwargs):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store.os, "fdopen", fill_up)
    with pytest.raises(KVStoreError, match="disk full"):
        store.put("k", value(1))
    assert all_files(tmp_path) == [] and store.contains(["k"]) == [False]


def test_read_only_directory(tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path), max_bytes=1 << 20)
    store.put("k", value(1))
    for d, _, _ in os.walk(tmp_path):
        os.chmod(d, 0o555)
    try:
        probe = tmp_path / "probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            # root ignores mode bits: fail the write the way a read-only mount would
            monkeypatch.setattr(disk_store.tempfile, "mkstemp", _raise(errno.EROFS))
        except PermissionError:
            pass
        with pytest.raises(KVStoreError, match="read-only|permission denied"):
            store.put("k2", value(2))
        assert store.get("k") == value(1)  # reads still work
    finally:
        for d, _, _ in os.walk(tmp_path):
            os.chmod(d, 0o755)


def test_unusable_path_raises_kv_store_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(KVStoreError, match="cannot open"):
        DiskStore(str(tmp_path / "file" / "store"), max_bytes=1 << 20)
    # A shard path taken by a file: a real OSError (ENOTDIR / EEXIST) on put, as root too.
    store = DiskStore(str(tmp_path / "store"), max_bytes=1 << 20)
    name = disk_store._file_name("k")
    (tmp_path / "store" / name[:2]).write_bytes(b"")
    with pytest.raises(KVStoreError, match="cannot write"):
        store.put("k", value(1))
    with pytest.raises(KVStoreError, match="cannot read"):
        store.get("k")
    assert store.contains(["k"]) == [False]


def test_threads_put_and_get(tmp_path):
    store = DiskStore(str(tmp_path), max_bytes=200 * KB)  # room for 20 of the 64 values
    num_threads, num_keys = 4, 16

    def work(t: int) -> None:
        for round_ in range(3):
            for i in range(num_keys):
                key = f"t{t}-k{i}"
                store.put(key, value(t * num_keys + i))
                got = store.get(f"t{(t + 1) % num_threads}-k{i}")
                assert got is None or got == value(((t + 1) % num_threads) * num_keys + i)
                store.contains([key])

    run_in_threads(work, num_threads)
    # The index and the directory agree, and the bound held.
    assert store.num_bytes <= store.max_bytes
    assert len(all_files(tmp_path)) == store.num_bytes // (10 * KB) == len(store._index)
    restarted = DiskStore(str(tmp_path), max_bytes=200 * KB)
    assert restarted.num_bytes == store.num_bytes


def _raise(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail
