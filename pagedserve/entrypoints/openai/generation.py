"""The engine side of one HTTP request: its prompts' AsyncLLM.generate streams, merged, and the
SSE events made from them. Both abort whatever still runs when they are closed early.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagedserve.outputs import RequestOutput


class Generation:
    """One HTTP request's engine streams (one per prompt), merged in the order outputs arrive.

    `start()` waits for every stream's first output, so bad input (ValueError) surfaces before a
    response starts. `aclose()` cancels what is still running: AsyncLLM aborts those requests.
    """

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]) -> None:
        self._streams = streams
        self._pending: dict[asyncio.Task, int] = {}
        """Task awaiting a stream's next output -> its prompt index."""
        self._ready: list[tuple[int, RequestOutput]] = []

    async def start(self) -> None:
        firsts = [asyncio.create_task(_next_output(stream)) for stream in self._streams]
        try:
            outputs = await asyncio.gather(*firsts)
        except BaseException:
            for task in firsts:
                task.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await self.aclose()
            raise
        for prompt_index, output in enumerate(outputs):
            assert output is not None, "a generate() stream ended without a finished output"
            self._ready.append((prompt_index, output))
            if not output.finished:
                self._await_next(prompt_index)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, DELTA output) pairs; every prompt's last one has finished=True."""
        ready, self._ready = self._ready, []
        for item in ready:
            yield item
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=self._pending.__getitem__):
                prompt_index = self._pending.pop(task)
                output = task.result()
                assert output is not None, "a generate() stream ended without a finished output"
                if not output.finished:
                    self._await_next(prompt_index)
                yield prompt_index, output

    async def aclose(self) -> None:
        pending = list(self._pending)
        self._pending.clear()
        for task in pending:
            task.cancel()  # raises CancelledError inside generate(), which aborts the request
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()

    def _await_next(self, prompt_index: int) -> None:
        task = asyncio.create_task(_next_output(self._streams[prompt_index]))
        self._pending[task] = prompt_index


async def _next_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    return await anext(stream, None)


class EventStream:
    """The SSE events (`data: ...` strings) of a started Generation.

    The consumer must `aclose()` it, iterated or not: that aborts whatever still runs.
    """

    def __init__(self, events: AsyncIterator[str], generation: Generation) -> None:
        self._events = events
        self._generation = generation

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._generation.aclose()
