"""A parallel executor's rank process (``executor.worker.rank_main``) ignores SIGINT, which
a terminal's Ctrl-C sends to the whole process group, and SIGTERM, which a service manager
stopping the whole group sends, and ends when rank 0 closes its step pipe, with exit code 3
and nothing on stderr (no KeyboardInterrupt traceback per rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ignores_sigint_and_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigIgn:"):
                ignored = int(line.split()[1], 16)
                return all(ignored & (1 << (s - 1)) for s in (signal.SIGINT, signal.SIGTERM))
    return False


def test_a_rank_survives_ctrl_c_and_a_group_sigterm_and_exits_quietly_when_rank_0_goes():
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "executor.worker.rank_main"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not _ignores_sigint_and_sigterm(proc.pid):  # set before it reads the pipe
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the rank never ignored SIGINT and SIGTERM"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # still waiting for its configuration
        proc.stdin.close()  # rank 0 is gone
        assert proc.wait(timeout=30) == 3
        assert proc.stderr.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
