"""The event stream: a scripted run's exact events (chunked prefill, a prefix hit, a preemption),
the block events' bookkeeping, and the bus itself."""

from __future__ import annotations

import dataclasses

from pagedserve.observability.events import (
    BlocksEvicted,
    BlocksStored,
    EventBus,
    RequestQueued,
    RequestScheduled,
    StepFinished,
    TokensGenerated,
)
from pagedserve.sampling_params import SamplingParams

TWO_TOKENS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
THIRTY_TOKENS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


class _Recorder:
    """Events with their times dropped and block hashes named h0, h1, ... by first sight."""

    def __init__(self) -> None:
        self.events: list = []
        self.raw: list = []
        self._hash_names: dict[bytes, str] = {}

    def __call__(self, events: list) -> None:
        self.raw.extend(events)
        self.events.extend(self._plain(event) for event in events)

    def _plain(self, event) -> tuple:
        fields = []
        for field in dataclasses.fields(event):
            value = getattr(event, field.name)
            if isinstance(value, float):
                continue  # times and durations
            if field.name == "block_hashes":
                value = tuple(self._hash_names.setdefault(h, f"h{len(self._hash_names)}")
                              for h in value)
            fields.append(value)
        return (type(event).__name__, *fields)


def _run(engine, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()


def test_chunked_prefill_and_a_prefix_hit_emit_exact_events(make_llm):
    # A budget of 32 tokens splits a's 40-token prompt in two chunks; b shares its first two
    # blocks (32 tokens) and hits them.
    engine = make_llm(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256).engine
    recorder = _Recorder()
    engine.events.subscribe(recorder)
    prompt_a = list(range(1000, 1040))
    prompt_b = prompt_a[:32] + list(range(2000, 2008))
    _run(engine, [("a", prompt_a, TWO_TOKENS)])
    _run(engine, [("b", prompt_b, TWO_TOKENS)])
    # StepFinished: step, requests, prefill requests, decode requests, prefill tokens, decode
    # tokens, preempted.
    assert recorder.events == [
        ("RequestQueued", "a", "a", 40, 2, None, 1),
        ("BlocksStored", ("h0", "h1")),
        ("RequestScheduled", "a", 0, 32, 0, "prefill", 0),
        ("StepFinished", 0, 1, 1, 0, 32, 0, 0),
        ("RequestScheduled", "a", 1, 8, 32, "prefill", 0),
        ("TokensGenerated", "a", 1, 1, True),
        ("StepFinished", 1, 1, 1, 0, 8, 0, 0),
        ("RequestScheduled", "a", 2, 1, 40, "decode", 0),
        ("TokensGenerated", "a", 2, 1, False),
        ("RequestFinished", "a", "length", 2),
        ("StepFinished", 2, 1, 0, 1, 0, 1, 0),
        ("RequestQueued", "b", "b", 40, 2, None, 1),
        ("PrefixHit", "b", 3, 32, "device"),
        ("RequestScheduled", "b", 3, 8, 32, "prefill", 0),
        ("TokensGenerated", "b", 3, 1, True),
        ("StepFinished", 3, 1, 1, 0, 8, 0, 0),
        ("RequestScheduled", "b", 4, 1, 40, "decode", 0),
        ("TokensGenerated", "b", 4, 1, False),
        ("RequestFinished", "b", "length", 2),
        ("StepFinished", 4, 1, 0, 1, 0, 1, 0),
    ]
    steps = [e for e in recorder.raw if isinstance(e, StepFinished)]
    for step in steps:  # the parts are measured and fit inside the step
        assert step.forward_s > 0 and step.schedule_s > 0 and step.output_s > 0
        assert step.schedule_s + step.prepare_s + step.forward_s + step.logits_s \
            + step.sample_s + step.output_s <= step.duration_s + 1e-6
    first_token = next(e for e in recorder.raw if isinstance(e, TokensGenerated))
    assert steps[1].start < first_token.time <= steps[1].end


def test_a_preemption_emits_preempted_then_resumed(make_llm):
    # 5 usable blocks of 16 tokens: c and d (30-token prompts) both run until each needs a
    # third block; d, the later arrival, is preempted and resumes once c has finished.
    engine = make_llm(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
                      num_gpu_blocks_override=6).engine
    recorder = _Recorder()
    engine.events.subscribe(recorder)
    _run(engine, [("c", list(range(3000, 3030)), THIRTY_TOKENS),
                  ("d", list(range(4000, 4030)), THIRTY_TOKENS)])
    assert engine.get_stats().num_preemptions == 1

    def story(req_id: str) -> list[tuple]:
        """The request's events, without its decode steps and tokens (one per step)."""
        return [e for e in recorder.events
                if len(e) > 1 and e[1] == req_id and e[0] != "TokensGenerated"
                and not (e[0] == "RequestScheduled" and e[5] == "decode")]

    assert story("d") == [
        ("RequestQueued", "d", "d", 30, 30, None, 1),
        ("RequestScheduled", "d", 0, 2, 0, "prefill", 0),  # c took 30 of the 32 tokens
        ("RequestScheduled", "d", 1, 28, 2, "prefill", 0),
        ("RequestPreempted", "d", 4, 32),
        # 30 prompt + 3 sampled tokens, of which the first block is still cached.
        ("RequestResumed", "d", 30, 17),
        ("PrefixHit", "d", 30, 16, "device"),
        ("RequestScheduled", "d", 30, 17, 16, "prefill", 0),
        ("RequestFinished", "d", "length", 30),
    ]
    assert story("c") == [
        ("RequestQueued", "c", "c", 30, 30, None, 1),
        ("RequestScheduled", "c", 0, 30, 0, "prefill", 0),
        ("RequestFinished", "c", "length", 30),
    ]
    preempting_step = next(e for e in recorder.events if e[0] == "StepFinished" and e[1] == 4)
    assert preempting_step == ("StepFinished", 4, 1, 0, 1, 0, 1, 1)
    # Every token arrived: 30 each, one TokensGenerated per step that sampled.
    for req_id in ("c", "d"):
        assert sum(e[3] for e in recorder.events
                   if e[0] == "TokensGenerated" and e[1] == req_id) == 30


def test_block_events_follow_the_prefix_cache_index(make_llm):
    """Replaying BlocksStored/BlocksEvicted gives exactly the pool's index, through
    allocation, eviction, preemption and a reset."""
    engine = make_llm(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256,
                      num_gpu_blocks_override=9).engine
    recorder = _Recorder()
    engine.events.subscribe(recorder)
    indexed: set[bytes] = set()
    num_evicted = 0

    def replay() -> None:
        nonlocal num_evicted
        for event in recorder.raw:
            if isinstance(event, BlocksStored):
                assert indexed.isdisjoint(event.block_hashes)
                indexed.update(event.block_hashes)
            elif isinstance(event, BlocksEvicted):
                assert indexed.issuperset(event.block_hashes)
                indexed.difference_update(event.block_hashes)
                num_evicted += len(event.block_hashes)
        recorder.raw.clear()

    shared = list(range(500, 548))
    _run(engine, [(f"r{i}", shared + list(range(600 + 20 * i, 610 + 20 * i)), THIRTY_TOKENS)
                  for i in range(4)])
    replay()
    assert engine.get_stats().num_preemptions > 0  # the pool is too small for all four
    assert indexed == set(engine.scheduler.kv_cache_manager.block_pool._cached)
    assert num_evicted > 0 and indexed  # blocks were reallocated; the shared prefix stays
    assert engine.reset_prefix_cache()
    engine.events.publish()
    replay()
    assert indexed == set()


def test_events_do_not_change_outputs(make_llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(700 + 50 * i, 740 + 50 * i))} for i in range(3)]
    observed = make_llm(max_num_batched_tokens=32, max_num_seqs=4)
    recorder = _Recorder()
    observed.engine.events.subscribe(recorder)
    plain = make_llm(max_num_batched_tokens=32, max_num_seqs=4)
    assert not plain.engine.events.enabled
    assert ([o.outputs[0].token_ids for o in observed.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    assert sum(1 for e in recorder.raw if isinstance(e, RequestScheduled)) > 3


def test_the_bus_is_off_without_subscribers_and_drops_a_failing_one():
    bus = EventBus()
    event = RequestQueued("r", "r", 0.0, 1, 1)
    bus.emit(event)
    assert not bus.enabled and bus.num_pending == 0
    seen: list = []
    unsubscribe = bus.subscribe(seen.extend)

    def broken(events: list) -> None:
        raise RuntimeError("a bug in an observer")

    bus.subscribe(broken)
    bus.emit(event)
    bus.publish()  # the broken subscriber is logged and dropped; the other still gets events
    bus.emit(event)
    bus.publish()
    assert seen == [event, event]
    unsubscribe()
    assert not bus.enabled
    bus.emit(event)
    assert bus.num_pending == 0
