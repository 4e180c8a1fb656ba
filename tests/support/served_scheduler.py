"""A Scheduler service on a free loopback port with one fake executor registered (its
Connect stream held open), for tests of the servicer."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from meshserve.v1 import scheduler_pb2 as pb
from meshserve.v1 import scheduler_pb2_grpc
from scheduler.admission import SchedulerConfig
from scheduler.server import start_scheduler


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
    yields ``(service, stub)``."""
    svc = await start_scheduler(0, config=config)
    channel = grpc.aio.insecure_channel(svc.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    registered, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_fake_executor(stub, num_blocks, registered, stop))
    await asyncio.wait_for(registered.wait(), 60)
    try:
        yield svc, stub
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await channel.close()
        await svc.stop(0.1)
