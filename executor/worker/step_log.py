"""Per-rank step log of a parallel executor: what each rank ran in each step.

Every rank of a tensor/pipeline-parallel group runs the same step from the same
``SchedulerOutput``; this log lets an operator (or a test) check that they did.
With ``ParallelConfig.step_log_dir`` set, each rank appends one JSON line per
step that ran a forward pass to ``<dir>/rank-<r>.jsonl``, and logs the same at
DEBUG on the ``executor.worker.steps`` logger::

    {"rank": 1, "stage": 0, "step": 17,
     "micro_batches": [[["req-a", 1], ["req-b", 1]], [["req-c", 32]]]}

``step`` is rank 0's step id (the group's count of ``execute_model`` calls, sent
with the step); ``micro_batches`` are the request ids in the order the rank ran
them, each with its scheduled token count: one micro-batch without pipeline
parallelism, up to ``pipeline_parallel_size`` with it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Sequence

from executor.engine.scheduler_output import ScheduledRequest

log = logging.getLogger("executor.worker.steps")


class StepLog:
    """Appends this rank's step records to ``<directory>/rank-<rank>.jsonl``.

    Args:
        directory: the folder (made when missing).
        rank: this process's global rank.
        stage: its pipeline stage.

    Raises:
        OSError: the folder or file cannot be written.
    """

    def __init__(self, directory: str | Path, rank: int, stage: int):
        self.rank, self.stage = rank, stage
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(path / f"rank-{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - lives with the worker

    def record(self, step: int, micro_batches: Sequence[Sequence[ScheduledRequest]]) -> None:
        """Writes (and flushes) one step's line."""
        line = json.dumps({"rank": self.rank, "stage": self.stage, "step": step,
                           "micro_batches": [[[s.request_id, s.num_scheduled_tokens] for s in mb]
                                             for mb in micro_batches]})
        self._file.write(line + "\n")
        self._file.flush()
        log.debug("step %s", line)


def read_step_logs(directory: str | Path, timeout_s: float = 10.0) -> dict[int, list[dict]]:
    """Every rank's records in ``directory``: rank -> its lines, in order.

    Each rank writes its line after its own part of a step, while rank 0 writes its
    own before the step returns, so the other ranks' lines for rank 0's last step may
    still be on their way. This waits until every rank has logged that step (or a
    later one), up to ``timeout_s`` seconds (0: one read), then returns what is there
    (a rank still missing it shows as a shorter list). A half-written last line is
    left out.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        out = {}
        for path in sorted(Path(directory).glob("rank-*.jsonl")):
            lines = path.read_text(encoding="utf-8").split("\n")[:-1]  # the last piece: "" or a line half written
            out[int(path.stem.removeprefix("rank-"))] = [json.loads(line) for line in lines if line]
        last = out[0][-1]["step"] if out.get(0) else None
        if last is None or time.monotonic() >= deadline or all(
                records and records[-1]["step"] >= last for records in out.values()):
            return out
        time.sleep(0.02)
