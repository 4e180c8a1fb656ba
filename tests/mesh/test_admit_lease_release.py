"""The gateway releases the lease id its Admit proposed when admission ends without an
assignment it read: callers cancelled at random points of admission, and a connection
lost after the grant, leave no lease on a real mesh."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.generation import GatewayCore
from gateway.mesh_client import GrpcMeshClient
from gateway.request import GenerationRequest, ModelInfo
from gateway.tenants import Tenant
from meshserve.errors import MeshError
from meshserve.sampling import SamplingParams
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh, wait_for_condition

pytestmark = pytest.mark.model
TENANT = Tenant("default")


def held_clock() -> float:
    """The scheduler's clock, held still: no lease expires (``lease_ttl_s`` after its grant),
    so a lease the gateway fails to release stays held, however long the test waits."""
    return 1000.0


class CuttingProxy:
    """A TCP proxy gateway -> scheduler that, while ``armed``, drops the connection
    (both sides, RST) instead of forwarding the first scheduler -> gateway bytes read
    once the scheduler holds a lease: the scheduler's Admit wrote its Assignment
    (the write succeeded: it is in the proxy's socket), the gateway never reads it.
    A network blip, a proxy or a load balancer restart between gateway and scheduler."""

    def __init__(self, target: str, scheduler_core):
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.core = scheduler_core
        self.armed = True
        self.cuts = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, cr, cw):
        sr, sw = await asyncio.open_connection(self.host, self.port)

        async def pump(src, dst, from_scheduler):
            try:
                while data := await src.read(65536):
                    if from_scheduler and self.armed and self.core.num_leases() > 0:
                        self.armed = False
                        self.cuts += 1
                        cw.transport.abort()
                        sw.transport.abort()
                        return
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(cr, sw, False), pump(sr, cw, True), return_exceptions=True)

    async def close(self):
        self.server.close()


async def test_a_connection_lost_with_the_assignment_in_flight_leaves_no_lease(tokenizer):
    mesh = await start_local_mesh([make_engine(num_blocks=128)], tokenizer, tls=False, scheduler_clock=held_clock)
    scheduler = mesh.scheduler.servicer.core
    proxy = CuttingProxy(mesh.scheduler.address, scheduler)
    e0 = mesh.engines[0]
    client = GrpcMeshClient(await proxy.start())
    core = GatewayCore(tokenizer, ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision), client)
    try:
        request = GenerationRequest(prompt="Hi", request_id="blip", sampling=SamplingParams(max_tokens=4))
        with pytest.raises(MeshError) as info:
            [e async for e in core.generate(request, TENANT)]
        print("gateway saw:", info.value.code, info.value)
        assert proxy.cuts == 1
        # released, not expired (the clock is held): stranded, it would be held until the hang bound
        await wait_for_condition(lambda: scheduler.num_leases() == 0, 60, "the lease released")
    finally:
        await core.close()
        await proxy.close()
        await mesh.stop()


@pytest.mark.parametrize("seed", [1, 2])
async def test_callers_cancelled_at_random_points_of_admission_leave_nothing(tokenizer, seed):
    """Many callers that go away at random moments (queued, granted, assignment in flight,
    executing): then the scheduler holds no lease and queues nothing (released, not expired)."""
    import random

    rng = random.Random(seed)
    mesh = await start_local_mesh([make_engine(num_blocks=16)], tokenizer, tls=False, scheduler_clock=held_clock)
    scheduler = mesh.scheduler.servicer.core
    e0 = mesh.engines[0]
    client = CountingClient(mesh.scheduler.address)
    core = GatewayCore(tokenizer, ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision), client)
    try:
        async def one(i):
            request = GenerationRequest(prompt="Tell me a long story about " * 3, request_id=f"r{seed}-{i}",
                                        sampling=SamplingParams(max_tokens=64, ignore_eos=True))
            task = asyncio.ensure_future(_drain(core.generate(request, TENANT)))
            await asyncio.sleep(rng.uniform(0, 0.4))
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, MeshError):
                pass

        granted = 0
        for _ in range(4):
            await asyncio.gather(*(one(i + 100 * _) for i in range(30)))
        print("assignments read by the gateway:", client.assigned, "of 120; queued events:", client.queued)
        # released and dequeued, not expired (the clock is held): a stranded lease stays until the hang bound
        await wait_for_condition(lambda: scheduler.num_leases() == 0 and len(scheduler) == 0, 60,
                                 "every lease released and nothing queued")
    finally:
        await core.close()
        await mesh.stop()


async def _drain(events):
    async for _ in events:
        pass


class CountingClient(GrpcMeshClient):
    assigned = 0
    queued = 0

    async def admit(self, admission, span):
        from gateway.mesh import Assignment

        async for event in super().admit(admission, span):
            if isinstance(event, Assignment):
                self.assigned += 1
            else:
                self.queued += 1
            yield event
