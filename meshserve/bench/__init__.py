"""``meshserve bench``: throughput and latency of the engine, the mesh and a reference.

Modules, in the order data flows through them:

* ``workload``: the seeded requests (log-normal prompt and output lengths,
  uniform ordinary token ids, greedy, ``ignore_eos``), identical for every target;
* ``config``: ``BenchConfig``, what one run measures;
* ``targets``: ``engine`` (in-process ``AsyncEngine``), ``mesh`` (launched
  processes or ``--addr``), ``hf-generate`` (``transformers`` ``generate``);
* ``loop``: the closed loop at concurrency C and each request's TTFT/TPOT/e2e,
  with the exact-token-count check;
* ``report``: the JSON report and the terminal table;
* ``runner``: one run from start to finish.

A benchmark prints numbers and writes reports; tests assert behaviour, never times.
"""

from meshserve.bench.config import BenchConfig
from meshserve.bench.runner import main, run_bench
from meshserve.bench.workload import WorkloadSpec

__all__ = ["BenchConfig", "WorkloadSpec", "main", "run_bench"]
