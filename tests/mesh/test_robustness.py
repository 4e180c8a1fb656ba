"""Request ids that clash, and an executor whose engine dies, wedges or is cut off (case C24):
nothing leaked, nothing routed to a dead executor.

No test here races the engine thread or a stopwatch: a request is kept in flight by
holding the engine before a step (``StepGate``), a wedged step is a held step whose
age the test sets on the engine's fake clock, and the deadlines of the waits only
bound a hang."""

import asyncio
import logging

import grpc
import pytest

from meshserve.client import build_request, channel, generate, generate_choices
from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from meshserve.tls import PLAINTEXT, TLSConfig
from tests.support.mesh_harness import StepGate

pytestmark = pytest.mark.model


async def test_duplicate_request_id_in_flight_is_already_exists(mesh, default_engine):
    ref = await generate(mesh.stub, build_request("The capital of France is", max_tokens=24, temperature=0))
    with StepGate(default_engine) as gate:
        first = asyncio.create_task(generate(mesh.stub, build_request(
            "The capital of France is", max_tokens=24, temperature=0, request_id="dup")))
        await gate.hold()  # the first call reached the engine, which is held: it cannot finish meanwhile
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(mesh.stub, build_request("hello", max_tokens=4, request_id="dup"), timeout=HANG_S)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'dup'" in info.value.details()
    out = await asyncio.wait_for(first, 60)
    assert out.token_ids == ref.token_ids  # the first caller is untouched
    # the id is free again once the first request finished
    again = await generate(mesh.stub, build_request("The capital of France is", max_tokens=24, temperature=0,
                                                    request_id="dup"))
    assert again.token_ids == ref.token_ids
    await mesh.wait_idle()
    assert mesh.scheduler.servicer.core.num_leases() == 0


async def test_scheduler_rejects_a_queued_duplicate(mesh):
    """A direct Admit caller (a second gateway) reusing a leased id gets ALREADY_EXISTS."""
    async with channel(mesh.scheduler.address, mesh.tls("gateway")) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        admit = scheduler_pb2.AdmitRequest(request_id="twice", tenant="default", num_prompt_tokens=5, max_tokens=4)
        events = [e async for e in stub.Admit(admit)]
        lease_id = events[-1].assignment.lease_id
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [e async for e in stub.Admit(admit)]
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        await stub.Release(scheduler_pb2.ReleaseRequest(lease_id=lease_id))
        assert mesh.scheduler.servicer.core.num_leases() == 0


async def test_caller_ids_never_collide_with_choice_ids(mesh):
    """Caller id "a#1" (n=1) runs alongside caller id "a" with n=2: each gets its own answers."""
    solo_hash = await generate(mesh.stub, build_request("Once upon a time", max_tokens=16, temperature=0))
    solo_two = await generate_choices(mesh.stub, build_request("Roses are red,", max_tokens=16, temperature=0.8,
                                                               seed=5, n=2))
    both = await asyncio.gather(
        generate(mesh.stub, build_request("Once upon a time", max_tokens=16, temperature=0, request_id="a#1")),
        generate_choices(mesh.stub, build_request("Roses are red,", max_tokens=16, temperature=0.8, seed=5, n=2,
                                                  request_id="a")),
    )
    assert both[0].token_ids == solo_hash.token_ids
    assert [c.token_ids for c in both[1]] == [c.token_ids for c in solo_two]
    await mesh.wait_idle()


