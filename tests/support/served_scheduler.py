"""A Scheduler service on a free loopback port with one fake executor registered (its
Connect stream held open), for tests of the servicer; over mutual TLS (the fake
executor with the executor role's certificate, the yielded stub with the gateway's)."""

from __future__ import annotations

import asyncio
import contextlib

from meshserve.v1 import scheduler_pb2 as pb
from meshserve.v1 import scheduler_pb2_grpc
from scheduler.config import SchedulerConfig
from meshserve.grpc_server import open_channel
from scheduler.server import start_scheduler
from tests.support.tls import role_tls


async def _fake_executor(stub, num_blocks, registered: asyncio.Event, stop: asyncio.Event):
    async def messages():
        yield pb.ExecutorMessage(register=pb.ExecutorRegister(
            executor_id="e0", address="127.0.0.1:1", model="m", num_blocks=num_blocks, block_size=16,
            max_model_len=4096))
        await stop.wait()

    call = stub.Connect(messages())
    async for _ in call:
        registered.set()
    return call


@contextlib.asynccontextmanager
async def served_scheduler(config: SchedulerConfig, num_blocks: int = 4):
    """A scheduler on a free port with one fake executor of ``num_blocks`` registered:
    yields ``(service, stub)``, the stub a gateway's."""
    svc = await start_scheduler(0, config=config, tls=role_tls("scheduler"))
    channel = open_channel(svc.address, role_tls("gateway"))
    executor_channel = open_channel(svc.address, role_tls("executor"))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    registered, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_fake_executor(scheduler_pb2_grpc.SchedulerStub(executor_channel), num_blocks,
                                              registered, stop))
    await asyncio.wait_for(registered.wait(), 60)
    try:
        yield svc, stub
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await channel.close()
        await executor_channel.close()
        await svc.stop(0.1)
