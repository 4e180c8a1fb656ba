"""Helpers the tests share (no tests here).

| module | what |
|---|---|
| ``mesh_harness`` | an in-process mesh: scheduler, executors and gateway over loopback gRPC (mutual TLS by default) |
| ``tls`` | a test CA and role certificates made once per process (and a foreign CA) |
| ``engines`` | ``make_engine``: a float32 default-model engine with keyword overrides |
| ``workers`` | ``PROCESS_FILES``: the test files `make test`'s xdist workers run one at a time |
| ``engine_steps`` | requests and hand-built steps of the executor's batch scheduler |
| ``triton_interpreter`` | the numpy >= 2.4 fix of Triton's CPU interpreter |
| ``reference`` | transformers' greedy reference outputs and the golden prompts |
| ``served_kvstore`` | a kvstore on its own thread, and fault-injecting store/servicer wrappers |
| ``served_scheduler`` | a scheduler over mutual TLS with one fake executor registered |
| ``net_fault`` | a loopback TCP proxy whose traffic can be frozen (a partition) |
| ``redis_server`` | a throwaway redis-server on a free port; an ACL user on it (``acl_user``) |
| ``metrics`` | Prometheus exposition text as a dict; a fake NVML module |
| ``promql`` | metric names in the PromQL of the deploy/observability files |
| ``deploy`` | the deploy/ tools (skipping when absent), the rendered Kubernetes overlays, the resolved compose file |
"""
