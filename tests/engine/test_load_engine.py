"""load_engine builds and warms up the engine in a thread of its own that has exited by the time
it returns: the caller's thread (a server's event loop) runs no torch parallel region, so the
engine thread's OpenMP pool is the process's only one (async_llm.load_engine says why that
matters: with a second pool, libgomp puts the workers to sleep after every region)."""

from __future__ import annotations

import threading

import pytest

from pagedserve.engine import async_llm
from pagedserve.engine.arg_utils import EngineArgs


class _FakeEngine:
    def __init__(self) -> None:
        self.built_in = threading.current_thread()
        self.warmed_up_in: threading.Thread | None = None

    def warm_up(self) -> None:
        self.warmed_up_in = threading.current_thread()


@pytest.mark.parametrize("warm_up", [True, False])
def test_the_engine_is_built_and_warmed_up_in_a_thread_that_has_exited(monkeypatch, warm_up):
    monkeypatch.setattr(async_llm.LLMEngine, "from_engine_args",
                        staticmethod(lambda engine_args: _FakeEngine()))
    engine = async_llm.load_engine(EngineArgs(model="unused"), warm_up=warm_up)
    assert engine.built_in is not threading.current_thread()
    assert not engine.built_in.is_alive()
    assert engine.warmed_up_in is (engine.built_in if warm_up else None)


def test_a_loading_error_is_raised_in_the_caller(monkeypatch):
    def fail(engine_args):
        raise ValueError("no such model")

    monkeypatch.setattr(async_llm.LLMEngine, "from_engine_args", staticmethod(fail))
    with pytest.raises(ValueError, match="no such model"):
        async_llm.load_engine(EngineArgs(model="unused"))
