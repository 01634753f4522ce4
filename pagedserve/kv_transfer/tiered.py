"""The scheduler half of the KV tiers: host memory, local disk and Redis, searched in order.

A tier is a store (kv_transfer/store.py) of whole blocks, each named by a key that carries the
model's identity, the KV layout (dtype, block size) and the block's chained hash (which carries
the cache salt and every token before it), so one store can serve many models and tenants without
mixing them. Every full block of final tokens is saved as soon as a step completes it (write
through), so an evicted, preempted or restarted prefix is in the tiers when it is asked for again.

On admission, past the device pool's prefix hit, the connector looks the next blocks up in each
tier in turn and keeps the longest run found; the cost model then says load or recompute.

  DiskConnector         {"path": dir, "max_bytes": size}    one file per block, LRU
  RedisConnector        {"url": "redis://host:port/db"}     a pool shared by instances
  HostOffloadConnector  {"max_bytes": size}                 CUDA devices only (host memory)
  TcpConnector          {"host": h, "port": p, "max_bytes": size}
                                                            P/D: the producer serves its saved
                                                            blocks on host:port, consumers read them
  MultiConnector        {"connectors": [{"kv_connector": ..., "kv_connector_extra_config": ...},
                         ...]}                              the above, searched in order

Common extra keys (on MultiConnector: at its top level): "load_policy" ("cost" | "always" |
"never"), "num_load_threads", "max_pending_save_blocks", "sync_saves" (a step returns only once
its blocks are written: durable, slower), "debug_load_delay_s" (slows every load: the hook the
cost-model and abort tests use) and "debug_fail_loads" (every load fails: the fallback tests).
RedisConnector and TcpConnector also take "connect_timeout_s", "timeout_s" and "retry_interval_s"
(how long a failed server is skipped before it is tried again); RedisConnector "ttl_s".

Prefill/decode disaggregation is the two one-sided roles. A kv_producer (the prefill instance)
saves, besides every full block, each prompt's last partial block (under a hash of its tokens and
the chain before them), and its steps return only once their blocks are written (sync_saves on by
default), so a prefill's response never overtakes its KV. A kv_consumer (the decode instance)
looks that tail up too and loads all of the prompt but its last token, which it computes for the
logits; its load_policy defaults to "always". A failed or missing block is recomputed, as for any
tier, and counted.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.config import EngineConfig, KVTransferConfig, parse_size
from pagedserve.core.block_hash import (
    extend_block_hashes,
    extra_keys_for_block,
    hash_block_tokens,
)
from pagedserve.kv_transfer.base import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVTierStats,
    LoadJob,
    TierCounters,
)
from pagedserve.kv_transfer.cost_model import CostModel, PrefillProfile, TierCost
from pagedserve.kv_transfer.store import KVStore, KVStoreError, MemoryStore
from pagedserve.request import Request

logger = logging.getLogger(__name__)

TIER_CONNECTORS = ("DiskConnector", "RedisConnector", "HostOffloadConnector", "TcpConnector")
CONNECTORS = (*TIER_CONNECTORS, "MultiConnector")
LOAD_POLICIES = ("cost", "always", "never")
_COMMON_KEYS = {"load_policy", "num_load_threads", "max_pending_save_blocks", "sync_saves",
                "debug_load_delay_s", "debug_fail_loads"}
_CLIENT_OPTIONS = ("connect_timeout_s", "timeout_s", "retry_interval_s")
_REDIS_OPTIONS = ("ttl_s", *_CLIENT_OPTIONS)
_TIER_KEYS = {"DiskConnector": {"path", "max_bytes"},
              "RedisConnector": {"url", *_REDIS_OPTIONS},
              "HostOffloadConnector": {"max_bytes"},
              "TcpConnector": {"host", "port", "max_bytes", *_CLIENT_OPTIONS}}
DEFAULT_TCP_HOST = "127.0.0.1"
DEFAULT_DISK_PATH = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "kv")


@dataclass(frozen=True)
class TierSpec:
    connector: str
    options: dict


@dataclass(frozen=True)
class TieredOptions:
    tiers: tuple[TierSpec, ...]
    load_policy: str = "cost"
    num_load_threads: int = 4
    max_pending_save_blocks: int = 4096
    sync_saves: bool = False
    debug_load_delay_s: float = 0.0
    debug_fail_loads: bool = False


def parse_tiers(config: KVTransferConfig, device: str) -> TieredOptions:
    """The tiers and options of a kv_transfer_config; ValueError names what is wrong."""
    extra = dict(config.kv_connector_extra_config)
    if config.kv_connector == "MultiConnector":
        entries = extra.pop("connectors", None)
        if not isinstance(entries, list) or not entries:
            raise ValueError("MultiConnector needs kv_connector_extra_config.connectors: a list "
                             "of {\"kv_connector\": ..., \"kv_connector_extra_config\": ...}")
    elif config.kv_connector in TIER_CONNECTORS:
        entries = [{"kv_connector": config.kv_connector,
                    "kv_connector_extra_config": {k: v for k, v in extra.items()
                                                  if k not in _COMMON_KEYS}}]
        extra = {k: v for k, v in extra.items() if k in _COMMON_KEYS}
    else:
        raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: "
                         f"{', '.join(CONNECTORS)}")
    unknown = sorted(set(extra) - _COMMON_KEYS)
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config keys {unknown} for "
                         f"{config.kv_connector}")
    tiers = []
    for entry in entries:
        name = entry.get("kv_connector") if isinstance(entry, dict) else None
        options = entry.get("kv_connector_extra_config", {}) if isinstance(entry, dict) else None
        if name not in TIER_CONNECTORS or not isinstance(options, dict):
            raise ValueError(f"each MultiConnector entry needs a kv_connector among "
                             f"{', '.join(TIER_CONNECTORS)} and an object of options, got {entry!r}")
        unknown = sorted(set(options) - _TIER_KEYS[name])
        if unknown:
            raise ValueError(f"unknown {name} options {unknown}; known: {sorted(_TIER_KEYS[name])}")
        if name == "RedisConnector" and "url" not in options:
            raise ValueError("RedisConnector needs kv_connector_extra_config.url "
                             "(e.g. redis://127.0.0.1:6379/0)")
        if name == "TcpConnector":
            if config.kv_role == "kv_both":
                raise ValueError("TcpConnector joins a prefill and a decode instance: give the "
                                 "prefill kv_role kv_producer and the decode kv_role kv_consumer")
            if "port" not in options:
                raise ValueError("TcpConnector needs kv_connector_extra_config.port (where the "
                                 "producer listens and the consumer connects)")
        if name == "HostOffloadConnector" and not device.startswith("cuda"):
            raise ValueError("HostOffloadConnector is offered on CUDA devices only: on the CPU the "
                             "KV pool is host memory already (use DiskConnector or RedisConnector)")
        tiers.append(TierSpec(name, dict(options)))
    # The ends of P/D: a decode instance always takes the prefill's KV; a prefill's response
    # must not overtake its KV (the decode instance would look it up too early).
    policy = extra.get("load_policy", "always" if config.kv_role == "kv_consumer" else "cost")
    if policy not in LOAD_POLICIES:
        raise ValueError(f"load_policy must be one of {', '.join(LOAD_POLICIES)}, got {policy!r}")
    options = TieredOptions(
        tuple(tiers), policy, int(extra.get("num_load_threads", 4)),
        int(extra.get("max_pending_save_blocks", 4096)),
        bool(extra.get("sync_saves", config.kv_role == "kv_producer")),
        float(extra.get("debug_load_delay_s", 0.0)), bool(extra.get("debug_fail_loads", False)))
    if options.num_load_threads < 1 or options.max_pending_save_blocks < 1:
        raise ValueError("num_load_threads and max_pending_save_blocks must be >= 1")
    if options.debug_load_delay_s < 0:
        raise ValueError("debug_load_delay_s must be >= 0")
    return options


class _DebugStore(KVStore):
    """A store whose reads take `delay_s` longer, or fail: a slow or broken tier in tests."""

    def __init__(self, inner: KVStore, delay_s: float, fail: bool) -> None:
        self.inner, self.delay_s, self.fail, self.name = inner, delay_s, fail, inner.name

    def contains(self, keys: list[str]) -> list[bool]:
        return self.inner.contains(keys)

    def get(self, key: str) -> bytes | None:
        time.sleep(self.delay_s)
        if self.fail:
            raise KVStoreError("debug_fail_loads: injected failure")
        return self.inner.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.inner.put(key, value)

    def close(self) -> None:
        self.inner.close()


_host_stores: dict[tuple[int, str], MemoryStore] = {}
"""In-process tiers (host memory, a TCP producer's buffer) by the id of their engine's config
and the connector: the scheduler half and the worker half of one engine share the one store
(they run in the same process); the worker half closes it."""
_host_stores_lock = threading.Lock()


def open_stores(config: EngineConfig, options: TieredOptions) -> list[KVStore]:
    """The tiers' stores, in search order (each half of the connector opens its own)."""
    stores: list[KVStore] = []
    for spec in options.tiers:
        if spec.connector == "DiskConnector":
            from pagedserve.kv_transfer.disk_store import DiskStore

            store: KVStore = DiskStore(spec.options.get("path", DEFAULT_DISK_PATH),
                                       parse_size(spec.options.get("max_bytes", "10GiB")))
        elif spec.connector == "RedisConnector":
            from pagedserve.kv_transfer.redis_store import RedisStore

            store = RedisStore(spec.options["url"], **{
                name: spec.options[name] for name in _REDIS_OPTIONS if name in spec.options})
        elif spec.connector == "TcpConnector" and config.kv_transfer.is_consumer:
            from pagedserve.kv_transfer.tcp_store import TcpStore

            store = TcpStore(spec.options.get("host", DEFAULT_TCP_HOST), int(spec.options["port"]),
                             **{name: float(spec.options[name]) for name in _CLIENT_OPTIONS
                                if name in spec.options})
        else:
            store = _shared_store(config, spec)
        if options.debug_load_delay_s or options.debug_fail_loads:
            store = _DebugStore(store, options.debug_load_delay_s, options.debug_fail_loads)
        stores.append(store)
    return stores


def _shared_store(config: EngineConfig, spec: TierSpec) -> MemoryStore:
    """The host tier, or the TCP producer's served buffer: one per engine."""
    key = (id(config.kv_transfer), spec.connector)
    with _host_stores_lock:
        store = _host_stores.get(key)
        if store is None:
            if spec.connector == "TcpConnector":
                from pagedserve.kv_transfer.tcp_store import ServedMemoryStore

                store = ServedMemoryStore(spec.options.get("host", DEFAULT_TCP_HOST),
                                          int(spec.options["port"]),
                                          parse_size(spec.options.get("max_bytes", "2GiB")))
            else:
                store = MemoryStore(parse_size(spec.options.get("max_bytes", "4GiB")))
            _host_stores[key] = store
        return store


def model_identity(config: EngineConfig) -> str:
    """A short digest that changes when the weights or the KV they produce would: the model's
    shape, its file's size and first MiB (or an HF directory's config and weight sizes), the
    compute dtype and the KV cache dtype and block size."""
    digest = hashlib.sha256()
    path = config.model_path
    files = ([os.path.join(path, name) for name in sorted(os.listdir(path))]
             if os.path.isdir(path) else [path])
    for file in files:
        if os.path.isfile(file):
            digest.update(f"{os.path.basename(file)}:{os.path.getsize(file)}".encode())
            if file.endswith((".gguf", ".json")) or len(files) == 1:
                with open(file, "rb") as f:
                    digest.update(f.read(1 << 20))
    model = config.model
    digest.update(json.dumps([model.architecture, model.num_hidden_layers, model.hidden_size,
                              model.num_key_value_heads, model.head_dim, model.vocab_size,
                              config.device.dtype, config.cache.cache_dtype,
                              config.cache.block_size]).encode())
    return digest.hexdigest()[:16]


@dataclass
class _Lookup:
    asked: tuple[int, int]
    """(tokens computed in the pool, tokens of the request) when looked up."""
    first: int = 0
    """The first block past the pool's hit."""
    blocks: list[BlockTransfer] = field(default_factory=list)
    """The blocks to load (empty: none found, or the cost model said recompute)."""
    tiers: list[int] = field(default_factory=list)
    num_tokens: int = 0
    """Tokens the blocks hold for the request: whole blocks, except a P/D consumer's last block,
    of which it takes all but the prompt's last token."""


def tail_block(request: Request, block_size: int) -> tuple[int, bytes] | None:
    """The prompt's last block when it is partial, as (index, hash): the hash chains on the full
    blocks before it, as theirs do, and covers the partial block's tokens (None: the prompt
    ends on a block boundary, or the request has outputs already)."""
    index, num_tail = divmod(request.num_prompt_tokens, block_size)
    if num_tail == 0 or request.num_tokens != request.num_prompt_tokens:
        return None
    extend_block_hashes(request.block_hashes, request.all_token_ids, block_size,
                        request.cache_namespace)
    parent = request.block_hashes[index - 1] if index else None
    tokens = request.all_token_ids[index * block_size : request.num_prompt_tokens]
    return index, hash_block_tokens(parent, tokens,
                                    ("tail", *extra_keys_for_block(index, request.cache_namespace)))


class TieredConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig, options: TieredOptions,
                 prefill: PrefillProfile | None, bytes_per_block: int) -> None:
        """options: parse_tiers(config.kv_transfer); prefill: the measured prefill cost (None:
        the load policy is not "cost")."""
        self.options = options
        self.transfer_config = config.kv_transfer
        self.block_size = config.cache.block_size
        self.stores = open_stores(config, options)
        self.tier_names = [store.name for store in self.stores]
        self._load_tiers: dict[str, list[str]] = {}
        """Request id -> the tier of each block its load in flight reads."""
        self.key_prefix = f"pskv1:{model_identity(config)}"
        self.stats = KVTierStats(tiers={name: TierCounters() for name in self.tier_names})
        tier_costs = [TierCost(self._probe_seconds_per_block(store, bytes_per_block),
                               self.options.num_load_threads) for store in self.stores]
        self.cost_model = CostModel(prefill or PrefillProfile(0.0, 0.0), tier_costs,
                                    self.options.load_policy)
        self._lookups: dict[str, _Lookup] = {}
        """req_id -> its last lookup. A request the pool cannot admit yet is looked up again at
        every schedule(): the answer is reused, so the stores are asked (and the lookup and
        decision counted) once per admission."""
        self._pending_loads: list[LoadJob] = []
        self._num_saved_blocks: dict[str, int] = {}
        """req_id -> leading blocks that are in a tier or queued to be saved."""
        role = config.kv_transfer.kv_role
        self.save_tails = role == "kv_producer"
        self.load_tails = role == "kv_consumer"
        """P/D: the prefill saves each prompt's partial last block, the decode loads it."""
        self._tails_saved: set[str] = set()

    def key(self, block_hash: bytes) -> str:
        return f"{self.key_prefix}:{block_hash.hex()}"

    def tail_key(self, tail_hash: bytes) -> str:
        return f"{self.key_prefix}:tail:{tail_hash.hex()}"

    def _probe_seconds_per_block(self, store: KVStore, bytes_per_block: int) -> float:
        """Time reads of a block-sized value from the store: the median of 3, or of those made
        in the first 0.2 s (a slow tier need not slow start-up much)."""
        key = f"{self.key_prefix}:probe"
        try:
            store.put(key, os.urandom(bytes_per_block))
            timings, deadline = [], time.perf_counter() + 0.2
            while len(timings) < 3 and (not timings or time.perf_counter() < deadline):
                start = time.perf_counter()
                store.get(key)
                timings.append(time.perf_counter() - start)
            return statistics.median(timings)
        except KVStoreError as e:
            logger.warning("KV tier %s did not answer its probe (%s); assuming 10 ms a block "
                           "until a load is measured", store.name, e)
            return 0.01

    # ---- admission ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        lookup = self._lookups.get(request.request_id)
        if lookup is None or lookup.asked != (num_computed_tokens, request.num_tokens):
            lookup = self._lookup(request, num_computed_tokens)
            self._lookups[request.request_id] = lookup
        return lookup.num_tokens

    def _lookup(self, request: Request, num_computed_tokens: int) -> _Lookup:
        """Which blocks past the pool's hit the tiers have, and whether to load them."""
        lookup = _Lookup((num_computed_tokens, request.num_tokens))
        bs = self.block_size
        extend_block_hashes(request.block_hashes, request.all_token_ids, bs,
                            request.cache_namespace)
        first = num_computed_tokens // bs
        # As for the device pool: the last token is always computed (its logits are needed).
        hashes = request.block_hashes[first : (request.num_tokens - 1) // bs]
        self._num_saved_blocks[request.request_id] = first
        if not self.transfer_config.is_consumer or (not hashes and not self.load_tails):
            return lookup
        keys = [self.key(h) for h in hashes]
        tier_of_block = [-1] * len(keys)
        for tier, store in enumerate(self.stores):
            todo = [i for i, t in enumerate(tier_of_block) if t < 0]
            if not todo:
                break
            try:
                present = store.contains([keys[i] for i in todo])
            except KVStoreError as e:
                logger.debug("KV tier %s lookup failed: %s", store.name, e)
                self.stats.tiers[store.name].fault("io_error")
                continue
            for i, found in zip(todo, present):
                if found:
                    tier_of_block[i] = tier
        num_found = next((i for i, t in enumerate(tier_of_block) if t < 0), len(keys))
        self.stats.lookup_tokens += len(keys) * bs
        tail = self._find_tail(request) if num_found == len(keys) and self.load_tails else None
        if num_found == 0 and tail is None:
            return lookup
        tiers = tier_of_block[:num_found]
        for tier in tiers:
            name = self.tier_names[tier]
            self.stats.hit_tokens[name] = self.stats.hit_tokens.get(name, 0) + bs
        # Found in a tier: no need to save these again, whether loaded or recomputed.
        self._num_saved_blocks[request.request_id] = first + num_found
        if tail is None and not self.cost_model.should_load(tiers, num_computed_tokens, bs):
            self.stats.decisions["recompute"] += 1
            return lookup
        self.stats.decisions["load"] += 1
        blocks = []
        for i in range(num_found):
            index = first + i
            blocks.append(BlockTransfer(-1, keys[i], hashes[i],
                                        request.all_token_ids[index * bs : (index + 1) * bs]))
        lookup.num_tokens = num_found * bs
        if tail is not None:
            blocks.append(tail[0])
            tiers.append(tail[1])
            # All of the prompt but its last token, which the decode computes for the logits.
            lookup.num_tokens += (request.num_tokens - 1) % bs
        lookup.first, lookup.blocks, lookup.tiers = first, blocks, tiers
        return lookup

    def _find_tail(self, request: Request) -> tuple[BlockTransfer, int] | None:
        """P/D consumer: the prompt's last block (the one with its last token) and the first tier
        that has it, when it holds tokens before the last one; else None."""
        bs = self.block_size
        index = (request.num_tokens - 1) // bs
        if request.num_tokens != request.num_prompt_tokens or (request.num_tokens - 1) % bs == 0:
            return None
        tail = tail_block(request, bs)
        if tail is None:  # the prompt ends on a boundary: its last block is a full one
            block_hash = request.block_hashes[index]
            key = self.key(block_hash)
        else:
            block_hash = tail[1]
            key = self.tail_key(block_hash)
        for tier, store in enumerate(self.stores):
            try:
                if store.contains([key])[0]:
                    return BlockTransfer(-1, key, block_hash,
                                         request.all_token_ids[index * bs : (index + 1) * bs]), tier
            except KVStoreError as e:
                logger.debug("KV tier %s lookup failed: %s", store.name, e)
                self.stats.tiers[store.name].fault("io_error")
        return None

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        lookup = self._lookups.pop(request.request_id)
        first, blocks, tiers = lookup.first, lookup.blocks, lookup.tiers
        assert num_external_tokens == lookup.num_tokens
        for i, block in enumerate(blocks):
            block.block_id = block_ids[first + i]
        self._load_tiers[request.request_id] = [self.tier_names[tier] for tier in tiers]
        self._pending_loads.append(LoadJob(request.request_id, blocks, tiers))

    # ---- each step ----------------------------------------------------------------------------

    def build_connector_meta(self, requests: dict[str, Request],
                             block_ids: Callable[[str], list[int]],
                             num_scheduled_tokens: dict[str, int]) -> KVConnectorMetadata | None:
        for req_id in num_scheduled_tokens:
            self._lookups.pop(req_id, None)  # admitted: a preemption later looks up afresh
        saves = []
        if self.transfer_config.is_producer:
            bs = self.block_size
            for req_id in num_scheduled_tokens:
                request = requests[req_id]
                # Full blocks of final tokens (not drafts) whose KV this step completes.
                num_full = min(request.num_computed_tokens, request.num_tokens) // bs
                first = self._num_saved_blocks.get(req_id, 0)
                if num_full <= first:
                    continue
                extend_block_hashes(request.block_hashes, request.all_token_ids, bs,
                                    request.cache_namespace)
                table = block_ids(req_id)
                for index in range(first, num_full):
                    saves.append(BlockTransfer(
                        table[index], self.key(request.block_hashes[index]),
                        request.block_hashes[index],
                        request.all_token_ids[index * bs : (index + 1) * bs]))
                self._num_saved_blocks[req_id] = num_full
            if self.save_tails:
                saves.extend(self._tail_saves(requests, block_ids, num_scheduled_tokens))
        loads, self._pending_loads = self._pending_loads, []
        if not loads and not saves:
            return None
        return KVConnectorMetadata(loads=loads, saves=saves)

    def _tail_saves(self, requests: dict[str, Request], block_ids: Callable[[str], list[int]],
                    num_scheduled_tokens: dict[str, int]) -> list[BlockTransfer]:
        """P/D producer: the partial last block of each prompt this step completed."""
        saves = []
        for req_id in num_scheduled_tokens:
            request = requests[req_id]
            if req_id in self._tails_saved or request.num_computed_tokens < request.num_tokens:
                continue
            tail = tail_block(request, self.block_size)
            self._tails_saved.add(req_id)
            if tail is not None:
                index, tail_hash = tail
                saves.append(BlockTransfer(
                    block_ids(req_id)[index], self.tail_key(tail_hash), tail_hash,
                    request.all_token_ids[index * self.block_size : request.num_prompt_tokens]))
        return saves

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for name, counters in output.tiers.items():
            self.stats.tiers.setdefault(name, TierCounters()).add(counters)
            if counters.blocks_loaded:
                tier = self.tier_names.index(name)
                self.cost_model.tiers[tier].observe(counters.blocks_loaded, counters.load_seconds)
        self.stats.num_saves_dropped += output.num_saves_dropped

    def record_load_result(self, num_loaded_tokens: int, num_failed_tokens: int) -> None:
        self.stats.loaded_tokens += num_loaded_tokens
        self.stats.load_failed_tokens += num_failed_tokens
        self.stats.load_fallbacks += num_failed_tokens > 0

    def get_stats(self) -> KVTierStats:
        return copy.deepcopy(self.stats)

    def load_sources(self, request_id: str, num_tokens: int) -> dict[str, int]:
        """By tier, block by block in load order (the last may be a partial tail block)."""
        sources: dict[str, int] = {}
        for name in self._load_tiers.pop(request_id, []):
            if num_tokens <= 0:
                break
            sources[name] = sources.get(name, 0) + min(self.block_size, num_tokens)
            num_tokens -= self.block_size
        return sources

    def request_finished(self, request: Request) -> bool:
        self._load_tiers.pop(request.request_id, None)
        self._num_saved_blocks.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._tails_saved.discard(request.request_id)
        return False

    def shutdown(self) -> None:
        with _host_stores_lock:
            for key in [k for k in _host_stores if k[0] == id(self.transfer_config)]:
                del _host_stores[key]
        stores, self.stores = self.stores, []
        for store in stores:
            if not isinstance(store, MemoryStore):
                store.close()
