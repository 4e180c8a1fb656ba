"""A rank of a parallel executor other than rank 0: ``python -m executor.worker.rank_main``.

Started by ``executor.worker.multiproc_group.MultiprocWorkerGroup`` with the
torchrun-style environment of ``executor.worker.distributed`` and its stdin as
the step pipe. Its life::

    read the EngineConfig frame         (pin to MESHSERVE_CPU_AFFINITY on CPU)
    load this rank's shard (Worker)     store: loaded/<rank>
    join the process group
    loop: read a frame                  ("init_cache", n, b) | ("step", SchedulerOutput, step id) | ("shutdown",)
          run it on the worker          (outputs are rank 0's; this rank's are dropped)

It exits 0 on ``shutdown`` (its objects frozen first, ``gc.freeze``, so that the
interpreter's exit does not spend seconds collecting them while rank 0 waits); 3
when the pipe closes (rank 0 died); with the exception's traceback and 1 when a
step fails (a peer died, a collective timed out): rank 0 notices the exit and
takes the executor out.

It ignores SIGINT and SIGTERM: a terminal's Ctrl-C reaches every process of the
foreground group, and a service manager that stops a whole process group (systemd's
``KillMode=control-group``, ``kill -TERM -PGID``) sends SIGTERM to each; a rank's life
is rank 0's to end (the ``shutdown`` frame, or the pipe closing when rank 0 exits, also
when rank 0 is SIGKILLed), so both stop the ranks through rank 0's clean shutdown
instead of a rank dying first and rank 0 logging "rank 1 exited with code -15" as a
failure. SIGKILL still ends it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

from executor.worker import distributed
from meshserve.log_format import log_format


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.WARNING, format=log_format(f"rank {rank}: %(levelname)s %(name)s: %(message)s"))
    pipe = sys.stdin.buffer
    try:
        config = distributed.read_frame(pipe)
    except EOFError:
        return 3  # rank 0 is gone before it sent the configuration
    distributed.pin_from_env(config.num_threads)
    from executor.worker.worker import Worker

    store = distributed.make_store(rank, world_size, int(os.environ["MASTER_PORT"]),
                                   config.parallel.startup_timeout_s)
    worker = Worker(config, rank=rank)
    store.set(f"loaded/{rank}", "1")
    distributed.init_process_group(store, rank, world_size, str(worker.device), config.parallel.rank_timeout_s,
                                   config.parallel.tensor_parallel_size)
    while True:
        try:
            message = distributed.read_frame(pipe)
        except EOFError:
            return 3  # rank 0 is gone
        kind = message[0]
        if kind == "shutdown":
            return 0
        if kind == "init_cache":
            worker.initialize_cache(*message[1:])
        elif kind == "step":
            worker.execute_model(message[1], message[2])
        else:
            raise ValueError(f"unknown step-pipe message {kind!r}")


if __name__ == "__main__":
    code = main()
    gc.freeze()  # the exit skips full collections over torch's objects: rank 0's shutdown waits for it
    sys.exit(code)
