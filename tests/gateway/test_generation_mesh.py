"""gateway.generation.GatewayCore driven directly (no gRPC adapter) over a real
in-process mesh: a result-cache hit replays the original run's choices exactly,
and closing or cancelling the core's stream cancels the executor call, releases
the lease and frees the request id."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

import pytest
import pytest_asyncio

from gateway.collector import ChoiceCollector
from gateway.events import ChoiceResult, Delta, Queued
from gateway.generation import GatewayCore
from gateway.mesh_client import GrpcMeshClient
from gateway.request import GenerationRequest, ModelInfo
from gateway.result_cache import ResultCache
from gateway.tenants import Tenant
from meshserve.sampling import SamplingParams
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model
TENANT = Tenant("default")


@pytest_asyncio.fixture(scope="module")
async def mesh_and_core(tokenizer):
    mesh = await start_local_mesh([make_engine(num_blocks=128)], tokenizer)
    e0 = mesh.engines[0]
    core = GatewayCore(tokenizer, ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision),
                       GrpcMeshClient(mesh.scheduler.address, mesh.tls("gateway")),
                       result_cache=ResultCache(8, ttl_s=600.0))
    yield mesh, core
    await core.close()
    await mesh.stop()


def engine_requests(mesh) -> int:
    s = mesh.executors[0][1].stats()
    return s.num_finished + s.num_aborted


async def events_of(core: GatewayCore, request: GenerationRequest) -> list:
    return [event async for event in core.generate(request, TENANT)]


def without_this_call(result: ChoiceResult) -> ChoiceResult:
    """A result less what belongs to one call (its id, executor, cached flag, timings)."""
    return dataclasses.replace(result, request_id="", executor_id="", cached=False, timings=None)


async def test_a_cache_hit_replays_the_runs_choices(mesh_and_core):
    mesh, core = mesh_and_core
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=2, logprobs=2, ignore_eos=True)
    before = engine_requests(mesh)
    run = await events_of(core, GenerationRequest(prompt="List some fruits:", sampling=sampling, request_id="a"))
    hit = await events_of(core, GenerationRequest(prompt="List some fruits:", sampling=sampling, request_id="b"))
    assert engine_requests(mesh) == before + 2  # one engine request per choice, for the first call only
    assert {type(e) for e in run} <= {Queued, Delta, ChoiceResult}
    assert [(e.index, e.cached, e.executor_id) for e in run if isinstance(e, ChoiceResult)] in (
        [(0, False, "executor-0"), (1, False, "executor-0")], [(1, False, "executor-0"), (0, False, "executor-0")])
    assert [type(e) for e in hit] == [Delta, ChoiceResult, Delta, ChoiceResult]
    assert [(e.request_id, e.cached, e.executor_id, e.timings.queue_s) for e in hit[1::2]] == [("b", True, "", 0.0)] * 2
    original, replayed = ChoiceCollector(), ChoiceCollector()
    for e in run:
        original.feed(e)
    for e in hit:
        replayed.feed(e)
    a, b = original.choices(), replayed.choices()
    assert [(c.index, c.text, c.token_ids, c.logprobs) for c in b] == [(c.index, c.text, c.token_ids, c.logprobs)
                                                                       for c in a]
    assert all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in a)
    assert [without_this_call(c.result) for c in b] == [without_this_call(c.result) for c in a]


@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_ending_the_stream_cancels_the_executor_call_and_releases_the_lease(mesh_and_core, how):
    mesh, core = mesh_and_core
    eng = mesh.executors[0][1]
    aborted = eng.stats().num_aborted
    cancelled = core.metrics.registry.get_sample_value(
        "meshserve_requests_total", {"tenant": "default", "priority": "0", "outcome": "cancelled"}) or 0.0
    request = GenerationRequest(prompt_token_ids=tuple(range(1000, 1100)), request_id=f"long-{how}",
                                sampling=SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True))
    first_delta = asyncio.Event()

    async def consume(events):
        async for event in events:
            if isinstance(event, Delta) and event.token_ids:
                first_delta.set()
                if how == "close":
                    return  # leaves the stream open: the `aclosing` below closes it

    events = core.generate(request, TENANT)
    async with aclosing(events):
        task = asyncio.create_task(consume(events))
        await first_delta.wait()
        if how == "cancel":
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    while eng.stats().num_aborted == aborted:
        await asyncio.sleep(0.01)
    await mesh.wait_idle()
    stats = eng.stats()
    assert stats.num_aborted == aborted + 1 and stats.num_free_blocks == stats.num_blocks
    while mesh.scheduler.servicer.core.num_leases():
        await asyncio.sleep(0.01)
    core.end(core.prepare(request, TENANT))  # the request id is free again
    assert core.metrics.registry.get_sample_value(
        "meshserve_requests_total", {"tenant": "default", "priority": "0", "outcome": "cancelled"}) == cancelled + 1


class GivesUpAtTheAssignment(GrpcMeshClient):
    """The real scheduler client, but the caller goes away just as the Assignment
    arrives, before reading it (an HTTP client that disconnects, a gRPC caller that
    cancels, a millisecond after admission): the lease is granted, its id never seen."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.granted: list[str] = []

    async def admit(self, admission, span):
        from gateway.mesh import Assignment

        async for event in super().admit(admission, span):
            if isinstance(event, Assignment):
                self.granted.append(event.lease_id)
                raise asyncio.CancelledError
            yield event


async def test_a_caller_gone_before_reading_its_assignment_leaves_no_lease(mesh_and_core, tokenizer):
    mesh, core = mesh_and_core
    client = GivesUpAtTheAssignment(mesh.scheduler.address, mesh.tls("gateway"))
    quitter = GatewayCore(tokenizer, core.model, client)
    scheduler = mesh.scheduler.servicer.core
    request = GenerationRequest(prompt="Hi", request_id="gone", sampling=SamplingParams(max_tokens=4))
    try:
        with pytest.raises(asyncio.CancelledError):
            await events_of(quitter, request)
        assert len(client.granted) == 1  # the scheduler did grant it
        assert scheduler.lease(client.granted[0]) is None and scheduler.num_leases() == 0  # released at once
    finally:
        await quitter.close()
