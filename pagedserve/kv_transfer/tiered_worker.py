"""The worker half of the KV tiers: copies blocks between this rank's KV tensors and the stores.

Loads run on a small thread pool while the engine goes on with other requests: each job fetches
its blocks in order (each from the first tier that has it), checks every payload
(kv_transfer/block_codec.py) and writes it into the blocks the scheduler reserved, stopping at the
first block that fails; `get_finished` then reports how many leading blocks each job got. No
other request can read those blocks meanwhile: they are reserved and not yet in the prefix index.

Saves are copied out of the KV tensors right after the step that completed them (so the blocks
may be freed the moment the step is over) and written to every tier by one writer thread; when
the writer falls behind by more than `max_pending_save_blocks`, new saves are dropped and counted
rather than let memory grow.

On CUDA, copies go through pinned host buffers on side streams: a save's download overlaps the
next step (the writer waits on its event), a load's upload runs on its loader thread's stream.
NOTE: written for CUDA but not yet run there (no GPU in this project's CI); the CPU path is the
tested one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time

import torch

from pagedserve.kv_transfer import block_codec
from pagedserve.kv_transfer.base import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorWorker,
    LoadJob,
    TierCounters,
)
from pagedserve.kv_transfer.store import KVStore, KVStoreError

logger = logging.getLogger(__name__)

_WAIT_FOR_LOAD_S = 0.005
"""With nothing else to run, how long a step waits for a load to finish (instead of spinning)."""


class TieredConnectorWorker(KVConnectorWorker):
    def __init__(self, stores: list[KVStore], num_load_threads: int,
                 max_pending_save_blocks: int, sync_saves: bool = False) -> None:
        """sync_saves: wait_for_save returns only once its blocks are written."""
        self.stores = stores
        self.sync_saves = sync_saves
        self._save_stream = None
        """CUDA: the side stream the saves download on."""
        self._thread_state = threading.local()
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.layout: block_codec.Layout = []
        self._loader = concurrent.futures.ThreadPoolExecutor(
            num_load_threads, thread_name_prefix="kv-load")
        self._loads: dict[str, concurrent.futures.Future[int]] = {}
        self._save_queue: queue.Queue = queue.Queue(maxsize=max_pending_save_blocks)
        self._counters: dict[str, TierCounters] = {}
        self._num_saves_dropped = 0
        self._lock = threading.Lock()
        """Guards the counters (loader threads, the writer and the step all add to them)."""
        self._writer = threading.Thread(target=self._write_forever, name="kv-save", daemon=True)
        self._writer.start()

    def register_kv_caches(self, kv_caches: list[tuple]) -> None:
        self.kv_caches = [tuple(layer) for layer in kv_caches]
        self.layout = [(str(t.dtype).removeprefix("torch."), [t.shape[0], *t.shape[2:]])
                       for layer in self.kv_caches for t in layer]

    def _count(self, tier: str) -> TierCounters:
        """Counters of `tier` (call with the lock held)."""
        return self._counters.setdefault(tier, TierCounters())

    # ---- loads ------------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for job in metadata.loads:
            self._loads[job.req_id] = self._loader.submit(self._load_job, job)

    def _load_job(self, job: LoadJob) -> int:
        """Load the job's blocks in order; returns how many leading blocks are in place."""
        for index, (block, first_tier) in enumerate(zip(job.blocks, job.tiers)):
            # The tier the lookup found first, then the later ones (it may have been evicted).
            if not any(self._load_block(block, self.stores[tier])
                       for tier in range(first_tier, len(self.stores))):
                return index
        return len(job.blocks)

    def _load_block(self, block: BlockTransfer, store: KVStore) -> bool:
        start = time.perf_counter()
        fault = None
        try:
            payload = store.get(block.key)
            if payload is None:
                fault = "missing"
            else:
                segments = block_codec.decode(payload, block.key, block.block_hash,
                                              block.token_ids, self.layout)
                self._write_block(block.block_id, segments)
        except KVStoreError as e:
            logger.debug("KV tier %s read failed: %s", store.name, e)
            fault = "io_error"
        except block_codec.BlockDecodeError as e:
            logger.warning("KV tier %s: block %s unusable (%s); recomputing it", store.name,
                           block.key, e)
            fault = e.kind
        with self._lock:
            counters = self._count(store.name)
            if fault is not None:
                counters.fault(fault)
                return False
            counters.blocks_loaded += 1
            counters.bytes_loaded += len(payload)
            counters.load_seconds += time.perf_counter() - start
        return True

    def _write_block(self, block_id: int, segments: list[memoryview]) -> None:
        tensors = [t for layer in self.kv_caches for t in layer]
        on_cuda = tensors[0].device.type == "cuda"
        stream = None
        if on_cuda:  # one upload stream per loader thread
            stream = getattr(self._thread_state, "stream", None)
            if stream is None:
                stream = self._thread_state.stream = torch.cuda.Stream(tensors[0].device)
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            for tensor, segment, (_, shape) in zip(tensors, segments, self.layout):
                source = torch.frombuffer(bytearray(segment), dtype=torch.uint8)
                if on_cuda:  # a pinned staging copy, so the upload is asynchronous
                    source = source.pin_memory()
                tensor[:, block_id].copy_(source.view(tensor.dtype).view(shape),
                                          non_blocking=on_cuda)
        if on_cuda:
            # Done before the load is reported: the compute stream reads the block only in a
            # later step, after the scheduler has heard.
            stream.synchronize()

    # ---- saves ------------------------------------------------------------------------------

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        if not metadata.saves:
            return
        tensors = [t for layer in self.kv_caches for t in layer]
        device = tensors[0].device
        index = torch.tensor([b.block_id for b in metadata.saves], device=device)
        # One gather per tensor, on the compute stream (the next step may overwrite the blocks):
        # (blocks, ...) rows, each one block's slice.
        gathered = [t.index_select(1, index).transpose(0, 1).contiguous() for t in tensors]
        copied = None
        if device.type == "cuda":
            # To pinned host buffers on a side stream: the step goes on while they download;
            # the writer waits for the event before reading them.
            stream = self._save_stream = self._save_stream or torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True).copy_(
                    g, non_blocking=True) for g in gathered]
                for g in gathered:
                    g.record_stream(stream)
                copied = torch.cuda.Event()
                copied.record(stream)
            gathered = host
        rows = [g.view(torch.uint8).view(len(metadata.saves), -1).numpy() for g in gathered]
        for i, block in enumerate(metadata.saves):
            try:
                self._save_queue.put_nowait((block, [r[i] for r in rows], copied))
            except queue.Full:
                with self._lock:
                    self._num_saves_dropped += 1
        if self.sync_saves:
            self.flush_saves()

    def _write_forever(self) -> None:
        while True:
            item = self._save_queue.get()
            try:
                if item is None:
                    return
                self._write_block_to_tiers(*item)
            except Exception:  # a bug must not stop every later save
                logger.exception("KV tier save failed")
            finally:
                self._save_queue.task_done()

    def _write_block_to_tiers(self, block: BlockTransfer, segments: list,
                              copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            copied.synchronize()  # the download to host memory is done
        payload = block_codec.encode(block.key, block.block_hash, block.token_ids,
                                     self.layout, [memoryview(s) for s in segments])
        for store in self.stores:
            start = time.perf_counter()
            try:
                store.put(block.key, payload)
            except KVStoreError as e:
                logger.debug("KV tier %s write failed: %s", store.name, e)
                with self._lock:
                    self._count(store.name).fault("io_error")
                continue
            with self._lock:
                counters = self._count(store.name)
                counters.blocks_saved += 1
                counters.bytes_saved += len(payload)
                counters.save_seconds += time.perf_counter() - start

    def flush_saves(self) -> None:
        """Block until every queued save is written (tests; restarts want their blocks there)."""
        self._save_queue.join()

    # ---- reports ----------------------------------------------------------------------------

    def get_finished(self, wait: bool) -> KVConnectorOutput:
        if wait and self._loads and not any(f.done() for f in self._loads.values()):
            concurrent.futures.wait(list(self._loads.values()), timeout=_WAIT_FOR_LOAD_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        output = KVConnectorOutput()
        for req_id, future in list(self._loads.items()):
            if future.done():
                del self._loads[req_id]
                output.finished_loads[req_id] = future.result()
        with self._lock:
            output.tiers, self._counters = self._counters, {}
            output.num_saves_dropped, self._num_saves_dropped = self._num_saves_dropped, 0
        return output

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._save_queue.put(None)  # after the saves still queued: they are written first
        self._writer.join(timeout=30)
        for store in self.stores:
            store.close()
        self.stores = []
