"""Tensor and pipeline parallelism over gloo on tiny random Llama and Qwen2 models:
a group of ranks (processes) gives greedy tokens equal to the single-rank
engine's, with chunked prefill, prefix caching and preemption all at work; KV
heads replicated when the group has more ranks than the model has KV heads;
tensor × pipeline parallel on 4 ranks; a killed rank ends the in-flight request
with UNAVAILABLE within 5 s and the other ranks exit."""

from __future__ import annotations

import os
import signal

import pytest

from executor.engine.llm_engine import LLMEngine
from executor.worker.multiproc_group import MultiprocWorkerGroup, RankFailure
from tests.support.parallel import TINY, parallel_config, save_tiny, workload

pytestmark = pytest.mark.model


def _generate_both(path, tensor_parallel_size: int, pipeline_parallel_size: int = 1):
    prompts, params = workload(TINY["vocab_size"])
    single = LLMEngine(parallel_config(str(path)))
    expected = single.generate(prompts, params)
    stats = single.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0  # the workload exercises both
    group = LLMEngine(parallel_config(str(path), tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size))
    try:
        assert isinstance(group.worker_group, MultiprocWorkerGroup)
        got = group.generate(prompts, params)
        g = group.stats()
        assert (g.num_preemptions, g.prefix_cache_hit_tokens) == (stats.num_preemptions, stats.prefix_cache_hit_tokens)
        assert g.num_free_blocks == g.num_blocks
    finally:
        group.shutdown()
    return expected, got


@pytest.mark.parametrize("kind,num_kv_heads,tp,pp", [("llama", 2, 2, 1), ("qwen2", 1, 2, 1), ("qwen2", 2, 2, 2)],
                         ids=["llama-tp2-kv-heads-split", "qwen2-tp2-kv-head-replicated", "qwen2-tp2-pp2"])
def test_parallel_ranks_generate_the_single_rank_tokens(tmp_path, kind, num_kv_heads, tp, pp):
    path = save_tiny(tmp_path / kind, kind, num_kv_heads)
    expected, got = _generate_both(path, tp, pp)
    assert got == expected


async def test_killed_rank_ends_requests_with_unavailable_and_the_other_ranks_exit(tmp_path):
    """A rank killed mid-generation: the executor turns NOT_SERVING, the in-flight
    Execute call ends with UNAVAILABLE within 5 s (never a hang), the remaining rank
    exits and the group refuses further steps."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from executor.server import start_executor
    from meshserve.client import channel
    from meshserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
    from tests.support.leases import standalone_lease

    path = save_tiny(tmp_path / "llama", "llama", 1)  # 6 heads, 1 KV head: 3 ranks
    engine = LLMEngine(parallel_config(str(path), 3, num_blocks=64, max_model_len=256))
    group = engine.worker_group
    svc, async_engine, _ = await start_executor(engine, 0)
    try:
        request = executor_pb2.ExecuteRequest(request_id="long", prompt_token_ids=[5, 6, 7], tenant="default",
                                              lease=standalone_lease(svc, "long"))
        request.sampling.CopyFrom(common_pb2.SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True))
        async with channel(svc.address) as ch:
            call = executor_pb2_grpc.ExecutorStub(ch).Execute(request)
            first = await call.read()  # generating
            assert list(first.token_ids)
            victim = group.procs[0]  # rank 1
            os.kill(victim.pid, signal.SIGKILL)

            async def drain():
                while await call.read() is not grpc.aio.EOF:
                    pass

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(drain(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="meshserve.v1.Executor"))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert group.failure.startswith(f"rank 1 (pid {victim.pid}) exited with code ")
        assert await asyncio.to_thread(group.procs[1].wait, 30) != 0  # rank 2 exits with it
        with pytest.raises(RankFailure, match="rank 1"):
            group.execute_model(engine.batch_scheduler.schedule())
    finally:
        await svc.watchdog.stop()
        await svc.stop(0.2)
        await async_engine.stop()
        engine.shutdown()


def test_a_cpu_rank_runs_every_thread_on_its_share_of_the_cores(tmp_path):
    """Rank 1 of a TP=2 group is pinned through ``MESHSERVE_CPU_AFFINITY`` (``rank_env``,
    applied by ``rank_main``) to its share of the executor's cores, every thread of it."""
    from pathlib import Path

    from executor.worker.distributed import cpu_shares
    from meshserve.cpu_affinity import format_cpu_list

    path = save_tiny(tmp_path / "llama", "llama", 2)
    group = LLMEngine(parallel_config(str(path), 2))
    try:
        [proc] = group.worker_group.procs
        allowed = set()
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            status = Path(f"/proc/{proc.pid}/task/{tid}/status").read_text()
            allowed |= {line.split(":", 1)[1].strip() for line in status.splitlines()
                        if line.startswith("Cpus_allowed_list")}
        assert allowed == {format_cpu_list(cpu_shares(2)[1])}
    finally:
        group.shutdown()
