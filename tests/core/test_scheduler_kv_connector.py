"""The scheduler with a KV tier, driven by the fake runner of test_scheduler.py (which checks every
KV read against the sequence's true KV) and a fake tier: a dict of saved blocks. Loads finish a
few steps after they start, as real ones do, so requests wait, are aborted while loading, and get
fewer blocks than asked for when a saved block is corrupt. Outputs must equal a run without the
tier, and the books must balance after every step."""

from __future__ import annotations

import random

from pagedserve.config import CacheConfig
from pagedserve.core.block_hash import extend_block_hashes
from pagedserve.core.scheduler import Scheduler
from pagedserve.kv_transfer.base import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVTierStats,
    LoadJob,
)
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from tests.core.test_scheduler import FakeModelRunner, Harness

BLOCK_SIZE = 4


class FakeTier(KVConnectorScheduler):
    """The scheduler half over a dict: block hash -> the block's KV values, as saved."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, list[int]] = {}
        self.corrupt: set[bytes] = set()
        """Saved blocks whose payload fails verification when loaded."""
        self.stats = KVTierStats()
        self._lookups: dict[str, tuple[int, list[bytes], list[list[int]]]] = {}
        self._pending: list[LoadJob] = []
        self._num_saved: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        extend_block_hashes(request.block_hashes, request.all_token_ids, BLOCK_SIZE,
                            request.cache_namespace)
        first = num_computed_tokens // BLOCK_SIZE
        hashes = request.block_hashes[first : (request.num_tokens - 1) // BLOCK_SIZE]
        found = 0
        while found < len(hashes) and hashes[found] in self.blocks:
            found += 1
        self._num_saved[request.request_id] = first + found
        if not found:
            return 0
        tokens = [request.all_token_ids[(first + i) * BLOCK_SIZE : (first + i + 1) * BLOCK_SIZE]
                  for i in range(found)]
        self._lookups[request.request_id] = (first, hashes[:found], tokens)
        return found * BLOCK_SIZE

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        first, hashes, tokens = self._lookups.pop(request.request_id)
        assert num_external_tokens == len(hashes) * BLOCK_SIZE
        blocks = [BlockTransfer(block_ids[first + i], h.hex(), h, t)
                  for i, (h, t) in enumerate(zip(hashes, tokens))]
        self._pending.append(LoadJob(request.request_id, blocks, [0] * len(blocks)))

    def build_connector_meta(self, requests, block_ids, num_scheduled_tokens):
        saves = []
        for req_id in num_scheduled_tokens:
            request = requests[req_id]
            num_full = min(request.num_computed_tokens, request.num_tokens) // BLOCK_SIZE
            first = self._num_saved.get(req_id, 0)
            extend_block_hashes(request.block_hashes, request.all_token_ids, BLOCK_SIZE,
                                request.cache_namespace)
            table = block_ids(req_id)
            for index in range(first, num_full):
                saves.append(BlockTransfer(table[index], "", request.block_hashes[index], []))
            self._num_saved[req_id] = max(first, num_full)
        loads, self._pending = self._pending, []
        return KVConnectorMetadata(loads, saves) if loads or saves else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def get_stats(self) -> KVTierStats:
        return self.stats

    def record_load_result(self, num_loaded_tokens: int, num_failed_tokens: int) -> None:
        self.stats.loaded_tokens += num_loaded_tokens
        self.stats.load_failed_tokens += num_failed_tokens

    def request_finished(self, request: Request) -> bool:
        self._num_saved.pop(request.request_id, None)
        return False


class TierHarness(Harness):
    """Harness whose runner also saves blocks to the tier after each step and loads them back,
    each load finishing `load_steps` steps after it started."""

    def __init__(self, tier: FakeTier, load_steps: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        config = self.scheduler.config
        self.scheduler = Scheduler(
            config, CacheConfig(block_size=BLOCK_SIZE,
                                enable_prefix_caching=self.scheduler.kv_cache_manager.enable_caching),
            num_blocks=self.pool.num_blocks, connector=tier)
        self.tier = tier
        self.load_steps = load_steps
        self.loads: list[tuple[int, LoadJob]] = []
        runner: FakeModelRunner = self.runner
        execute = runner.execute_model

        def execute_with_tier(scheduler_output):
            meta = scheduler_output.kv_connector_metadata
            self.loads += [(self.load_steps, job) for job in (meta.loads if meta else [])]
            output = execute(scheduler_output)
            for block in meta.saves if meta else []:  # the step wrote them: copy them out
                start = block.block_id * BLOCK_SIZE
                tier.blocks[block.block_hash] = runner.kv_cache[start : start + BLOCK_SIZE]
            finished, still_loading = {}, []
            for steps_left, job in self.loads:
                if steps_left > 0:
                    still_loading.append((steps_left - 1, job))
                    continue
                num_ok = 0
                for block in job.blocks:
                    start = block.block_id * BLOCK_SIZE
                    if block.block_hash in tier.corrupt:
                        break
                    runner.kv_cache[start : start + BLOCK_SIZE] = tier.blocks[block.block_hash]
                    num_ok += 1
                finished[job.req_id] = num_ok
            self.loads = still_loading
            if finished:
                output.kv_connector_output = KVConnectorOutput(finished_loads=finished)
            return output

        runner.execute_model = execute_with_tier

    def run_checked(self) -> None:
        while self.scheduler.has_unfinished_requests():
            self.step()
            self.scheduler.check_integrity()


def make_request(req_id: str, prompt: list[int], max_tokens: int = 6, **kwargs) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(req_id, list(prompt), params, **kwargs)


def plain_outputs(requests: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    harness = Harness(block_size=BLOCK_SIZE)
    for req_id, prompt in requests:
        harness.add(make_request(req_id, prompt))
        harness.run()
    return dict(harness.outputs)


DOC = list(range(100, 140))  # 10 blocks
OTHER = list(range(500, 540))


def test_a_document_evicted_from_the_pool_is_loaded_back():
    tier = FakeTier()
    harness = TierHarness(tier, num_blocks=16, block_size=BLOCK_SIZE)
    requests = [("a", DOC + [1, 2]), ("b", OTHER + [3]), ("c", DOC + [4, 5, 6])]
    for req_id, prompt in requests:
        harness.add(make_request(req_id, prompt))
        harness.run_checked()
    assert tier.stats.loaded_tokens > 0
    assert harness.num_cached_tokens["c"] >= tier.stats.loaded_tokens
    assert dict(harness.outputs) == plain_outputs(requests)
    assert harness.pool.num_free_blocks == harness.pool.num_usable_blocks


def test_a_corrupt_block_shortens_the_load_and_is_recomputed():
    tier = FakeTier()
    harness = TierHarness(tier, num_blocks=64, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    requests = [("a", DOC + [1]), ("b", DOC + [2, 3])]
    harness.add(make_request(*requests[0]))
    harness.run_checked()
    # Corrupt the 4th block of the document: blocks 0-2 load, 3.. are computed.
    probe = make_request("probe", DOC + [9])
    extend_block_hashes(probe.block_hashes, probe.all_token_ids, BLOCK_SIZE)
    tier.corrupt.add(probe.block_hashes[3])
    harness.add(make_request(*requests[1]))
    harness.run_checked()
    assert tier.stats.loaded_tokens == 3 * BLOCK_SIZE
    assert tier.stats.load_failed_tokens > 0
    assert harness.num_cached_tokens["b"] == 3 * BLOCK_SIZE
    assert dict(harness.outputs) == plain_outputs(requests)


def test_abort_while_loading_frees_the_blocks_when_the_load_ends():
    tier = FakeTier()
    harness = TierHarness(tier, load_steps=3, num_blocks=64, block_size=BLOCK_SIZE,
                          enable_prefix_caching=False)
    harness.add(make_request("a", DOC + [1]))
    harness.run_checked()
    harness.add(make_request("b", DOC + [2]))
    harness.step()
    assert harness.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = harness.pool.num_usable_blocks - harness.pool.num_free_blocks
    assert held > 0
    harness.scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    harness.scheduler.check_integrity()
    # The load is still writing into them: not free yet.
    assert harness.pool.num_usable_blocks - harness.pool.num_free_blocks == held
    harness.run_checked()
    assert harness.pool.num_free_blocks == harness.pool.num_usable_blocks
    assert "b" not in harness.outputs


def test_random_workload_with_preemption_matches_the_plain_run():
    rng = random.Random(7)
    docs = [[rng.randrange(1, 900) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    requests = []
    for i in range(24):
        prompt = rng.choice(docs) + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 6))]
        requests.append((f"r{i}", prompt))
    tier = FakeTier()
    harness = TierHarness(tier, load_steps=1, num_blocks=24, block_size=BLOCK_SIZE,
                          max_num_batched_tokens=32, max_num_seqs=8)
    for i in range(0, len(requests), 6):  # waves, so later ones find earlier ones' blocks
        for req_id, prompt in requests[i : i + 6]:
            harness.add(make_request(req_id, prompt, max_tokens=rng.randrange(10, 30)))
        harness.run_checked()
    assert harness.scheduler.num_preemptions > 0
    assert tier.stats.loaded_tokens > 0
    expected = Harness(block_size=BLOCK_SIZE)
    for req_id, prompt in requests:
        expected.add(make_request(req_id, prompt, max_tokens=len(harness.outputs[req_id])))
    expected.run()
    assert dict(harness.outputs) == dict(expected.outputs)
    assert harness.pool.num_free_blocks == harness.pool.num_usable_blocks
