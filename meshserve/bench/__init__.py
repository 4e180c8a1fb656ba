"""``meshserve bench``: throughput and latency of the engine, the mesh and transformers.

Modules, in the order data flows through them:

* ``workload``: the seeded requests, identical for every target: ``synthetic``
  (log-normal prompt and output lengths, uniform ordinary token ids),
  ``shared-prefix`` (``shared_prefix``: one system prompt in front of most
  prompts), ``multi-turn`` (``multi_turn``: each turn resends the previous one)
  or ``jsonl`` (``jsonl_workload``: a file of requests with their own sampling),
  chosen by name in ``workload_kinds``; greedy, ``ignore_eos`` unless the file
  says otherwise;
* ``config``: ``BenchConfig``, what one run measures;
* ``target``: the ``Target`` interface; ``targets``: ``engine`` (in-process
  ``AsyncEngine``), ``mesh`` (launched processes or ``--addr``) and the registry;
  ``hf_targets``: ``hf-generate``, ``hf-static`` and ``hf-continuous``
  (``transformers``);
* ``arrivals``: seeded Poisson arrival times of the open loop (``--request-rate``);
* ``loop``: the closed loop at concurrency C, the open loop, multi-turn parents,
  and each request's TTFT/TPOT/e2e, with the exact-token-count check;
* ``engine_stats``: the engine counters sampled during the run (KV use, prefix
  hits, preemptions); ``cpu_wait``: how long each system's busiest thread waited
  for a CPU during the run (other processes on its cores);
* ``report``: the JSON report and the terminal table (percentiles:
  ``stats.percentile``, the project's one); ``summary``: Markdown tables of
  medians and ratios over a folder of reports;
* ``sweep``: the target, and the transformers ``--baseline`` targets (none, one or
  several) interleaved with it, over sweep points (concurrencies or rates), with
  each baseline's ratios;
  ``progress``: the live progress bars;
* ``sweep_report`` and ``plots``: the ``--report-dir`` folder (report.json,
  summary.md, plots/*.png);
* ``runner``: one invocation from start to finish.

Separate programs (``python -m meshserve.bench.NAME``): ``policies`` (the
scheduler's queue policies and tenant quotas on a launched 2-executor mesh; its
pure parts in ``policy_workload``), ``slow_reader`` (a reader that stops reading),
``kvstore_sharing`` (what a prefix shared through a kvstore saves), ``task_cache``
(cached-answer latency with the Redis result cache, task submit rate), ``ceiling``
and ``kernels`` (the model's and the attention kernels' speed), ``cpu_fused`` (a
decode step with the fused CPU kernels on and off), ``decode_graphs`` (CUDA decode
steps with CUDA graphs on and off), ``batch_wait_plot`` (the
``--max-batch-wait-ms`` curve from reports); ``vllm_gemm.py`` runs under vLLM's own
Python (its GEMM against the engine's). ``sim``: the
scheduler simulations of ``meshserve sim`` (one event loop, three workloads).

A benchmark prints numbers and writes reports; tests assert behaviour, never times.
"""

from meshserve.bench.config import BenchConfig
from meshserve.bench.runner import main, run_bench
from meshserve.bench.workload import WorkloadSpec

__all__ = ["BenchConfig", "WorkloadSpec", "main", "run_bench"]
