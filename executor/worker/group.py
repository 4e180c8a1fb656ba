"""Worker groups: the implementations of ``executor.engine.worker_group.WorkerGroup``.

``InProcessWorkerGroup`` is the default group: one ``Worker`` in the engine's own
process and thread, called directly (no copy of the step's data).
``executor.worker.multiproc_group.MultiprocWorkerGroup`` holds the ranks of a
tensor-parallel replica as processes: it sends the same plain
``SchedulerOutput`` to every rank and returns rank 0's ``ModelRunnerOutput``.
``make_worker_group`` picks one by ``EngineConfig.parallel``.
"""

from __future__ import annotations

from executor.engine.config import EngineConfig
from executor.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from executor.engine.worker_group import ModelSpec, WorkerGroup
from executor.worker.worker import Worker


class InProcessWorkerGroup(WorkerGroup):
    """One worker in this process.

    Args:
        config: the engine's configuration (see ``Worker``).

    Raises:
        FileNotFoundError, ValueError: see ``Worker``.
    """

    def __init__(self, config: EngineConfig):
        self.worker: Worker | None = Worker(config)
        self._spec = self.worker.spec

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        self._live().initialize_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._live().execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker = None  # the weights and the KV cache go with the last reference

    def _live(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the worker group was shut down")
        return self.worker


def make_worker_group(config: EngineConfig) -> WorkerGroup:
    """The worker group ``config.parallel`` asks for: one in-process worker, or a
    ``MultiprocWorkerGroup`` of ``config.parallel.world_size`` ranks.

    Raises:
        ValueError: a parallel layout the model cannot be split into.
        FileNotFoundError: see ``Worker``.
    """
    if config.parallel.world_size == 1:
        return InProcessWorkerGroup(config)
    from executor.worker.multiproc_group import MultiprocWorkerGroup

    return MultiprocWorkerGroup(config)
