"""One worker in the engine's own process: no serialization, no process groups."""

from __future__ import annotations

from concurrent.futures import Future

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor.abstract import Executor
from pagedserve.worker.worker import Worker


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
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(self.execute_model(scheduler_output))
        return future

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def time_prefill(self, num_tokens: int, context_len: int) -> float:
        return self.worker.time_prefill(num_tokens, context_len)

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
