"""MultiprocWorkerGroup: one executor's model over several processes (tensor and
pipeline parallel).

``config.parallel`` asks for ``T`` tensor-parallel ranks per stage and ``P``
pipeline stages: rank ``r`` is tensor-parallel rank ``r % T`` of stage ``r // T``
(``executor.worker.pipeline``). Rank 0 is this process: it holds a ``Worker`` of
its own (stage 0: embedding, LM head), runs the engine (and,
in ``meshserve executor``, the gRPC service and the batch scheduler) and is the
only rank that samples. Ranks 1..W-1 are child processes
(``executor.worker.rank_main``) with torchrun's environment. Start-up::

    check the layout against the model's config  (ValueError before any process starts)
    rank 0: TCPStore on a free loopback port      spawn ranks 1..W-1 (stdin = step pipe)
    every rank loads its shard                    rank 0 waits for loaded/<r>, watching the children
    every rank joins the process group            (gloo on CPU, NCCL on CUDA)

Each step rank 0 writes the plain ``SchedulerOutput`` to every rank's pipe, runs
its own worker, and returns its ``ModelRunnerOutput``; the ranks meet in the
layers' collectives (all-reduce after row-parallel layers, all-gather of the
logits, gather of saved KV blocks) and, between stages, in point-to-point sends
of each micro-batch's activations.

Failure: a thread waits on each child. A child that exits unexpectedly (killed,
crashed, a collective that timed out) marks the group failed, the other children
are killed (so a collective rank 0 may be blocked in breaks at once: their
sockets close), and ``on_failure`` callbacks run (``meshserve executor`` turns
NOT_SERVING and ends in-flight requests with UNAVAILABLE); ``execute_model``
raises from then on, which ends the engine thread the same way. A rank that
hangs inside a step makes its peers' collectives time out after
``ParallelConfig.rank_timeout_s``, which fails the step likewise.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Callable

import torch

from executor.engine.config import EngineConfig
from executor.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from executor.engine.worker_group import ModelSpec, WorkerGroup
from executor.models.parallel import COMM
from executor.worker import distributed

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A rank of the group died or its step failed; the group is unusable."""


class MultiprocWorkerGroup(WorkerGroup):
    """``config.parallel.world_size`` ranks of one model replica (see the module doc).

    Args:
        config: the engine's configuration; ``config.parallel`` gives the sizes.

    Raises:
        ValueError: a parallel layout the model cannot be split into (before any
            process starts).
        RankFailure: a rank died or did not load within ``startup_timeout_s``.
        FileNotFoundError: the model cannot be resolved.
    """

    def __init__(self, config: EngineConfig):
        from executor.parallel_layout import check_parallel_sizes, read_model_shape
        from meshserve.model_files import resolve_model

        parallel = config.parallel
        check_parallel_sizes(read_model_shape(resolve_model(config.model, config.revision).path),
                             parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.config = config
        self.world_size = parallel.world_size
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._stopping = False
        self._lock = threading.Lock()
        self.worker = None
        self.num_steps = 0  # steps sent: the step id every rank logs (ParallelConfig.step_log_dir)
        on_cpu = torch.device(config.device).type == "cpu"
        shares = distributed.cpu_shares(self.world_size) if on_cpu else [None] * self.world_size
        self.store = distributed.make_store(0, self.world_size, 0, parallel.startup_timeout_s)
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.world_size):
                self.procs.append(self._spawn(rank, shares[rank]))
            if on_cpu and config.num_threads is None:
                torch.set_num_threads(len(shares[0]))  # rank 0 shares its process with the service: not pinned
            from executor.worker.worker import Worker

            self.worker = Worker(config, rank=0)
            self._wait_loaded(parallel.startup_timeout_s)
            distributed.init_process_group(self.store, 0, self.world_size, str(self.worker.device),
                                           parallel.rank_timeout_s, parallel.tensor_parallel_size)
        except BaseException:
            self._kill_children()
            raise
        self._spec = self.worker.spec
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"rank-{rank}-watch", daemon=True).start()

    # -- WorkerGroup ------------------------------------------------------------

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocates the group's ``num_blocks`` blocks: each rank holds its KV heads of
        every block (the capacity the engine reports is the group's)."""
        self._send(("init_cache", num_blocks, block_size))
        self._live().initialize_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Sends the step to every rank, runs rank 0's part, returns rank 0's output.

        Raises:
            RankFailure: a rank died (before or during the step) or the step's
                collectives failed.
        """
        self.num_steps += 1
        self._send(("step", scheduler_output, self.num_steps))
        try:
            return self._live().execute_model(scheduler_output, self.num_steps)
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection or timed out
            dead = self._dead_rank(wait_s=2.0)  # a peer's exit closes its sockets just before it is reaped
            self._fail(dead or f"the step failed on rank 0: {exc}")
            raise RankFailure(self.failure) from exc

    def shutdown(self) -> None:
        """Stops every rank (idempotent): ``shutdown`` frames, then kill after 10 s."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        if self.failure is None:
            for proc in self.procs:
                self._write(proc, distributed.encode_frame(("shutdown",)))
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.worker = None

    # -- failure ----------------------------------------------------------------

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Calls ``callback(reason)`` once, from a watcher thread, when a rank fails."""
        self._callbacks.append(callback)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None or self._stopping:
                return
            self.failure = reason
        log.error("parallel group failed: %s; stopping the other ranks", reason)
        self._kill_children()
        for callback in self._callbacks:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                log.exception("rank failure callback failed")

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping:
            self._fail(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def _dead_rank(self, wait_s: float) -> str | None:
        """``"rank r (pid p) exited with code c"`` for the first rank found exited within
        ``wait_s`` seconds, or None (a live rank failed its step, or one hangs)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def _kill_children(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    # -- plumbing ---------------------------------------------------------------

    def _spawn(self, rank: int, cpus: list[int] | None) -> subprocess.Popen:
        import os

        env = {**os.environ, **distributed.rank_env(rank, self.world_size, self.store.port, cpus)}
        proc = subprocess.Popen([sys.executable, "-m", "executor.worker.rank_main"], stdin=subprocess.PIPE, env=env)
        self._write(proc, distributed.encode_frame(self.config))
        return proc

    def _wait_loaded(self, timeout_s: float) -> None:
        """Waits until every child has loaded its shard, failing at once if one exits."""
        keys = [f"loaded/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise RankFailure(f"rank {rank} exited with code {proc.returncode} while loading "
                                      "(its error is in the log above)")
            if time.monotonic() > deadline:
                raise RankFailure(f"the ranks did not load within {timeout_s:g} s")
            time.sleep(0.05)

    def _send(self, message: tuple) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)
        frame = distributed.encode_frame(message)
        COMM.broadcast_bytes += len(frame) * len(self.procs)
        for rank, proc in enumerate(self.procs, start=1):
            if not self._write(proc, frame):
                self._fail(f"rank {rank} (pid {proc.pid}) closed its step pipe")
                raise RankFailure(self.failure)

    @staticmethod
    def _write(proc: subprocess.Popen, frame: bytes) -> bool:
        try:
            proc.stdin.write(frame)
            proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def _live(self):
        if self.worker is None:
            raise RuntimeError("the worker group was shut down")
        return self.worker

