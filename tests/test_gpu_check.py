"""``tests/gpu_check.sh``'s choice of parts (``GPU_CHECK_PARTS``), on any machine: the
parts themselves need CUDA and are not run here."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).with_name("gpu_check.sh")


def test_an_unknown_part_is_refused_before_any_part_runs(tmp_path):
    """A typo (``tritn``) used to be found only when its turn came, after the parts
    before it had spent a lent machine's minutes, and a later failing part turned the
    promised exit code 2 into 1."""
    env = dict(os.environ, OUT=str(tmp_path), GPU_CHECK_PARTS="nvml tritn kernels")
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "gpu_check: unknown part tritn (graphs triton engine tensor_parallel nvml kernels)" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing ran, nvidia-smi included
