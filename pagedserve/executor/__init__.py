"""Executors: how the engine reaches its worker(s) (abstract.py says the contract)."""

from pagedserve.executor.abstract import Executor, ExecutorError

__all__ = ["Executor", "ExecutorError"]
