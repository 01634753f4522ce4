"""One worker in the engine's own process: no serialization, no process groups.

With async scheduling a step's future is resolved on demand: the worker returns once the step is
launched, and result() waits for its sampled tokens to reach the host.
"""

from __future__ import annotations

from concurrent.futures import Future

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor.abstract import Executor
from pagedserve.worker.async_output import AsyncModelRunnerOutput
from pagedserve.worker.worker import Worker


class _LaunchedStep(Future):
    """A launched step (async scheduling): the first result() reads its output back."""

    def __init__(self, output: AsyncModelRunnerOutput) -> None:
        super().__init__()
        self._launched = output

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._read_back()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._read_back()
        return super().exception(timeout)

    def _read_back(self) -> None:
        if not self.done():
            try:
                self.set_result(self._launched.get_output())
            except Exception as error:  # noqa: BLE001 - the caller sees it, as from any future
                self.set_exception(error)


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model=None) -> None:
        self.worker = Worker(config, model=model)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        output = self.worker.execute_model(scheduler_output)
        if isinstance(output, AsyncModelRunnerOutput):
            return _LaunchedStep(output)
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.worker.execute_model(scheduler_output)
        if isinstance(output, AsyncModelRunnerOutput):  # a step outside the loop: wait for it
            return output.get_output()
        return output

    def time_prefill(self, num_tokens: int, context_len: int) -> float:
        return self.worker.time_prefill(num_tokens, context_len)

    def calibrate_outlier_channels(self, token_ids: list[int]) -> int:
        return self.worker.calibrate_outlier_channels(token_ids)

    def add_lora(self, lora_int_id: int, lora_path: str) -> None:
        self.worker.add_lora(lora_int_id, lora_path)

    def remove_lora(self, lora_int_id: int) -> None:
        self.worker.remove_lora(lora_int_id)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self) -> None:
        self.worker.wake_up()

    def update_weights(self, model_path: str) -> None:
        self.worker.update_weights(model_path)

    def memory_report(self) -> list[dict]:
        return [self.worker.memory_report()]

    def expert_load(self) -> dict[int, list[int]]:
        return self.worker.expert_load()

    def start_profile(self) -> None:
        self.worker.start_profile()

    def stop_profile(self) -> list[str]:
        return [self.worker.stop_profile()]

    def check_idle(self) -> list[str]:
        return self.worker.check_idle()

    def shutdown(self) -> None:
        self.worker.shutdown()
