"""Shared-memory all-reduce for the ranks of one group on one machine (the CPU backend).

gloo's all-reduce between two single-core workers costs a median of 0.2-0.3 ms but a mean of
1-3 ms: its I/O thread competes for the core with the waiting main thread. Ranks on one node
can instead exchange through one shared-memory segment: every rank copies its tensor into its
slot, publishes a sequence number, waits for every member's number, then sums all slots in rank
order into its own tensor. Every rank computes the same sums from the same bytes in the same
order, so the results are bitwise identical on all ranks; fp32 is summed in fp32, bf16/fp16 are
accumulated in fp32 and rounded once.

Segment (one file under /dev/shm, mapped by every member; sizes in bytes):

    header       magic, layout version, world size, slot bytes, creator pid
    rank lines   one 64-byte line per rank, written only by that rank:
                 [0] seq: the last call whose data this rank has published
                 [1] pid of the rank once it has mapped the segment (0 before)
                 [2], [3] shape check of the call with seq parity 0 / 1 (nbytes << 8 | dtype)
    data         2 parities x world_size slots x slot bytes

Lifetime: rank 0 creates the file (replacing a stale one of the same name), every member maps
it and writes its pid into its line, and rank 0 unlinks the file as soon as every member's pid
is there, still inside the constructor. From then on the memory lives only in the mappings and
goes away with the last process, even if every rank crashes: no garbage accumulates under
/dev/shm. A crash during construction leaves at most one file per name, replaced by the next
creator of that name.

Nothing here pickles: tensors, an mmap and int64 header fields only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import time
from collections.abc import Callable

import torch

_MAGIC = 0x5041_4745_5348_4D31  # "PAGESHM1"
_LAYOUT_VERSION = 1
_LINE = 64  # bytes: one cache line per rank's header fields
_LINE_Q = _LINE // 8  # int64 fields per line
_DATA_ALIGN = 4096
_SLOT_ALIGN = 64

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

# Waiting: spin on the peers' sequence numbers (cheapest when every rank has its own core), then
# yield the core (several ranks per core: let the peer we wait for run), then sleep briefly
# (a peer descheduled for long, or gone: stop burning a core and check the timeout).
_SPINS = 64
_YIELD_S = 0.002
_SLEEP_S = 0.0001


# --- memory ordering --------------------------------------------------------------------------
#
# Publishing a call is "copy the data into my slot (torch), then store my sequence number (an
# aligned int64 store through a memoryview, one mov)"; a peer's reading it is "load the
# sequence numbers, then read the slots (torch)". Each step is a separate opaque C call made
# by the interpreter, so no compiler can move one's memory accesses across another's. On x86
# (TSO) ordinary stores become visible in program order and loads are not reordered with older
# loads, nor stores with older loads, so that alone would be enough -- except that the data
# copy may use non-temporal stores (glibc's memcpy switches to them above a size threshold,
# and vectorised kernels may too), which are weakly ordered: a later ordinary store (the
# sequence number) can become visible before them. So a full fence runs between the data copy
# and the sequence-number store (release), and another between seeing the peers' numbers and
# reading their slots (acquire; a no-op in effect on x86, needed on weaker machines). Python
# has no fence: locking and unlocking a private pthread mutex is one (its lock-prefixed
# read-modify-write is a full barrier, and Intel documents that locked instructions also drain
# write-combining buffers, i.e. order non-temporal stores), at well under a microsecond.


def _make_fence() -> tuple[Callable[[], None], object]:
    """(fence function, the mutex it locks, kept alive with it)."""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed == PTHREAD_MUTEX_INITIALIZER (glibc)
    lock, unlock = libc.pthread_mutex_lock, libc.pthread_mutex_unlock

    def fence() -> None:
        lock(mutex)
        unlock(mutex)

    return fence, mutex


_fence, _fence_keepalive = _make_fence()


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmAllReduce:
    """Sum tensors in place over the ranks of one group on one machine, through shared memory.

    group_ranks: the group's global ranks in group order (used in error messages only).
    rank_in_group: this process's index in group_ranks.
    name: identifies the segment; the same on every member, different for every group that is
        alive at the same time on the machine (e.g. derived from the run's init_method and the
        group's first rank). Characters outside [A-Za-z0-9._-] are replaced.
    max_bytes: the largest tensor all_reduce takes (nbytes); larger ones raise ValueError.
    barrier: optional; a barrier of the group (e.g. `lambda: dist.barrier(group=g)`). With it,
        members open the segment only after rank 0 has (re)created it, so a stale file of the
        same name left by a crash can never be opened, and if rank 0 fails to create it (a full
        /dev/shm: OSError there) the members raise RuntimeError at once. Without it, members
        poll for the file and skip one whose creator process is dead.
    timeout_s: how long construction and each all_reduce wait for the other members before
        raising RuntimeError naming those that did not arrive.
    directory: where the segment file is created (tmpfs).

    Every member must call all_reduce the same number of times with tensors of the same shape
    and dtype, as with any collective; a size or dtype mismatch raises RuntimeError. After a
    timeout or a mismatch the instance is unusable (RuntimeError). One thread per rank uses it.
    """

    def __init__(self, group_ranks: list[int], rank_in_group: int, name: str, max_bytes: int,
                 barrier: Callable[[], None] | None = None, timeout_s: float = 60.0,
                 directory: str = "/dev/shm") -> None:
        if not 0 <= rank_in_group < len(group_ranks):
            raise ValueError(f"{rank_in_group=} outside group {group_ranks}")
        if max_bytes <= 0:
            raise ValueError(f"{max_bytes=} must be positive")
        self.group_ranks = list(group_ranks)
        self.rank_in_group = rank_in_group
        self.world_size = len(group_ranks)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        safe_name = re.sub(r"[^A-Za-z0-9._-]", "_", name)
        self.path = os.path.join(directory, f"pagedserve-shm-allreduce-{safe_name}")

        n = self.world_size
        self._slot_bytes = _round_up(max_bytes, _SLOT_ALIGN)
        self._data_offset = _round_up(_LINE * (1 + n), _DATA_ALIGN)
        self._size = self._data_offset + 2 * n * self._slot_bytes
        self._seq = 0
        self._broken: str | None = None
        self._closed = False
        self._mm: mmap.mmap | None = None
        self._header: memoryview | None = None
        self._views: dict[tuple[torch.dtype, int], tuple] = {}
        self._acc: torch.Tensor | None = None

        # Header field indices (int64 units) of each rank's line.
        self._line = [_LINE_Q * (1 + r) for r in range(n)]
        self._seq_index = self._line[rank_in_group]
        self._peer_seq_index = [self._line[r] for r in range(n) if r != rank_in_group]
        self._peer_meta_index = [(r, self._line[r] + 2) for r in range(n) if r != rank_in_group]

        deadline = time.monotonic() + timeout_s
        unlinked = False
        try:
            if rank_in_group == 0:
                try:
                    self._create()
                except BaseException:
                    if barrier is not None:
                        barrier()  # let the members through: they find no segment and raise
                    raise
            if barrier is not None:
                barrier()
            if rank_in_group != 0:
                # After the barrier the segment is complete (rank 0 unlinks it only once this
                # rank has mapped it): one look suffices, and a miss means rank 0 failed.
                self._open(deadline, after_barrier=barrier is not None)
            header = self._header
            header[self._line[rank_in_group] + 1] = os.getpid()
            _fence()
            if rank_in_group == 0:
                # Unlink as soon as every member has mapped the segment: the mappings keep the
                # memory, and nothing is left behind however the processes end.
                self._wait_for(lambda r: header[self._line[r] + 1] != 0, deadline,
                               "map the shared-memory segment")
                os.unlink(self.path)
                unlinked = True
        except BaseException:
            if rank_in_group == 0 and not unlinked:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            self._release()
            raise

        data = torch.frombuffer(self._mm, dtype=torch.uint8, count=2 * n * self._slot_bytes,
                                offset=self._data_offset)
        self._slots = [[data[(p * n + r) * self._slot_bytes:][:self._slot_bytes]
                        for r in range(n)] for p in range(2)]

    # --- setup -------------------------------------------------------------------------------

    def _map(self, fd: int) -> None:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(fd, self._size, flags=flags,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._header = memoryview(self._mm)[:self._data_offset].cast("q")

    def _create(self) -> None:
        try:
            os.unlink(self.path)  # stale: left by a crash during an earlier construction
        except FileNotFoundError:
            pass
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocate now: a full tmpfs (e.g. a container's 64 MiB /dev/shm) raises OSError
            # here rather than SIGBUS at the first access of an unbacked page.
            os.posix_fallocate(fd, 0, self._size)
            self._map(fd)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        header = self._header
        header[1] = _LAYOUT_VERSION
        header[2] = self.world_size
        header[3] = self._slot_bytes
        header[4] = os.getpid()
        _fence()
        header[0] = _MAGIC  # last: a member that sees the magic sees the fields above

    def _open(self, deadline: float, after_barrier: bool) -> None:
        """Map the segment once it exists with the right size and a complete header. Without a
        barrier, poll, skipping a stale segment (its creator dead); after one, look once."""
        delay = 0.0005
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                fd = -1
            if fd >= 0:
                try:
                    ready = os.fstat(fd).st_size == self._size
                    if ready:
                        self._map(fd)
                finally:
                    os.close(fd)
                if ready:
                    header = self._header
                    if header[0] == _MAGIC:
                        _fence()
                        if not after_barrier and not _pid_alive(header[4]):
                            ready = False  # stale: its creator is gone; rank 0 will replace it
                        elif (header[1], header[2], header[3]) != (
                                _LAYOUT_VERSION, self.world_size, self._slot_bytes):
                            found = (header[1], header[2], header[3])
                            self._release()
                            raise ValueError(
                                f"{self.path}: (layout, world size, slot bytes) = {found}, "
                                f"expected {(_LAYOUT_VERSION, self.world_size, self._slot_bytes)}")
                        else:
                            return
                    else:
                        ready = False
                    self._release()
            if after_barrier:
                raise RuntimeError(
                    f"shm all-reduce: rank {self.group_ranks[self.rank_in_group]} found no "
                    f"complete {self.path} after the barrier: rank {self.group_ranks[0]} failed "
                    f"to create it")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"shm all-reduce: rank {self.group_ranks[self.rank_in_group]} timed out after "
                    f"{self.timeout_s} s waiting for rank {self.group_ranks[0]} to create "
                    f"{self.path}")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _release(self) -> None:
        self._views.clear()
        self._slots = []
        if self._header is not None:
            self._header.release()
            self._header = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a tensor view is still alive somewhere: the mapping goes with it
            self._mm = None

    def close(self) -> None:
        """Unmap the segment (the file itself was unlinked during construction)."""
        if self._closed:
            return
        self._closed = True
        self._acc = None
        self._release()

    def __enter__(self) -> ShmAllReduce:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the collective ----------------------------------------------------------------------

    def supports(self, x: torch.Tensor) -> bool:
        """Whether all_reduce takes x (else the caller uses another collective). Depends only
        on x's device, dtype, layout and size, so all members decide the same way."""
        return (x.device.type == "cpu" and x.dtype in _DTYPE_CODES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place; returns x. x: a contiguous CPU tensor of fp32, bf16
        or fp16 of at most max_bytes (ValueError otherwise). The sum is taken in rank order
        (fp32 accumulation, one rounding for bf16/fp16) and is bitwise the same on all ranks."""
        if not self.supports(x):
            raise ValueError(
                f"shm all-reduce takes contiguous CPU fp32/bf16/fp16 tensors of at most "
                f"{self.max_bytes} bytes, got {x.dtype} {tuple(x.shape)} on {x.device} "
                f"(contiguous: {x.is_contiguous()})")
        if self._closed or self._broken:
            raise RuntimeError(f"shm all-reduce unusable: {self._broken or 'closed'}")
        if self.world_size == 1:
            return x
        dtype, numel = x.dtype, x.numel()
        seq = self._seq + 1
        parity = seq & 1
        views = self._views.get((dtype, numel))
        if views is None:
            views = self._make_views(dtype, numel)
        slots = views[parity]
        flat = x.view(-1)
        header = self._header

        # Double buffering: call seq uses the slots of parity seq % 2. A rank writes parity p
        # again only at call seq + 2, which it starts after finishing call seq + 1, i.e. after
        # seeing every member's number >= seq + 1. A member publishes seq + 1 only after it has
        # finished reading call seq's slots (program order: x86 never lets a store pass earlier
        # loads, and the release fence before that store, in its call seq + 1, keeps them
        # ordered anywhere), so nobody still reads parity p when it is overwritten.
        # One parity is not enough: a fast rank could write call seq + 1 into a slot that a slow
        # rank is still summing for call seq. The per-parity shape check fields follow the same
        # rule.
        slots[self.rank_in_group].copy_(flat)
        meta = (numel * x.element_size()) << 8 | _DTYPE_CODES[dtype]
        header[self._seq_index + 2 + parity] = meta
        _fence()  # release: the data (maybe non-temporal stores) before the sequence number
        header[self._seq_index] = seq
        self._wait(seq)
        _fence()  # acquire: the peers' numbers before their data

        for r, index in self._peer_meta_index:
            if header[index + parity] != meta:
                other = header[index + parity]
                self._broken = (
                    f"call {seq}: rank {self.group_ranks[r]} reduced {other >> 8} bytes of "
                    f"{_CODE_DTYPES.get(other & 0xFF)}, rank "
                    f"{self.group_ranks[self.rank_in_group]} {numel * x.element_size()} bytes "
                    f"of {dtype}")
                raise RuntimeError(f"shm all-reduce: mismatched tensors: {self._broken}")

        if dtype == torch.float32:
            torch.add(slots[0], slots[1], out=flat)
            for slot in slots[2:]:
                flat.add_(slot)
        else:
            acc = views[2]
            acc.copy_(slots[0])
            for slot in slots[1:]:
                acc.add_(slot)  # fp32 += bf16/fp16: the operand is widened exactly
            flat.copy_(acc)  # one rounding (to nearest even)
        self._seq = seq
        return x

    def _make_views(self, dtype: torch.dtype, numel: int) -> tuple:
        if len(self._views) >= 256:
            self._views.clear()
        per_parity = [[slot.view(dtype)[:numel] for slot in self._slots[p]] for p in range(2)]
        acc = None
        if dtype != torch.float32:
            if self._acc is None:
                self._acc = torch.empty(self.max_bytes // 2, dtype=torch.float32)
            acc = self._acc[:numel]
        views = (per_parity[0], per_parity[1], acc)
        self._views[(dtype, numel)] = views
        return views

    def _wait(self, seq: int) -> None:
        header = self._header
        pending = [i for i in self._peer_seq_index if header[i] < seq]
        if not pending:
            return
        spins = 0
        start = 0.0
        while True:
            pending = [i for i in pending if header[i] < seq]
            if not pending:
                return
            spins += 1
            if spins <= _SPINS:
                continue
            now = time.monotonic()
            if spins == _SPINS + 1:
                start = now
            waited = now - start
            if waited < _YIELD_S:
                os.sched_yield()
            elif waited < self.timeout_s:
                time.sleep(_SLEEP_S)
            else:
                missing = [self.group_ranks[self._line.index(i)] for i in pending]
                self._broken = (f"call {seq} timed out after {self.timeout_s} s waiting for "
                                f"ranks {missing} of group {self.group_ranks}")
                raise RuntimeError(f"shm all-reduce: {self._broken}")

    def _wait_for(self, arrived: Callable[[int], bool], deadline: float, what: str) -> None:
        delay = 0.0002
        while True:
            missing = [r for r in range(self.world_size) if not arrived(r)]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"shm all-reduce: ranks {[self.group_ranks[r] for r in missing]} of group "
                    f"{self.group_ranks} did not {what} within {self.timeout_s} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
