"""AsyncLLM: concurrent callers share the engine's batches; early exit aborts; shutdown drains."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve.engine.async_llm import AsyncLLM, EngineDrainingError
from pagedserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def async_llm(make_llm):
    llm = make_llm()
    engine = AsyncLLM(llm.engine)
    yield engine
    if not engine.is_draining:
        asyncio.run(engine.shutdown(drain_timeout=0))


async def collect(engine, prompt, params=PARAMS, **kwargs):
    text, token_ids, final = "", [], None
    async for output in engine.generate(prompt, params, **kwargs):
        text += output.outputs[0].text if output.outputs else ""
        token_ids += output.outputs[0].token_ids if output.outputs else []
        final = output
    return text, token_ids, final


def test_concurrent_streams_equal_offline(async_llm, make_llm):
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    offline = make_llm().generate(prompts, PARAMS)

    async def main():
        return await asyncio.gather(*(collect(async_llm, p) for p in prompts))

    results = asyncio.run(main())
    for (text, token_ids, final), expected in zip(results, offline):
        assert token_ids == expected.outputs[0].token_ids
        assert text == expected.outputs[0].text
        assert final.finished and final.outputs[0].finish_reason == "length"
    async_llm.check_idle()


def test_early_exit_aborts_and_frees_blocks(async_llm):
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def main():
        stream = async_llm.generate("Write a very long essay.", long, "r1")
        async for _ in stream:
            break
        await stream.aclose()
        # the same id can be used again once aborted
        return await collect(async_llm, "Hello", request_id="r1")

    _, token_ids, _ = asyncio.run(main())
    assert len(token_ids) == PARAMS.max_tokens
    async_llm.check_idle()


def test_bad_input_raises_and_engine_keeps_serving(async_llm):
    async def main():
        good = asyncio.create_task(collect(async_llm, "Tell me about rivers."))
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(async_llm, [1, 10**9])
        return await good

    _, token_ids, _ = asyncio.run(main())
    assert len(token_ids) == PARAMS.max_tokens
    async_llm.check_idle()


def test_shutdown_drains_then_aborts(async_llm):
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        short_task = asyncio.create_task(collect(async_llm, "Hi"))
        long_task = asyncio.create_task(collect(async_llm, "Go on forever:", long))
        await asyncio.sleep(0.5)
        await async_llm.shutdown(drain_timeout=3)
        with pytest.raises(EngineDrainingError):
            await collect(async_llm, "late")
        return await short_task, await long_task

    (_, short_ids, short_final), (_, long_ids, long_final) = asyncio.run(main())
    assert short_final.outputs[0].finish_reason == "length" and len(short_ids) == 12
    assert long_final.outputs[0].finish_reason == "abort" and 0 < len(long_ids) < 2000
    async_llm.engine.assert_idle()


def test_a_streaming_request_counts_as_unfinished(async_llm, monkeypatch):
    """The drain waits while num_unfinished_requests() > 0. The engine thread hands a step's
    tokens out before it refreshes its stats, so a caller that has its first token (and a
    SIGTERM sent right then) must find the request counted already. Held here: the refresh
    waits until the caller has looked."""
    looked = threading.Event()
    refresh_stats = async_llm.engine.get_stats

    def refresh_after_the_caller_looked():
        if async_llm.engine.has_unfinished_requests():
            looked.wait(timeout=60)
        return refresh_stats()

    monkeypatch.setattr(async_llm.engine, "get_stats", refresh_after_the_caller_looked)
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def main():
        stream = async_llm.generate("Write a very long essay.", long)
        async for _ in stream:
            counted = async_llm.num_unfinished_requests()
            looked.set()
            break
        await stream.aclose()
        return counted

    assert asyncio.run(main()) == 1
    async_llm.check_idle()
