"""How ``make test`` shares the suite between its two xdist workers (``tests/conftest.py``)."""

# The files that start model-loading processes (a parallel group's ranks, `meshserve up`,
# gateway processes): under xdist they run on one worker, one after another, so two of
# them never run at once (together they ran the 2 cores and 24 GiB out).
PROCESS_FILES = frozenset({
    "tests/executor/test_compiled_decode.py",
    "tests/executor/test_cuda_tensor_parallel.py",
    "tests/executor/test_parallel_default_model.py",
    "tests/executor/test_tensor_parallel.py",
    "tests/mesh/test_golden_parallel.py",
    "tests/mesh/test_lease_recovery.py",
    "tests/mesh/test_redis_restart_and_block.py",
    "tests/mesh/test_tasks_durable.py",
    "tests/meshserve/cli/test_cli.py",
    "tests/meshserve/cli/test_health_port_cli.py",
    "tests/meshserve/cli/test_metrics_cli.py",
    "tests/meshserve/cli/test_tls_cli.py",
    "tests/meshserve/cli/test_up_autoscale.py",
    "tests/meshserve/cli/test_up_cpu_affinity.py",
    "tests/meshserve/cli/test_up_stop.py",
    "tests/scheduler/test_cold_start.py",
})