async def test_dead_engine_leaves_the_mesh(tokenizer):
    """Case C24 (a): the engine thread raises: the caller gets UNAVAILABLE, the
    executor turns NOT_SERVING and leaves the registry, and later requests are not
    routed to it."""
    from grpc_health.v1 import health_pb2

    from tests.support.engines import make_engine
    from tests.support.mesh_harness import start_local_mesh

    engine = make_engine(num_blocks=64)
    m = await start_local_mesh([engine], tokenizer)
    try:
        await generate(m.stub, build_request("Hi", max_tokens=2, temperature=0))

        idle_step = engine.step

        def broken_step():  # the device fails under a request (an idle engine still steps to flush its stats)
            if engine.has_unfinished_requests():
                raise RuntimeError("device lost")
            return idle_step()

        engine.step = broken_step
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(m.stub, build_request("Hello there", max_tokens=4), timeout=HANG_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine failed: RuntimeError: device lost" in info.value.details()
        svc, async_engine, _ = m.executors[0]
        assert isinstance(async_engine.failure, RuntimeError)
        await _wait_until(lambda: _empty(m.scheduler.servicer.core), HANG_S)
        assert await _health(svc.address, m.tls()) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(m.stub, build_request("Hello", max_tokens=2), timeout=HANG_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no executor" in info.value.details()
        assert m.scheduler.servicer.core.num_leases() == 0
    finally:
        await m.stop()


HANG_S = 120.0  # the waits' bound: it only stops a hang, it never decides on speed


async def _wait_until(predicate, timeout_s: float = HANG_S) -> None:
    """Polls the async ``predicate`` every 50 ms until it is true.

    Raises:
        AssertionError: still false after ``timeout_s`` (a hang).
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not await predicate():
        assert loop.time() - t0 < timeout_s, f"not true within {timeout_s} s"
        await asyncio.sleep(0.05)


async def _health(address: str, tls: TLSConfig = PLAINTEXT) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with channel(address, tls) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=HANG_S)
        return resp.status


async def test_wedged_step_turns_not_serving_then_recovers(tokenizer):
    """Case C24 (b): a step wedged past --step-timeout-s: in-flight requests end
    UNAVAILABLE (no hang), the executor is NOT_SERVING and unrouted; once the step
    returns it is SERVING and registered again, and nothing leaked.

    The wedge is a step held by a ``StepGate``; its age is set on the engine's fake
    clock (1.5 s against a 1 s timeout), so no real step can look wedged on a slow
    machine and the test waits for no real second. The watchdog acts at its next
    poll (0.25 s), well within C24's 5 s."""
    from grpc_health.v1 import health_pb2

    from tests.support.engines import make_engine
    from tests.support.mesh_harness import start_local_mesh

    engine = make_engine(num_blocks=64)
    m = await start_local_mesh([engine], tokenizer, step_timeout_s=1.0)
    svc, async_engine, _ = m.executors[0]
    core = m.scheduler.servicer.core
    now = [1000.0]
    async_engine.clock = lambda: now[0]  # the engine is idle: no step began on the real clock
    try:
        ref = await generate(m.stub, build_request("The capital of France is", max_tokens=8, temperature=0))
        with StepGate(engine) as gate:
            call = asyncio.create_task(generate(m.stub, build_request("Count: one, two,", max_tokens=200,
                                                                      ignore_eos=True), timeout=HANG_S))
            await gate.hold()  # a step of the call is wedged from here on...
            now[0] += 1.5      # ...and has run for 1.5 s
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine step has run for 1.5 s (step timeout 1 s)" in info.value.details()
            await _wait_until(lambda: _is(svc.address, health_pb2.HealthCheckResponse.NOT_SERVING, m.tls()))
            await _wait_until(lambda: _empty(core))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(m.stub, build_request("Hello", max_tokens=2), timeout=HANG_S)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # the gate is open: the step returns (recovery)
        await _wait_until(lambda: _is(svc.address, health_pb2.HealthCheckResponse.SERVING, m.tls()))
        assert [e.executor_id for e in core.registry] == ["executor-0"]
        again = await generate(m.stub, build_request("The capital of France is", max_tokens=8, temperature=0))
        assert again.token_ids == ref.token_ids
        await m.wait_idle()
        assert core.num_leases() == 0
        assert svc.watchdog.num_wedged == 1
    finally:
        await m.stop()


async def _is(address: str, status: int, tls: TLSConfig = PLAINTEXT) -> bool:
    return await _health(address, tls) == status


async def _empty(core) -> bool:
    return list(core.registry) == []


async def test_unreachable_executor_is_dropped_and_gateway_not_ready(tokenizer, caplog):
    """Case C24 (c): the executor is alive but its link to the scheduler is
    partitioned: the scheduler drops it for its silence (no report for
    executor_timeout_s, 3 s, by the scheduler's own timer: the log says so) and the
    gateway turns NOT_SERVING (no executor); requests get UNAVAILABLE, not a hang.
    Healed, the executor re-registers, the gateway is SERVING and requests complete."""
    from grpc_health.v1 import health_pb2

    from executor.server import start_executor
    from gateway.request import ModelInfo
    from gateway.server import start_gateway
    from meshserve.v1 import gateway_pb2_grpc
    from scheduler.server import start_scheduler
    from tests.support.engines import make_engine
    from tests.support.net_fault import FreezableProxy

    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    engine = make_engine(num_blocks=64)
    scheduler = await start_scheduler(0)
    proxy = FreezableProxy(scheduler.address)
    await proxy.start()
    svc, async_engine, link = await start_executor(engine, 0, scheduler_address=proxy.address,
                                                   executor_id="executor-0")
    info = ModelInfo(engine.model_id, engine.max_model_len, engine.vocab_size)
    gateway = await start_gateway(tokenizer, info, scheduler.address, 0)
    core = scheduler.servicer.core
    try:
        async with channel(gateway.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            # the gateway's readiness probe polls the scheduler every 0.5 s: wait for its first yes
            await _wait_until(lambda: _is(gateway.address, SERVING))
            ref = await generate(stub, build_request("The capital of France is", max_tokens=8, temperature=0))

            with caplog.at_level(logging.WARNING, logger="scheduler.server"):
                proxy.freeze()
                await _wait_until(lambda: _empty(core))
            # dropped for its silence (the stream did not end): executor_timeout_s, not less
            assert "executor executor-0 silent for 3.0 s: dropped as unreachable" in caplog.text
            await _wait_until(lambda: _is(gateway.address, NOT_SERVING))
            assert await _health(svc.address) == SERVING  # the executor itself is fine
            with pytest.raises(grpc.aio.AioRpcError) as info_:
                await generate(stub, build_request("Hello", max_tokens=2), timeout=HANG_S)
            assert info_.value.code() == grpc.StatusCode.UNAVAILABLE

            proxy.thaw()
            await _wait_until(lambda: _is(gateway.address, SERVING))
            assert [e.executor_id for e in core.registry] == ["executor-0"]
            again = await generate(stub, build_request("The capital of France is", max_tokens=8, temperature=0))
            assert again.token_ids == ref.token_ids
            assert core.num_leases() == 0
    finally:
        await gateway.stop(0.2)
        await gateway.servicer.close()
        await svc.watchdog.stop()
        await svc.stop(0.2)
        await link.stop()
        await async_engine.stop()
        await proxy.stop()
        await scheduler.stop(0.2)
