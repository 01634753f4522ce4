"""Generation (one HTTP request's engine streams, merged) against fake streams, no model: the
order of outputs, and that every unfinished stream is closed (AsyncLLM aborts on close) when
another prompt is rejected or the client goes away."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from pagedserve.entrypoints.openai.generation import Generation


@dataclass
class FakeOutput:
    tag: str
    finished: bool


@dataclass
class FakeStream:
    """Yields `num_outputs` outputs `delay_s` apart (the last finished), like AsyncLLM.generate;
    records whether it was left unfinished (what AsyncLLM would abort)."""

    name: str
    num_outputs: int
    delay_s: float = 0.0
    error: Exception | None = None
    aborted: bool = field(default=False, init=False)

    async def generate(self):
        if self.error is not None:
            raise self.error
        finished = False
        try:
            for i in range(self.num_outputs):
                await asyncio.sleep(self.delay_s)
                finished = i == self.num_outputs - 1
                yield FakeOutput(f"{self.name}{i}", finished)
        finally:
            self.aborted = not finished


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def test_outputs_merge_in_arrival_order():
    fast, slow = FakeStream("a", 3, 0.01), FakeStream("b", 2, 0.1)

    async def collect():
        generation = Generation([slow.generate(), fast.generate()])
        await generation.start()
        try:
            return [(i, o.tag, o.finished) async for i, o in generation.outputs()]
        finally:
            await generation.aclose()

    outputs = run(collect())
    # start() holds back until both first outputs exist; then arrival order.
    assert outputs == [(0, "b0", False), (1, "a0", False), (1, "a1", False), (1, "a2", True),
                       (0, "b1", True)]
    assert not fast.aborted and not slow.aborted


def test_rejected_prompt_closes_the_others():
    running = FakeStream("a", 100, 0.01)
    rejected = FakeStream("b", 1, error=ValueError("bad prompt"))

    async def start():
        await Generation([running.generate(), rejected.generate()]).start()

    with pytest.raises(ValueError, match="bad prompt"):
        run(start())
    assert running.aborted


def test_aclose_midway_aborts_unfinished_streams():
    done, long = FakeStream("a", 1), FakeStream("b", 100, 0.01)

    async def consume_one():
        generation = Generation([done.generate(), long.generate()])
        await generation.start()
        async for _ in generation.outputs():
            break  # the client went away
        await generation.aclose()

    run(consume_one())
    assert not done.aborted and long.aborted
